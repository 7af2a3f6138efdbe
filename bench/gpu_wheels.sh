#!/usr/bin/env bash
# Download into bench/wheels/ the wheels that `bench/gpu.py` needs on a GPU machine that has PyTorch but neither fastai nor
# a network (the project's lent H100/H200 image: Python 3.12 with numpy, pandas, scipy, scikit-learn, matplotlib, requests,
# rich ... already there). These are the pure-Python packages that `import mpx.all` loads and that image lacks, at the
# versions of this checkout's .venv, built for the target's Python (TARGET_PY, 3.12 by default; one of them, plum-dispatch,
# is compiled), torch-optimi (pure Python, the .venv's version: gpu.py's optimi section imports it) and torchao (TORCHAO,
# 0.18.0 by default; TORCHAO= leaves it out) for the fp8 paths. DEST (bench/wheels by default) ignores itself in git; carry it
# with the working tree (run's `carry`), then there (the image's pip is there, no network needed):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site bench/wheels/*.whl && export PYTHONPATH=/tmp/site:$PWD
#   python3 bench/gpu.py --plots $OUT
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
TARGET_PY=${TARGET_PY:-3.12}
DEST=${DEST:-bench/wheels}
TORCHAO=${TORCHAO-0.18.0}
PKGS="fastai fastcore fastprogress fasttransform fastdownload plum-dispatch beartype python-fasthtml starlette itsdangerous python-multipart"
PKGS="$PKGS torch-optimi"  # gpu.py's optimi section, not mpx
# each at the .venv's version, or constraints.txt's pin where the .venv lacks it (torch-optimi: `make bench` installs it)
pins=$($PY - $PKGS <<'PY'
import importlib.metadata as m, re, sys
pinned = dict(re.findall(r'^([\w.-]+)==(\S+)', open('constraints.txt').read(), re.M))
def version(p):
    try: return m.version(p)
    except m.PackageNotFoundError: return pinned[p]
print(' '.join(f'{p}=={version(p)}' for p in sys.argv[1:]))
PY
)
pins="$pins${TORCHAO:+ torchao==$TORCHAO}"
mkdir -p "$DEST" && echo '*' > "$DEST/.gitignore"
rm -f "$DEST"/*.whl
$PY -m pip download --quiet --no-deps --only-binary=:all: --python-version "$TARGET_PY" --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DEST" $pins 2> >(grep -v "is ignored: it is neither" >&2)
ls "$DEST"/*.whl
