#!/usr/bin/env bash
# GPU-only: the trainer's whole GRPO step on one CUDA device, 3 steps of a tiny model
# (benchmarks/gpu_trainer_smoke.py: setup + Trainer.step(), one '[smoke] step' line each, exit 1
# when a step is not finite or the weights did not change). Run on the lent GPU machine in one
# call (device tool: `bash benchmarks/gpu_trainer_smoke.sh`, timeout_s 240; expected ~1-2 min:
# ~5 s torch, ~7 s megatron-core import, a few s of Triton compiles, the steps themselves < 1 s
# each). benchmarks/gpu_check.sh calls it too (its step 'trainer_smoke').
#
# That machine has no vLLM (its wheel is over what a run may bring): the script then samples
# with its random stand-in engine (--engine auto), which leaves every other part of the step as
# `python -m megagrpo train` runs it. Where vLLM is installed, this is the same as
#   python -m megagrpo train --config examples/demo.yaml <the script's overrides>
# Wheels it needs beside the machine's torch/triton/transformers/numpy/pyyaml, in ./wheels/
# (installed here when present; prepare them on the CPU machine with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d wheels \
#       megatron-core==0.16.1 psutil sentencepiece
# sentencepiece: the arithmetic task trains its 19-piece tokenizer on first use).
# On a CPU machine it runs too (the suite's smoke test runs the .py the same way).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
if [[ -z "${GPU_TRAINER_SMOKE_NO_WHEELS:-}" ]] && ls wheels/*.whl >/dev/null 2>&1; then
  python -m pip install -q --no-index --no-deps wheels/*.whl || echo "wheel install failed"
fi
RUN_DIR=$(mktemp -d /tmp/gpu_trainer_smoke.XXXXXX)  # the run's log and files: not results
timeout -k 5 "${SMOKE_TIMEOUT_S:-200}" python benchmarks/gpu_trainer_smoke.py --steps 3 \
  --out-dir "$RUN_DIR" "$@" 2>&1 | tee "${OUT:-/tmp}/gpu_trainer_smoke.log" \
  | grep --line-buffered -E '^\[smoke\]|Traceback|Error|error:'
rc=${PIPESTATUS[0]}
echo "gpu_trainer_smoke: exit $rc (full log: ${OUT:-/tmp}/gpu_trainer_smoke.log)"
exit "$rc"
