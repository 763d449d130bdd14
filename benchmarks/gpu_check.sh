#!/usr/bin/env bash
# The prepared GPU check, run on the lent H200 in one go (device tool: `bash benchmarks/gpu_check.sh`).
# That machine has Python 3.12, torch and triton, and nothing else; it cannot download. Bring
# wheels (<= 64 MiB in all) in ./wheels/, prepared here with e.g.
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d wheels \
#       megatron-core==0.16.1 transformers==5.19.0 safetensors tokenizers huggingface_hub pyyaml
# Steps (each writes JSON lines to $OUT, default benchmarks/results):
#   1. fused kernels: float64 correctness on CUDA tensors (exit 1 on mismatch), then the
#      T=16384, V=151936 bf16 benchmark at TP 1/2/4 with copy-bandwidth fraction;
#   2. HF logits agreement at TP=1, fp32 and bf16 (needs megatron-core + transformers wheels);
#   3. the fused output layer vs the logits path (float64 check first), H 1024, V 151936,
#      bf16, T 4096..32768, TP 1 (one GPU: its TP=2 rows need two).
# Then prints a short table. Commit the files under benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
unset TRITON_INTERPRET
if ls wheels/*.whl >/dev/null 2>&1; then
  python -m pip install -q --no-index --no-deps wheels/*.whl || echo "wheel install failed"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/h200_device.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$OUT/h200_device.txt"

status=0
python benchmarks/kernels.py --device cuda --check --out "$OUT/kernels_h200.jsonl" || status=1
python benchmarks/fused_output.py --device cuda --check --tp 1 --dtypes bf16 \
  --T 4096,16384,32768 --out "$OUT/fused_output_h200.jsonl" || status=1
if python -c "import megatron.core, transformers" 2>/dev/null; then
  python benchmarks/hf_logits.py --out "$OUT/hf_logits_h200.jsonl" || status=1
else
  echo "hf_logits: skipped (megatron-core or transformers missing: bring their wheels)"
fi

python - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for name in ("kernels_h200.jsonl", "hf_logits_h200.jsonl", "fused_output_h200.jsonl"):
    p = out / name
    if not p.exists():
        continue
    print(f"== {name}")
    for line in p.read_text().splitlines():
        r = json.loads(line)
        keys = [k for k in ("path", "model", "dtype", "tp", "T", "V_local", "fwd_bwd_s",
                            "peak_extra_pct_of_logits", "frac_of_copy", "max_rel_err",
                            "peak_pct_of_logits", "skipped") if k in r]
        print("  " + "  ".join(f"{k}={r[k]}" for k in keys))
PY
exit $status
