"""mpx as a user gets it: an sdist and a wheel built with `python -m build` from a clean checkout, the wheel installed into a
fresh venv outside the repository and run there (tests/smoke.py); the extras, and the errors that name them; floors that
are the versions `make compat` ran.

The build and the fresh venv cost about two minutes: pip takes torch, fastai and the rest from the pins of constraints.txt
(torch's local CPU wheel), as `make test` does."""
import configparser, os, re, shutil, subprocess, sys, tarfile, zipfile
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parent.parent
CFG = configparser.ConfigParser(delimiters=['='])
CFG.read(ROOT/'settings.ini')
CFG = CFG['DEFAULT']

def run(*args, cwd=None, env=None, timeout=900) -> str:
    "Run `args`, return its output; fail the test with that output where it fails"
    p = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode: pytest.fail(f"{' '.join(map(str, args))} exited {p.returncode}:\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
    return p.stdout + p.stderr

def checkout(dest:Path) -> Path:
    "The files a clean clone of this working tree has (tracked, and new ones git does not ignore): what CI's clone builds"
    files = subprocess.run(['git', 'ls-files', '-z', '--cached', '--others', '--exclude-standard'], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split('\0')
    for f in filter(None, files):
        if (ROOT/f).is_file():
            (dest/f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT/f, dest/f)
    return dest

@pytest.fixture(scope='module')
def dist(tmp_path_factory) -> Path:
    "The sdist, and the wheel built from it (`python -m build` builds the wheel from the sdist, so a file the sdist lacks fails it)"
    src = checkout(tmp_path_factory.mktemp('clone'))
    out = tmp_path_factory.mktemp('dist')
    run(sys.executable, '-m', 'build', '--outdir', out, src)
    return out

def _one(dist:Path, pat:str) -> Path:
    found = sorted(dist.glob(pat))
    assert len(found) == 1, f"{pat}: {found}"
    return found[0]

def test_sdist_holds_what_a_build_and_its_tests_need(dist):
    "The sdist has settings.ini (setup.py reads it), LICENSE, pytest.ini, and every test with its conftest and workers."
    with tarfile.open(_one(dist, 'mpx-*.tar.gz')) as t: names = {n.split('/', 1)[1] for n in t.getnames() if '/' in n}
    need = {'settings.ini', 'setup.py', 'pyproject.toml', 'LICENSE', 'README.md', 'pytest.ini', 'constraints.txt', 'constraints-apps.txt',
            'tests/conftest.py', 'tests/torchrun.py', 'mpx/__init__.py'} | {str(p.relative_to(ROOT)) for p in (ROOT/'tests').rglob('*.py')}
    assert not need - names, sorted(need - names)
    assert not [n for n in names if '__pycache__' in n or n.startswith(('.venv', '_docs', '_proc', 'bench/'))]

def test_wheel_metadata(dist):
    "The wheel carries the license file, settings.ini's status and floors, and one extra a feature."
    with zipfile.ZipFile(_one(dist, 'mpx-*.whl')) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith('.dist-info/METADATA'))).decode()
    assert any(n.endswith('.dist-info/licenses/LICENSE') for n in names) and re.search(r'^License(-Expression)?: Apache-2.0$', meta, re.M)
    statuses = {'3': '3 - Alpha', '4': '4 - Beta'}
    assert f"Classifier: Development Status :: {statuses[CFG['status']]}" in meta
    for r in CFG['requirements'].split(): assert f'Requires-Dist: {_spec(r)}\n' in meta, r
    assert 'Requires-Dist: accelerate' in meta and 'extra == "fsdp"' in meta and 'extra == "fp8"' in meta
    assert not [n for n in names if n.startswith('tests/')]

def _spec(req:str) -> str:
    "`req` as the wheel's metadata writes it: its specifiers sorted, as packaging does"
    name,_,specs = re.match(r'([A-Za-z0-9_.-]+)(.*)', req).group(1, 0, 2)
    return name + ','.join(sorted(specs.split(',')))

def test_wheel_in_a_fresh_venv(dist, tmp_path):
    "The wheel, with both extras, in a venv of its own outside the repository: every mode fits, precision_report, to_fp8, to_fsdp's import."
    venv = tmp_path/'venv'
    run(sys.executable, '-m', 'venv', venv)
    py = venv/'bin'/'python'
    whl = _one(dist, 'mpx-*.whl')
    run(py, '-m', 'pip', 'install', '-q', '-c', ROOT/'constraints.txt', f'mpx[fp8,fsdp] @ {whl.as_uri()}', timeout=1200)
    shutil.copy(ROOT/'tests'/'smoke.py', tmp_path/'smoke.py')
    env = {k: v for k,v in os.environ.items() if k not in ('PYTHONPATH', 'VIRTUAL_ENV')}
    out = run(py, tmp_path/'smoke.py', cwd=tmp_path, env=env)
    assert f"from {venv}" in out, out  # the installed wheel, not the repository's mpx/
    assert re.search(r'^smoke: 7 fits passed$', out, re.M) and 'import mpx.distributed: ok' in out, out

MISSING = """
import sys
sys.modules[{mod!r}] = None  # as if it were not installed: importing it raises ImportError
from fastai.basics import *
from mpx.all import *
from mpx.test_utils import tiny_learner
try: {call}
except ImportError as e: print('ImportError:', e)
"""

@pytest.mark.parametrize('mod,call,extra', [('accelerate', 'import mpx.distributed', 'fsdp'),
                                            ('torchao', 'tiny_learner().to_fp8()', 'fp8'),
                                            ('torchao', 'from mpx.fp8 import fp8_recipes; fp8_recipes()', 'fp8')])
def test_missing_extra_is_named(mod, call, extra):
    "Where an extra's package is missing, the call that needs it raises an ImportError naming the extra to install."
    out = run(sys.executable, '-c', MISSING.format(mod=mod, call=call), cwd=ROOT)
    assert "ImportError:" in out and f"pip install 'mpx[{extra}]'" in out, out

def test_floors_are_what_compat_runs():
    "settings.ini's floors of torch, fastai and fastcore are the versions constraints-min.txt pins for `make compat`."
    pins = dict(l.split('==') for l in (ROOT/'constraints-min.txt').read_text().splitlines() if '==' in l and not l.startswith('#'))
    floors = dict(re.match(r'([a-z]+)>=([0-9.]+)', r).groups() for r in CFG['requirements'].split())
    for k in ('torch', 'fastai', 'fastcore'): assert pins[k].startswith(floors[k]), (k, pins[k], floors[k])
    assert pins['accelerate'].startswith(re.search(r'accelerate>=([0-9.]+)', CFG['fsdp_requirements']).group(1))
