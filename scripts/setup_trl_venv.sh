#!/usr/bin/env bash
# Creates .venv-trl: Hugging Face TRL (GRPOTrainer) for benchmarks/trl_grpo_baseline.py, kept
# apart from .venv so TRL and its dependencies cannot disturb megagrpo's pinned stack.
# torch goes in first: 2.13.0 is the CPU wheel on local disk; any other version (or letting
# trl/accelerate pick one) would pull a multi-GB CUDA build. Then TRL, pinned to versions that
# were installed and run together with torch 2.13.0+cpu on Python 3.11 (2026-11-30);
# math-verify added 2026-12-01.
# Idempotent: a stamp keyed on this script makes a second call a no-op.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
key=$(sha1sum scripts/setup_trl_venv.sh | cut -c1-12)
stamp=.venv-trl/.trl-$key
if [ -f "$stamp" ]; then exit 0; fi
echo "[setup-trl] creating .venv-trl"
[ -x .venv-trl/bin/python ] || "$PY" -m venv .venv-trl
.venv-trl/bin/python -m pip install -q --upgrade pip
.venv-trl/bin/python -m pip install -q torch==2.13.0
.venv-trl/bin/python -m pip install -q torch==2.13.0 trl==1.16.0 transformers==5.19.0 \
  accelerate==1.15.0 datasets==5.2.0 sentencepiece==0.2.3
# the smollm2 workload's reward is megagrpo's math reward (math-verify), as pinned in .venv
.venv-trl/bin/python -m pip install -q math-verify==0.9.0 latex2sympy2_extended==1.11.0 \
  antlr4-python3-runtime==4.13.2 sympy==1.14.0
# torchvision & co. from the registry break `import transformers` beside this torch build
.venv-trl/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
.venv-trl/bin/python -c "import torch, trl, transformers; print('[setup-trl] torch', \
torch.__version__, 'trl', trl.__version__, 'transformers', transformers.__version__)"
rm -f .venv-trl/.trl-*
touch "$stamp"
echo "[setup-trl] done"
