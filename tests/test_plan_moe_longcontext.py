"""The 32k-token Qwen3-30B-A3B recipe (issue 32 item 6) planned without weights at the layout
the planner recommends, and the planner's MoE dispatch buffers under sequence parallelism and
full recomputation counted by hand."""
from pathlib import Path

import pytest

from megagrpo.config.train import load_config
from megagrpo.plan import GIB, moe_dispatch_bytes, rank_memory, run_plan, suggest

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "examples" / "qwen3-30b-a3b-32k-reasoning.yaml")
# 2 MoE layers of 4 experts of width 16, top-2, h 8, s 8, b 2, fp32 (4 bytes)
TINY = ["model.architecture=qwen3_moe", "model.vocab_size=100", "model.hidden_size=8",
        "model.num_layers=2", "model.num_attention_heads=2", "model.num_query_groups=2",
        "model.head_dim=4", "model.num_experts=4", "model.moe_topk=2",
        "model.moe_ffn_hidden_size=16", "parallel.make_vocab_size_divisible_by=8",
        "compute.micro_batch_size=2", "rollout.max_model_len=8", "data.batch_size=4"]
TK = 2 * 8 * 2  # tokens x k


@pytest.mark.parametrize("extra, tp, pp, expected", [
    ([], 1, 1, TK * (2 * 8 + 3 * 16) * 2 * 4),  # two layers, [T k, H] x 2 + [T k, F] x 3
    (["parallel.sequence_parallel=false"], 2, 1, TK * (2 * 8 + 3 * 8) * 2 * 4),  # expert TP
    (["parallel.sequence_parallel=true"], 2, 1, TK * (8 + 4 + 3 * 8) * 2 * 4),  # own slice
    ([], 2, 1, TK * (8 + 4 + 3 * 8) * 2 * 4),  # unset: on for a MoE model at tp > 1
    (["compute.recompute=full"], 1, 1, TK * (2 * 8 + 3 * 16) * 1 * 4),  # one layer at a time
    (["compute.recompute=full", "compute.recompute_num_layers=2"], 1, 1,
     TK * (2 * 8 + 3 * 16) * 2 * 4),
])
def test_moe_dispatch_buffers_by_hand(extra, tp, pp, expected):
    cfg = load_config(None, TINY + [f"parallel.tp={tp}", f"parallel.pp={pp}"] + extra)
    assert moe_dispatch_bytes(cfg, cfg.model, tp, pp) == expected


def test_30b_a3b_32k_recipe_is_the_planners_recommendation(capsys):
    """The recipe validates on 16 GPUs, plans without weights at 16 x 80 GiB, its layout is
    the planner's first suggestion, and it fits only with full recomputation."""
    cfg = load_config(RECIPE)
    cfg.validate(world_size=16)
    m = cfg.model
    assert (m.architecture, m.num_experts, cfg.rollout.max_model_len) == ("qwen3_moe", 128, 32768)
    assert cfg.parallel.sequence_parallel and cfg.compute.recompute == "full"
    assert cfg.optim.distributed_optimizer
    best = suggest(cfg, m, world=16, gpu_mem_gib=80)[0]
    assert (best.tp, best.pp) == (cfg.parallel.tp, cfg.parallel.pp)
    full = rank_memory(cfg, m, best.tp, best.pp, 16, 80)
    assert full.total <= 80 * GIB and full.moe_dispatch < 0.05 * full.total
    cfg.compute.recompute = "none"
    none = rank_memory(cfg, m, best.tp, best.pp, 16, 80)
    assert none.update_peak > 80 * GIB
    assert run_plan(RECIPE, [], gpus=16, gpu_mem_gib=80) == 0
    out = capsys.readouterr().out
    assert "fits: yes" in out and "ep=8     16 experts per rank" in out
