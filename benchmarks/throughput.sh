#!/usr/bin/env bash
# The full megagrpo-vs-TRL throughput comparison of issue 11, into
# benchmarks/results/throughput_cpu.jsonl (replaced), then the tables of docs/performance.md
# (benchmarks/report.py).
#   bash benchmarks/throughput.sh            # on a quiet machine (smollm2 dominates the time)
#   WARMUP=1 STEPS=3 bash benchmarks/throughput.sh
# Runs: demo, varlen, midsize, moe and smollm2 in float32 and in bfloat16;
# megagrpo at 1 and 2 ranks (grpo_step.py), TRL 1.16 at 1 and 2 threads (trl_grpo_baseline.py, .venv-trl); every
# record carries the 1-minute load average it ran under. smollm2 is skipped (a "skipped" line)
# when models/smollm2-135m is absent. bfloat16 is skipped when this CPU has no fast bf16 matrix
# multiply (torch.mm bf16 under a fifth of fp32: no avx512_bf16/AMX, bf16 runs a slow fallback);
# FORCE_BF16=1 runs it anyway. RUNS="midsize:float32 smollm2:bfloat16 ..." runs only those.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/throughput_cpu.jsonl}
WARMUP=${WARMUP:-2}
STEPS=${STEPS:-5}
PY=.venv/bin/python
TRL_PY=.venv-trl/bin/python
[ -x "$TRL_PY" ] || { echo "[throughput] .venv-trl is missing: bash scripts/setup_trl_venv.sh"; exit 1; }
mkdir -p "$(dirname "$OUT")"
: > "$OUT"
fast_bf16=$($PY - <<'PY'
import sys
sys.path.insert(0, "benchmarks")
import _workloads as W
fp32, _ = W.gemm_gflops("float32", 1, size=512)
bf16, _ = W.gemm_gflops("bfloat16", 1, size=512)
print(int(bf16 >= 0.2 * fp32))
PY
)
runs="demo:float32 varlen:float32 midsize:float32 moe:float32 smollm2:float32"
if [ "$fast_bf16" = 1 ] || [ "${FORCE_BF16:-0}" = 1 ]; then
  runs="$runs demo:bfloat16 varlen:bfloat16 midsize:bfloat16 moe:bfloat16 smollm2:bfloat16"
else
  echo "[throughput] skipping bfloat16: torch.mm bf16 is under a fifth of fp32 on this CPU (FORCE_BF16=1 runs it)"
fi
runs=${RUNS:-$runs}
for run in $runs; do
  wl=${run%%:*}; dt=${run##*:}
  echo "[throughput] $(date +%H:%M:%S) megagrpo $wl $dt (1 and 2 ranks)"
  $PY benchmarks/grpo_step.py --workload "$wl" --dtype "$dt" --nprocs 1,2 --warmup "$WARMUP" \
    --steps "$STEPS" --out "$OUT" --append
  echo "[throughput] $(date +%H:%M:%S) TRL $wl $dt (1 and 2 threads)"
  env -u TRITON_INTERPRET "$TRL_PY" benchmarks/trl_grpo_baseline.py --workload "$wl" --dtype "$dt" \
    --threads 1,2 --warmup "$WARMUP" --steps "$STEPS" --out "$OUT" --append
done
$PY benchmarks/report.py "$OUT"
