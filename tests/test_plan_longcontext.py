"""The planner's long-context activation memory (issue 32 item 6): sequence parallelism,
context parallelism and compute.recompute counted by hand (what megagrpo's SwiGLU / GQA layers
save for backward, measured by benchmarks/recompute_memory.py), the attention scores only
where they are materialised, and the 32k-token 8B recipe planned without
weights at the layout the planner recommends. The measured comparison is
benchmarks/recompute_memory.py (docs/performance.md)."""
from pathlib import Path

import pytest

from megagrpo.config.train import load_config
from megagrpo.plan import activation_bytes, rank_memory, suggest

ROOT = Path(__file__).resolve().parents[1]
# h 8, 2 heads, 2 KV groups, 2 layers, s 8, b 2, fp32
TINY = ["model.vocab_size=100", "model.hidden_size=8", "model.ffn_hidden_size=16",
        "model.num_layers=2", "model.num_attention_heads=2", "model.num_query_groups=2",
        "model.head_dim=4", "parallel.make_vocab_size_divisible_by=8",
        "compute.micro_batch_size=2", "rollout.max_model_len=8", "data.batch_size=4"]
T = 8 * 2  # s x b tokens a layer
# values a layer saves per token (megagrpo.plan.layer_values), h 8, head_dim 4, FFN 16 SwiGLU:
# norms: 2 blocks x (input, normalised output, the linear's input) x h + RoPE's cos/sin 4 x 4
NORMS, NORMS_SP2 = 6 * 8 + 16, 6 * 8 // 2 + 16
# attention at 1 head / 1 KV group a TP rank (tp 2): q 4 + k 4 + fused QKV output 12 + output 4
# (+ lse 1 when the core attention keeps its own); MLP: 5 x FFN / tp
ATTN2, MLP2 = 4 + 4 + 12 + 4, 5 * 16 // 2
L2 = NORMS + ATTN2 + 1 + MLP2  # 129
SCORES = 2 * 8 * 8 * 2 // 2  # a s^2 b / tp: the softmax output (no attention dropout)
# tp 1: 2 heads, 2 KV groups; CP=2: the rank's 4 of 8 tokens, q 8 + output 8 + lse 2 + the
# K and V gathered over the row (2 x 8 tokens / 4 local tokens x 2 groups x 4)
ATTN1, MLP1 = 8 + 8 + 24 + 8, 5 * 16
L1, L1_CP = NORMS + ATTN1 + 2 + MLP1, NORMS + 8 + 8 + 2 + 2 * 2 * 2 * 4 + MLP1
T_CP = 4 * 2


@pytest.mark.parametrize("extra,tp,expected", [
    ([], 2, T * L2 * 2 * 4),
    (["parallel.sequence_parallel=true"], 2, T * (NORMS_SP2 + ATTN2 + 1 + MLP2) * 2 * 4),
    (["parallel.attention_impl=megatron", "parallel.transformer_impl=local"], 2,
     (T * L2 + SCORES) * 2 * 4),
    # selective: the core attention's inputs and output kept per layer; its lse and scores for
    # one layer in backward
    (["parallel.attention_impl=megatron", "parallel.transformer_impl=local",
      "compute.recompute=selective"], 2, (T * (L2 - 1) * 2 + T + SCORES) * 4),
    # full: each layer's input (s b h) for both layers, + one recomputed layer with its scores
    (["parallel.attention_impl=megatron", "parallel.transformer_impl=local",
      "compute.recompute=full"], 2, (T * 8 * 2 + T * L2 + SCORES) * 4),
    (["compute.recompute=full", "parallel.sequence_parallel=true"], 2,
     (T * 8 // 2 * 2 + T * (NORMS_SP2 + ATTN2 + 1 + MLP2)) * 4),
    (["compute.recompute=full", "compute.recompute_num_layers=2"], 1,
     (T * 8 * 2 + T * L1 * 2) * 4),
    (["parallel.cp=2"], 1, T_CP * L1_CP * 2 * 4),
    # selective: the local q, k, fused QKV and output kept; the gathered K/V for one layer
    (["parallel.cp=2", "compute.recompute=selective"], 1,
     (T_CP * (NORMS + ATTN1 + MLP1) * 2 + T_CP * (L1_CP - NORMS - ATTN1 - MLP1)) * 4),
    (["parallel.cp=2", "compute.recompute=full"], 1, (T_CP * 8 * 2 + T_CP * L1_CP) * 4),
])
def test_activations_count_sp_and_recompute_by_hand(extra, tp, expected):
    cfg = load_config(None, TINY + [f"parallel.tp={tp}"] + extra)
    assert activation_bytes(cfg, cfg.model, tp, 1) == expected


def test_32k_recipe_is_the_planners_recommendation():
    """The 32k-token Qwen3-8B recipe plans without weights at 8 x 80 GiB, its layout is the
    planner's first suggestion, and full recomputation is what makes the update's activations
    small next to the training state."""
    cfg = load_config(str(ROOT / "examples" / "qwen3-8b-32k-reasoning.yaml"))
    cfg.validate(world_size=8)
    assert cfg.rollout.max_model_len == 32768 and cfg.compute.micro_batch_size == 1
    best = suggest(cfg, cfg.model, world=8, gpu_mem_gib=80)[0]
    assert (best.tp, best.pp) == (cfg.parallel.tp, cfg.parallel.pp)
    assert cfg.parallel.sequence_parallel and cfg.compute.recompute == "full"
    full = rank_memory(cfg, cfg.model, best.tp, best.pp, 8, 80)
    cfg.compute.recompute = "none"
    none = rank_memory(cfg, cfg.model, best.tp, best.pp, 8, 80)
    assert full.activations < 0.1 * none.activations
    assert none.update_peak > 80 * 2**30 > full.total  # without recomputation it cannot run
