"""Shared by every test file: the compiled cases (marked `compiled`) skip with the reason where `torch.compile` cannot build a
kernel, and fail where it can but no kernel ran or a kernel quietly fell back to the eager step; `one_thread`; the end of the run
says what it skipped and why, grouped by reason. `MPX_PLANTED=name` runs the session under `planted.name` (a negative control's).
`MPX_SKIP_ON_DEVICE=1` runs it with every step's verdict kept on the device, as on a GPU (`PrecisionCallback.skip_on_device`):
the tests of the host path's own reads and diagnosis then fail, as they should."""
import contextlib, functools, os, re
from collections import Counter
import pytest, torch
from mpx.test_utils import one_thread as _one_thread, KernelRuns
from mpx.compiled import _failed as _fallbacks  # the engine's record of kernels that failed to compile: the one line naming it

def pytest_configure(config):
    # `make test` runs a worker on each core (pytest-xdist): one thread each, or OpenMP's spinning stalls both
    if os.environ.get('PYTEST_XDIST_WORKER'): torch.set_num_threads(1)
    config.addinivalue_line('markers', "compiled: runs mpx's compiled step (`fused='compile'`) or inductor; skipped where torch.compile "
                                       "cannot build")

@functools.cache
def why_not_compiled() -> str|None:
    "Why torch.compile builds no kernel on this machine (a missing C++ compiler, say), or None where it does"
    try: ok = bool(torch.compile(lambda x: x + 1)(torch.ones(2)).eq(2).all())
    except Exception as e: return f'{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}' if str(e).strip() else type(e).__name__
    return None if ok else 'a compiled function computed a wrong result'

def compiles() -> bool: return why_not_compiled() is None

@pytest.fixture(scope='session')
def _slow_advice():
    "The slow-dtype advice of this machine (`warn_if_slow`'s keys), given once, unseen"
    import warnings
    from mpx.hardware import warn_if_slow, _slow_warned
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for mode in ('bf16', 'fp16'): warn_if_slow('cpu', mode)
    return set(_slow_warned)

@pytest.fixture(autouse=True)
def _slow_advice_given(_slow_advice):
    """`to_fp16()`/`to_bf16()` advise once a process where a dtype is slow on this machine (fp16 on a CPU without fp16
    arithmetic): counted as given before each test, so that it is not printed by whichever test first calls one. The tests
    of that advice forget it first (`reset_slow_warnings`) and assert it."""
    from mpx.hardware import _slow_warned
    _slow_warned.update(_slow_advice)

@pytest.fixture(scope='session', autouse=True)
def _temp_dirs(tmp_path_factory):
    "`tempfile`'s folders (a test's `mkdtemp()`, a library's) under pytest's own, which pytest prunes: none left in /tmp after a run"
    import getpass, tempfile
    # inductor's cache stays where it was: a cache made anew each run costs minutes of compiles
    os.environ.setdefault('TORCHINDUCTOR_CACHE_DIR', os.path.join(tempfile.gettempdir(), f'torchinductor_{getpass.getuser()}'))
    tempfile.tempdir = str(tmp_path_factory.mktemp('tempfile'))
    was = os.environ.get('TMPDIR')
    os.environ['TMPDIR'] = tempfile.tempdir  # and the subprocesses' (a fresh venv, a torchrun, a script's run)
    yield
    tempfile.tempdir = None
    if was is None: os.environ.pop('TMPDIR')
    else: os.environ['TMPDIR'] = was

@pytest.fixture(scope='session', autouse=True)
def _skip_on_device():
    "Every precision callback's verdict on the device where `MPX_SKIP_ON_DEVICE=1` (a GPU's path, on the CPU)"
    if os.environ.get('MPX_SKIP_ON_DEVICE') != '1':
        yield
        return
    from mpx.callback import PrecisionCallback
    PrecisionCallback.skip_on_device = True
    yield
    PrecisionCallback.skip_on_device = None

@pytest.fixture(scope='session', autouse=True)
def _planted():
    "The whole session under the planted bug `MPX_PLANTED` names, `name` or `name:number` (`lr_scaled:1.05`); none by default"
    name = os.environ.get('MPX_PLANTED')
    if not name:
        yield
        return
    import planted
    name,*arg = name.split(':')
    with getattr(planted, name)(*map(float, arg)): yield

@pytest.fixture(autouse=True)
def _compiled_for_real(request):
    """A `compiled` case skips, with the reason, where torch.compile builds nothing (it would compare the eager step with itself);
    where it builds, a case that ran no compiled kernel, or whose kernel fell back to the eager step (a recompile limit, a compile
    error), fails"""
    marked = request.node.get_closest_marker('compiled') is not None
    if marked and not compiles(): pytest.skip(f'torch.compile cannot build a kernel here ({why_not_compiled()})')
    before = dict(_fallbacks)
    with KernelRuns() if marked else contextlib.nullcontext() as runs: yield
    call = getattr(request.node, '_call_report', None)  # a case that skipped or failed has said what it had to say
    if marked and call is not None and call.passed and not runs.n:
        pytest.fail('this `compiled` case ran no compiled kernel: the eager step ran in its place')
    new = {k: v for k,v in _fallbacks.items() if k not in before}
    _fallbacks.clear(); _fallbacks.update(before)
    if not new: return
    if compiles(): pytest.fail(f"a kernel stepped eagerly on a machine that compiles: {new}")
    if not marked: pytest.fail(f"this case compiles (a kernel fell back here: {new}): mark it `compiled`, so it skips with the reason")

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    "Keep each case's report of its call, for `_compiled_for_real`'s teardown"
    rep = (yield).get_result()
    if rep.when == 'call': item._call_report = rep

@pytest.fixture
def one_thread():
    "One intra-op thread for the test: tiny tensors, and OpenMP's spinning on a busy 2-core machine made BatchNorm 100x slower"
    with _one_thread(): yield

# ---- the end of the run: what was skipped, and why

def _reason(rep) -> str:
    "A skip's reason, without the 'Skipped: ' pytest puts before it"
    msg = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
    return re.sub(r'^Skipped: ', '', msg)

@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter):
    "After pytest's own summary: the skipped cases counted by reason, most first, and the expected failures: what this run did not check"
    yield
    tr = terminalreporter
    skipped = Counter(_reason(r) for r in tr.stats.get('skipped', []))
    xfailed = Counter(getattr(r, 'wasxfail', '') or 'expected failure' for r in tr.stats.get('xfailed', []))
    if not skipped and not xfailed: return
    tr.write_sep('=', f'not checked in this run: {sum(skipped.values())} skipped, {sum(xfailed.values())} expected to fail')
    for why,n in skipped.most_common(): tr.write_line(f'{n:5d} skipped: {why}')
    for why,n in xfailed.most_common(): tr.write_line(f'{n:5d} xfail:   {why}')
