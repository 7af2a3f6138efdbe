#!/usr/bin/env bash
# One call on a lent GPU machine (an H100/H200 image with PyTorch, no fastai, no network), within about 10 minutes,
# each part's log under $OUT as it runs, so that a run cut off still returns what it measured:
#   L, first and alone (issue 67, the lean step): bench/gpu.py's main table and profile on the GPT and the CNN for a learner's
#      default optimizer (fastai's Adam) under fastai's own callbacks and mpx's (the verdict on the device, and read by the
#      host), torch's fused AdamW (handed the verdict), compiled AMP against the raw fused loop, pure kahan and stochastic
#      compiled -> lean.log; then bench/lean_memory.py --device cuda (each mode's training peak beside the raw autocast loop,
#      GPT-2's vocabulary) -> lean_memory.log
#   A, side by side (correctness and memory, not timings): the tests that skip without CUDA and the engine's tests on the
#      device (fastai puts a learner where CUDA is: every mode, compiled steps, low-bit state, kept layouts, saves,
#      checkpoints, a declared step function compiled, torch's storage paths) -> tests.log; tests/apps/test_vision.py
#      (resnet18 and xresnet18 fine-tuned in every mode beside fp32)
#      -> vision.log; bench/session_memory.py --device cuda (max_memory_allocated per call, per mode, with the advisor's
#      predicted peaks) -> session.log
#   B, alone (timings): bench/gpu.py's host syncs and main table (GPT, then the CNN: mpx eager and compiled beside raw loops,
#      torch's fused AdamW among them) -> gpu_main.log; its low-bit state section -> gpu_lowbit.log
# pytest is stopped by SIGINT at its limit, so that it still prints the tracebacks of what failed so far.
# Measured on an H200 (2026-11-28, torch 2.11): part A's tests took more than 170 s (94% done), gpu.py main 172 s, lowbit 95 s.
# Here first: `bash bench/gpu_wheels.sh` (bench/wheels: fastai and what it needs that the image lacks); carry bench/wheels.
# `bash bench/gpu_check.sh --smoke` runs it in miniature on this machine's CPU with the .venv (OUT=/tmp/gpu_check by default).
set -uo pipefail
cd "$(dirname "$0")/.."
SMOKE=$([ "${1:-}" = --smoke ] && echo 1 || echo)
OUT=${OUT:-/tmp/gpu_check}; mkdir -p "$OUT"
TL=${TL:-240} TM=${TM:-90} TA=${TA:-150} TB1=${TB1:-60} TB2=${TB2:-60}  # seconds for L's two parts, A, and B's two: 10 minutes in all
export PYTHONUNBUFFERED=1
if [ -z "$SMOKE" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site bench/wheels/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD; PY=python3; DEVICE=cuda
  TESTS=${TESTS:-"tests/test_gpu.py tests/test_syncs.py tests/test_lean_step.py tests/test_own_step.py tests/test_fp8.py tests/test_engine.py tests/test_compiled_steps.py
         tests/test_lowbit.py tests/test_kept_layout.py tests/test_checkpoints.py tests/test_one_truth.py tests/test_pure.py
         tests/test_master.py tests/test_fused_modes.py tests/test_wrong_steps.py tests/test_visible_state.py
         tests/test_storage_paths.py tests/test_store_edges.py tests/test_amp_integration.py tests/test_leaks.py"}
  # torchao's AdamW8bit compiles its kernels in each fresh process (136 s on the H200): an anchor left to ARMS='...'
  ARMS=${ARMS:-"fastai fp32,fastai + optimi kahan AdamW (bf16 model),mpx AMP bf16,mpx AMP bf16 compile,mpx AMP bf16 8bit,mpx master bf16,mpx pure kahan,mpx pure kahan 8bit,mpx pure kahan 8bit compile"}
  SESSION=(--arms "$ARMS"); GPU=(); WORKERS=8
else
  export PYTHONPATH=$PWD; PY=${PY:-$PWD/.venv/bin/python}; DEVICE=cpu
  TESTS=${TESTS:-"tests/test_gpu.py tests/test_syncs.py"}; SESSION=(--small --arms 'fastai fp32,mpx pure kahan 8bit'); GPU=(--smoke); WORKERS=2
fi
{ nvidia-smi -L 2>&1; $PY -c "import sys, torch, fastai, mpx; print('python', sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.version.cuda, 'fastai', fastai.__version__, 'mpx', mpx.__version__)"; } > "$OUT/env.log" 2>&1
cat "$OUT/env.log"

echo "# L: the lean step (issue 67), alone, at $SECONDS s"
LEAN="fastai bf16 Adam,mpx bf16 Adam,mpx bf16 Adam host read,mpx bf16 Adam DeviceLosses,fastai bf16 Adam DeviceLosses"
LEAN="$LEAN,fastai fp16 Adam,mpx fp16 Adam,fastai bf16 fused AdamW"
LEAN="$LEAN,mpx bf16 fused AdamW,mpx bf16 Adam compile,raw AMP bf16 loop fused AdamW,mpx pure kahan Adam compile"
LEAN="$LEAN,mpx pure stochastic Adam compile,fastai bf16,mpx bf16"
(cd bench && timeout -s INT $TL $PY gpu.py "${GPU[@]}" --rounds 3 --only main,profile --models gpt,cnn --modes "$LEAN" \
  --plots /tmp/gpu_plots > "$OUT/lean.log" 2>&1)
grep -A4 "^| model | mpx bf16 Adam vs fastai" "$OUT/lean.log" | head -5
LM=(); [ -n "$SMOKE" ] && LM=(--seq 32 --bs 2 --steps 2 --arms 'raw autocast,mpx AMP bf16')
timeout $TM $PY bench/lean_memory.py --device $DEVICE "${LM[@]}" > "$OUT/lean_memory.log" 2>&1
grep "^|" "$OUT/lean_memory.log"

echo "# A: tests, vision, session memory (side by side, $TA s at most) at $SECONDS s"
timeout -s INT -k 15 $TA $PY -m pytest -p no:cacheprovider -v -rfEs --tb=short -n $WORKERS --dist loadfile $TESTS > "$OUT/tests.log" 2>&1 &
if [ -z "$SMOKE" ]; then
  timeout -s INT -k 15 $TA $PY -m pytest -p no:cacheprovider -v -rfEs --tb=short -n 4 tests/apps/test_vision.py > "$OUT/vision.log" 2>&1 &
fi
timeout $TA $PY bench/session_memory.py --device $DEVICE "${SESSION[@]}" > "$OUT/session.log" 2>&1 &
wait
tail -n 4 "$OUT/tests.log"; [ -z "$SMOKE" ] && tail -n 4 "$OUT/vision.log"; sed -n '1,/^$/p;/^| arm | training/,/^$/p' "$OUT/session.log" | head -30

[ -n "${NO_B:-}" ] && exit 0  # NO_B=1: part A alone (a second call, say)
echo "# B: bench/gpu.py alone at $SECONDS s"
MODES="mpx bf16,mpx bf16 Adam,mpx bf16 Adam compile,mpx pure kahan Adam compile,mpx pure bf16 kahan,mpx fp16,fastai bf16"
MODES="$MODES,raw AMP bf16 loop fused AdamW"
(cd bench && timeout $TB1 $PY gpu.py "${GPU[@]}" --rounds 3 --only syncs,main --models gpt,cnn --modes "$MODES" \
  --plots /tmp/gpu_plots > "$OUT/gpu_main.log" 2>&1)
grep -A3 "^| model | mpx bf16 Adam vs fastai" "$OUT/gpu_main.log" | head -4
(cd bench && timeout $TB2 $PY gpu.py "${GPU[@]}" --rounds 3 --only lowbit --models gpt > "$OUT/gpu_lowbit.log" 2>&1)
grep "^| GPT" "$OUT/gpu_lowbit.log" | head -12
echo "# done at $SECONDS s"
