"""Tiny random HF Llama / Qwen2 / Qwen3 checkpoints built from a config (no downloads)."""
from __future__ import annotations

import os

import torch


def tiny_llama(path, *, vocab=100, layers=2, tie=False, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, rope_theta=10000.0, rms_norm_eps=1e-6,
                      tie_word_embeddings=tie, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).float().eval()
    _randomise_norms(model)
    model.save_pretrained(path)
    return model


def tiny_qwen2(path, *, vocab=100, layers=2, tie=True, seed=1):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=tie,
                      max_position_embeddings=256, use_sliding_window=False)
    model = Qwen2ForCausalLM(cfg).float().eval()
    _randomise_norms(model)
    with torch.no_grad():  # biases start at 0 in HF init: make them matter
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(path)
    return model


def tiny_qwen3(path, *, vocab=100, layers=2, tie=False, seed=2):
    """Qwen3 with head_dim 32 != hidden / heads (64 / 4 = 16), as in the real family."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=tie,
                      max_position_embeddings=512, use_sliding_window=False)
    model = Qwen3ForCausalLM(cfg).float().eval()
    _randomise_norms(model)
    model.save_pretrained(path)
    return model


def tiny_qwen3_moe(path, *, vocab=100, layers=2, seed=4, dense_layers=()):
    """Qwen3-MoE: 4 experts, top-2 renormalised, expert width 64 (vLLM's CPU experts need a
    multiple of 32 per vLLM TP rank); a router initialised wide
    enough that routing is decisive (HF's 0.02 init makes every token's top-2 a near tie)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                         norm_topk_prob=True, decoder_sparse_step=1,
                         mlp_only_layers=list(dense_layers), num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         max_position_embeddings=512, use_sliding_window=False)
    model = Qwen3MoeForCausalLM(cfg).float().eval()
    _randomise_norms(model)
    _spread_routers(model)
    model.save_pretrained(path)
    return model


def tiny_qwen2_moe(path, *, vocab=100, layers=2, seed=5, dense_layers=(1,)):
    """Qwen2-MoE: 4 experts of width 64, top-2 without renormalisation, a gated shared expert
    (width 48),
    QKV biases, layer 1 dense (mlp_only_layers). Width 128 for head_dim 32 (Qwen2-MoE derives
    head_dim from hidden / heads; vLLM's CPU attention needs 32 or 64)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2MoeConfig(vocab_size=vocab, hidden_size=128, intermediate_size=128,
                         moe_intermediate_size=64, shared_expert_intermediate_size=48,
                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                         decoder_sparse_step=1, mlp_only_layers=list(dense_layers),
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         max_position_embeddings=512, use_sliding_window=False)
    model = Qwen2MoeForCausalLM(cfg).float().eval()
    _randomise_norms(model)
    _spread_routers(model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(path)
    return model


def _spread_routers(model) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("mlp.gate.weight") or n.endswith("shared_expert_gate.weight"):
                p.normal_(0, 0.5)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
               "rope_theta": 500000.0}


def tiny_llama31(path, *, vocab=100, layers=2, seed=3, rope=LLAMA3_ROPE):
    """Llama-3.1-style: llama3 RoPE scaling (megatron-core's fixed low/high factors and 8192
    original positions). Query/key weights are scaled up so that attention is sharp and the
    positions (hence the RoPE frequencies) visibly change the logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      max_position_embeddings=16384, rope_parameters=dict(rope))
    model = LlamaForCausalLM(cfg).float().eval()
    _randomise_norms(model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)
    model.save_pretrained(path)
    return model


def _randomise_norms(model):
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)


def load_dir(path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF safetensors directory (single file or sharded)."""
    from safetensors.torch import load_file

    out = {}
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out
