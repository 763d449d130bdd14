"""vLLM's LoRA path (enable_lora, an adapter loaded with add_lora: what an adapter-only refit
uses, megagrpo/sync/adapters.py) on the dense families megagrpo runs, against transformers + peft
with the same adapter: greedy tokens equal and log-probs within fp32 rounding; with the adapter
off for one call (the judge reward's base_model), the base's. Heavy: one vLLM engine per
family, each in its own process (~1 min each on a quiet 2-core CPU)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.heavy
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_vllm_serves_the_family_adapter_like_peft(family, tmp_path):
    pytest.importorskip("vllm")
    pytest.importorskip("peft")
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_ENABLE_V1_MULTIPROCESSING="0")
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "_lora_family_worker.py"), family,
                        str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["adapter_moves_logprobs"] > 1e-3  # the adapter matters, so the check can fail
    assert r["vllm"] == r["peft"], r
    assert r["gap"] < 1e-4, r
    # generate(adapter=False), the judge's base_model: the frozen base through the same engine
    assert r["vllm_adapter_off"] == r["base"] and r["adapter_off_gap"] < 1e-4, r
    assert r["vllm_again"] == r["vllm"], r
