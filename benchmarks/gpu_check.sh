#!/usr/bin/env bash
# The prepared GPU check, run on the lent H200 in one go (device tool: `bash benchmarks/gpu_check.sh`,
# timeout_s 450). That machine has Python 3.12, torch, triton, transformers, safetensors,
# tokenizers, pyyaml, peft and numpy, and nothing else; it cannot download. Bring wheels
# (<= 64 MiB in all) in ./wheels/, prepared here with e.g.
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d wheels \
#       megatron-core==0.16.1 psutil sentencepiece
# Steps (each writes JSON lines to $OUT, default benchmarks/results; the full output of every
# step goes to $OUT/gpu_check_h200.log, the console gets progress lines with timestamps):
#   1. fused kernels: float64 correctness on CUDA tensors (exit 1 on mismatch), then the
#      T=16384, V=151936 bf16 benchmark at TP 1 and 4 with copy-bandwidth fraction;
#   2. the fused output layer vs the logits path (float64 check first), H 1024, V 151936,
#      bf16, T 4096 and 16384, TP 1 (one GPU: its TP=2 rows need two);
#   3. HF logits agreement at TP=1, fp32 and bf16 (needs megatron-core + transformers);
#   4. the trainer's whole step on CUDA, 3 steps of a tiny model (benchmarks/gpu_trainer_smoke.sh:
#      `megagrpo.run.setup` + `Trainer.step()`, a random stand-in engine without vLLM; exit 1 when
#      a step is not finite or the weights did not change);
#   5. the GRPO step's passes (benchmarks/gpu_step.py: megagrpo's megatron GPTModel, hidden
#      2048, 16 layers, GQA 16/8, FFN 5632, vocab 151936, bf16, 8 rows of 1024-2048 tokens):
#      update (fwd+bwd, fused GRPO loss) and scoring, tokens/s, TFLOP/s, MFU against torch.mm
#      measured at 8192^3, peak memory, loss/grad/log-probs against the eager pass; first
#      compute.compile_layers off (padded and packed, fused output layer and logits path),
#      then in the same process on (padded only: packing is another graph, ~1 min more
#      compile; both output paths share the layer graph), compile time reported;
#   6. only with GPU_CHECK_LAYER_SPLIT=1 (not in the 5 minutes): layer_split.py on CUDA, the
#      per-part split of 2 decoder layers of step 4's shape, eager and compiled.
# Then prints a short table. Commit the files under benchmarks/results/, then
#   python benchmarks/gpu_step.py --table benchmarks/results/gpu_step_h200.jsonl \
#       --write docs/performance.md
#
# Time, estimated for an H200 (~790 TFLOP/s bf16 torch.mm, 4.3 TB/s; 16 host cores): each step
# is a fresh Python (~5 s torch + triton import; megatron-core ~7 s more) and pays its Triton /
# inductor compiles once:
#   wheels + device info + one megatron-core / transformers import       ~15 s
#   1. kernels: check + 2 TP x 6 paths x 4 passes over 5 GB of logits (~5-50 ms each) + Triton
#      compiles                                                         ~35 s (timeout 60)
#   2. fused_output: check + 2 T x 4 paths x 5 passes of <= 1.5e13 FLOP + Triton compiles
#                                                                       ~35 s (timeout 60)
#   3. hf_logits: two tiny models x 2 dtypes                            ~25 s (timeout 45)
#   4. trainer_smoke: imports ~12 s, Triton compiles, 3 tiny steps      ~40 s (timeout 90)
#   5. gpu_step: model build (1.38B parameters, megatron's CPU init) ~20 s; megatron's own
#      torch.compile'd SwiGLU / bias-dropout-add ~15 s; eager: 4 rows x (update passes of
#      ~7.8e13 useful FLOP, ~0.25-0.35 s, x 6 + scoring ~0.1 s x 6 + the 5.5 GB gradient to
#      the host) ~25 s; compiled: dynamo + inductor of one layer (training and no-grad graphs)
#      ~60-90 s, 2 rows ~12 s                                         ~150 s (timeout 200)
# Expected ~5 min; every step runs under `timeout`, and a step never gets more than what is
# left of BUDGET_S (default 380 s) since the script started, so the whole script cannot pass
# ~6.5 min (a step left with < 10 s is skipped, said on the console). gpu_step runs last with
# what is left (>= ~170 s when the steps before it keep to their estimates).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
BUDGET_S=${BUDGET_S:-380}
mkdir -p "$OUT"
LOG="$OUT/gpu_check_h200.log"
: >"$LOG"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
DEADLINE=$(( $(date +%s) + BUDGET_S ))
status=0

say() { echo "$(date +%T) $*" | tee -a "$LOG"; }

# step NAME SECONDS CMD...: CMD under `timeout` (at most what is left of the budget), its whole
# output to $LOG, its progress lines ('[...]' first) and errors to the console
step() {
  local name=$1 limit=$2 left rc t0
  shift 2
  left=$(( DEADLINE - $(date +%s) ))
  (( limit > left )) && limit=$left
  if (( limit < 10 )); then
    say "$name: skipped (${left} s left of the ${BUDGET_S} s budget)"
    status=1
    return
  fi
  say "$name: start (timeout ${limit} s)"
  t0=$(date +%s)
  timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$LOG" \
    | grep --line-buffered -E '^\[|Traceback|Error|error:'
  rc=${PIPESTATUS[0]}  # the command's (timeout's) status, not grep's
  if (( rc == 124 || rc == 137 )); then
    say "$name: TIMED OUT after $(( $(date +%s) - t0 )) s (rows written so far are kept)"
    status=1
  elif (( rc != 0 )); then
    say "$name: FAILED rc=$rc after $(( $(date +%s) - t0 )) s (see $LOG)"
    status=1
  else
    say "$name: done in $(( $(date +%s) - t0 )) s"
  fi
}

if ls wheels/*.whl >/dev/null 2>&1; then
  python -m pip install -q --no-index --no-deps wheels/*.whl >>"$LOG" 2>&1 \
    || say "wheel install failed (see $LOG)"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/h200_device.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$OUT/h200_device.txt"
# one import of each (megatron-core takes ~7 s): what the steps below can run
MCORE=$(python -c "import megatron.core as m; print(m.__version__)" 2>>"$LOG")
HF=$(python -c "import transformers as t; print(t.__version__)" 2>>"$LOG")
echo "megatron-core ${MCORE:-missing} transformers ${HF:-missing}" | tee -a "$OUT/h200_device.txt"

step kernels 60 python benchmarks/kernels.py --device cuda --check --tp 1,4 --iters 3 \
  --out "$OUT/kernels_h200.jsonl"
step fused_output 60 python benchmarks/fused_output.py --device cuda --check --tp 1 \
  --dtypes bf16 --T 4096,16384 --iters 3 --out "$OUT/fused_output_h200.jsonl"
if [[ -n "$MCORE" && -n "$HF" ]]; then
  step hf_logits 45 python benchmarks/hf_logits.py --out "$OUT/hf_logits_h200.jsonl"
else
  say "hf_logits: skipped (megatron-core or transformers missing: bring their wheels)"
fi
if [[ -n "$MCORE" ]]; then
  step trainer_smoke 90 env GPU_TRAINER_SMOKE_NO_WHEELS=1 SMOKE_TIMEOUT_S=85 \
    bash benchmarks/gpu_trainer_smoke.sh
else
  say "trainer_smoke: skipped (megatron-core missing: bring its wheel in ./wheels)"
  status=1
fi
# last, with what is left of the budget: its eager rows are written first, the compiled ones
# (the least predictable compile time of the check) after them
if [[ -n "$MCORE" ]]; then
  step gpu_step 200 python benchmarks/gpu_step.py --device cuda --compile both \
    --compiled-layouts padded --out "$OUT/gpu_step_h200.jsonl"
else
  say "gpu_step: skipped (megatron-core missing: bring its wheel in ./wheels)"
  status=1
fi
if [[ "${GPU_CHECK_LAYER_SPLIT:-0}" == 1 ]]; then
  step layer_split 150 python benchmarks/layer_split.py --device cuda --dtype bfloat16 --compile \
    --shape hidden=2048,ffn=5632,layers=2,heads=16,kv=8,head_dim=128,batch=8,seq=2048 \
    --iters 3 --out "$OUT/layer_split_h200.jsonl"
fi

python - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for name in ("kernels_h200.jsonl", "hf_logits_h200.jsonl", "fused_output_h200.jsonl",
             "layer_split_h200.jsonl"):
    p = out / name
    if not p.exists():
        continue
    print(f"== {name}")
    for line in p.read_text().splitlines():
        r = json.loads(line)
        keys = [k for k in ("path", "model", "dtype", "tp", "TP", "T", "V_local", "fwd_bwd_s",
                            "peak_extra_pct_of_logits", "frac_of_copy", "max_rel_err", "ok",
                            "peak_pct_of_logits", "step_s", "gemm_share", "rest_share",
                            "floor_frac", "skipped") if k in r]
        print("  " + "  ".join(f"{k}={r[k]}" for k in keys))
PY
if [[ -f "$OUT/gpu_step_h200.jsonl" ]]; then
  echo "== gpu_step_h200.jsonl"
  python benchmarks/gpu_step.py --table "$OUT/gpu_step_h200.jsonl"
fi
say "gpu_check: exit $status ($(( $(date +%s) - DEADLINE + BUDGET_S )) s)"
exit $status
