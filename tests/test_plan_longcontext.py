"""The planner's long-context activation memory (issue 32 item 6): sequence parallelism and
compute.recompute counted by hand against Korthikanti et al. 2022's per-layer formulas, the
attention scores only where they are materialised, and the 32k-token 8B recipe planned without
weights at the layout the planner recommends. The measured comparison is
benchmarks/recompute_memory.py (docs/performance.md)."""
from pathlib import Path

import pytest

from megagrpo.config.train import load_config
from megagrpo.plan import activation_bytes, rank_memory, suggest

ROOT = Path(__file__).resolve().parents[1]
# h 8, 2 heads, 2 layers, s 8, b 2, fp32 (4 bytes: twice the formulas' 2-byte values)
TINY = ["model.vocab_size=100", "model.hidden_size=8", "model.ffn_hidden_size=16",
        "model.num_layers=2", "model.num_attention_heads=2", "model.num_query_groups=2",
        "model.head_dim=4", "parallel.make_vocab_size_divisible_by=8",
        "compute.micro_batch_size=2", "rollout.max_model_len=8", "data.batch_size=4"]
SBH = 8 * 2 * 8
SCORES = 2 * 2 * 8 * 8 * 2  # 2 a s^2 b: the softmax output (no attention dropout)


@pytest.mark.parametrize("extra,tp,expected", [
    ([], 2, SBH * (10 + 12) * 2 * 2),
    (["parallel.sequence_parallel=true"], 2, SBH * 34 // 2 * 2 * 2),
    (["parallel.attention_impl=megatron", "parallel.transformer_impl=local"], 2,
     (SBH * 22 + SCORES // 2) * 2 * 2),
    (["parallel.attention_impl=megatron", "parallel.transformer_impl=local",
      "compute.recompute=selective"], 2, SBH * 22 * 2 * 2),
    # full: each layer's input (2 sbh) for both layers, + one recomputed layer with its scores
    (["parallel.attention_impl=megatron", "parallel.transformer_impl=local",
      "compute.recompute=full"], 2, (2 * SBH * 2 + SBH * 22 + SCORES // 2) * 2),
    (["compute.recompute=full", "parallel.sequence_parallel=true"], 2,
     (2 * SBH // 2 * 2 + SBH * 34 // 2) * 2),
    (["compute.recompute=full", "compute.recompute_num_layers=2"], 1,
     (2 * SBH * 2 + SBH * 34 * 2) * 2),
    # CP=2 (fp32 bytes per layer): the rank's 4 of the row's 8 tokens (2 x cp chunks), + the
    # all-gathered K and V beyond its own (2 x 4 tokens x b x 2 KV heads x 4 x 4 bytes); no
    # mask (the CP attention's causal structure is blocks, not a saved [4, 8] mask)
    (["parallel.cp=2"], 1, (SBH // 2 * 34 * 2 + 2 * 4 * 2 * 8 * 4) * 2),
    # selective recomputes the core attention: CP's gathered K/V once, not per layer
    (["parallel.cp=2", "compute.recompute=selective"], 1,
     SBH // 2 * 34 * 2 * 2 + 2 * 4 * 2 * 8 * 4),
    (["parallel.cp=2", "compute.recompute=full"], 1,
     (2 * SBH // 2 * 2 * 2 + SBH // 2 * 34 * 2 + 2 * 4 * 2 * 8 * 4)),
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
