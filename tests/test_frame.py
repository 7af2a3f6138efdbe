"The package frame: public names, metadata in one place, the two README commands."
import configparser, re, subprocess, sys, tomllib
from pathlib import Path
import mpx, mpx.all

ROOT = Path(__file__).parent.parent

PUBLIC = ['AMPMode', 'LossScaler', 'PrecisionCallback', 'MixedPrecision', 'MasterPrecision', 'PureBF16', 'FP8Precision', 'PrecisionReport',
          'DeviceLosses']

def test_public_names():
    "`from mpx.all import *` gives exactly the user-facing names: `AMPMode`, `LossScaler`, the precision callbacks, the report, `DeviceLosses`."
    ns = {}
    exec('from mpx.all import *', ns)
    assert sorted(k for k in ns if k != '__builtins__') == sorted(PUBLIC)

def test_public_names_come_from_modules():
    "Each public name is in its module's `__all__`, beside the helpers imported from that module (not from `mpx.all`)."
    mods = [p.stem for p in (ROOT/'mpx').glob('*.py') if not p.stem.startswith('_') and p.stem not in ('all', 'test_utils')]
    assert set(PUBLIC) <= {n for m in mods for n in __import__(f'mpx.{m}', fromlist=['__all__']).__all__}

def test_version_in_one_place():
    "The package version is settings.ini's."
    cfg = configparser.ConfigParser(delimiters=['=']); cfg.read(ROOT/'settings.ini')
    assert mpx.__version__ == cfg['DEFAULT']['version']

def test_pyproject_holds_no_metadata():
    "pyproject.toml has only [build-system] and [tool.nbdev]; metadata lives in settings.ini."
    d = tomllib.loads((ROOT/'pyproject.toml').read_text())
    assert set(d) == {'build-system', 'tool'} and set(d['tool']) == {'nbdev'}

def test_readme_quick_start_has_two_commands():
    "README's Quick start shows exactly `make demo` and `make test`, and `.ci/run` calls `make test`."
    qs = (ROOT/'README.md').read_text().split('## Quick start')[1].split('\n## ')[0]
    block = re.search(r'```sh\n(.*?)```', qs, re.S).group(1)
    assert [l.split('#')[0].strip() for l in block.strip().splitlines()] == ['make demo', 'make test']
    assert 'make test' in (ROOT/'.ci/run').read_text()

def test_constraints_pin_torch():
    "The set-up pins the local CPU torch wheel and its torchvision."
    pins = (ROOT/'constraints.txt').read_text().split()
    assert {'torch==2.13.0', 'torchvision==0.28.0'} <= set(pins)
