"""One family's probe of vLLM's LoRA path (tests/test_lora_families.py runs it in its own
process: one vLLM engine per process). A tiny HF model of the family gets a random peft adapter
on every projection (transformers + peft: the reference); the engine (`VLLMEngine` with
`max_lora_rank`, the path `megagrpo.sync.adapters` uses) is fed the base weights, then the adapter
as a LoRA adapter; both decode greedily from one prompt, fp32. Writes a JSON result."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_qwen2_hd32(path):
    """tests.support.tiny's Qwen2 at width 128: Qwen2 derives head_dim = hidden / heads (16 at
    tiny.py's width 64, which vLLM's CPU attention refuses); 32 here."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.support.tiny import _finish

    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=100, num_hidden_layers=2, rope_theta=1e6,
                      tie_word_embeddings=True, max_position_embeddings=256,
                      use_sliding_window=False, hidden_size=128, intermediate_size=256,
                      num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6)
    return _finish(Qwen2ForCausalLM(cfg), path, biases=True)


def main(family: str, work: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from peft import LoraConfig, get_peft_model

    from megagrpo.config.rollout import RolloutConfig
    from megagrpo.engine import SamplingSettings, VLLMEngine
    from tests._rollout_model import hf_greedy
    from tests.support.tiny import BUILDERS

    root = Path(work)
    d = root / family
    model = tiny_qwen2_hd32(d) if family == "qwen2" else BUILDERS[family](d)
    torch.manual_seed(7)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS,
                                                  init_lora_weights=False))
    with torch.no_grad():  # B sizeable: the adapter must change the output
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    peft_model.save_pretrained(str(root / "adapter"))
    peft_model.eval()
    base = {k.replace(".base_layer", ""): v
            for k, v in peft_model.get_base_model().state_dict().items() if "lora_" not in k}
    engine = VLLMEngine(RolloutConfig(max_model_len=256, max_num_seqs=4, seed=0), d,
                        dtype="float32", max_lora_rank=8)
    prompt = torch.randint(0, 100, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    greedy = SamplingSettings(temperature=0.0, max_tokens=8)
    try:
        engine.update_weights(iter(base.items()))
        engine.load_adapter(str(root / "adapter"))
        comp = engine.generate([prompt], greedy)[0]
        # the judge's base_model: the same engine with the adapter off is the frozen base, and
        # the adapter is still served afterwards
        off = engine.generate([prompt], greedy, adapter=False)[0]
        again = engine.generate([prompt], greedy)[0]
    finally:
        engine.close()
    with torch.no_grad():
        ref, ref_lp = hf_greedy(peft_model, prompt, 8)
        with peft_model.disable_adapter():
            base_tokens, base_lp = hf_greedy(peft_model, prompt, 8)
    out = {"family": family, "vllm": comp.token_ids, "peft": ref, "base": base_tokens,
           "gap": max(abs(a - b) for a, b in zip(comp.logprobs, ref_lp)),
           "adapter_moves_logprobs": max(abs(a - b) for a, b in zip(ref_lp, base_lp)),
           "vllm_adapter_off": off.token_ids,
           "adapter_off_gap": max(abs(a - b) for a, b in zip(off.logprobs, base_lp)),
           "vllm_again": again.token_ids}
    (root / "result.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
