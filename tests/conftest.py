"""Shared by every test file: a `fused='compile'` case whose kernel quietly fell back to the eager step fails."""
import functools
import pytest, torch
from mpx.compiled import _failed

@functools.cache
def compiles() -> bool:
    "Whether torch.compile builds a kernel on this machine (no C++ compiler: mpx steps eagerly, and says why)"
    try: return bool(torch.compile(lambda x: x + 1)(torch.ones(2)).eq(2).all())
    except Exception: return False

@pytest.fixture(autouse=True)
def _compiled_for_real():
    "A case whose kernel fell back to eager steps (a recompile limit, a compile error) fails here, where the machine compiles"
    before = dict(_failed)
    yield
    new = {k: v for k,v in _failed.items() if k not in before}
    _failed.clear(); _failed.update(before)
    if new and compiles(): pytest.fail(f"a kernel stepped eagerly on a machine that compiles: {new}")
