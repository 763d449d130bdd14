"""The bandwidth-aware rollout floor (benchmarks/rollout_floor.py) against a hand computation
for a tiny shape, its use in grpo_step.py's records, the memory bandwidth measurement
(machine.memory_read_gbs: a positive figure and its method, never how fast), and the generated
table of docs/performance.md."""
import sys
from pathlib import Path

import pytest

from megagrpo.config.model import ModelConfig
from megagrpo.runtime.machine import memory_read_gbs
from tests.support.docs import assert_generated_table

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))
import _workloads as W  # noqa: E402
import grpo_step  # noqa: E402
import rollout_floor as RF  # noqa: E402

# hidden 8, 2 layers, 2 heads x 4 (q width 8), 1 KV group (k, v width 4), FFN 16, vocab 10
TINY = ModelConfig(hidden_size=8, num_layers=2, num_attention_heads=2, num_query_groups=1,
                   head_dim=4, ffn_hidden_size=16, vocab_size=10, max_position_embeddings=32)
# two groups: prompt 3 with completions of 1 and 3 tokens, prompt 5 with one of 2 tokens
PROMPTS, COMPLETIONS = [3, 5], [[1, 3], [2]]
LAYER = 8 * (8 + 4 + 4) + 8 * 8 + 3 * 8 * 16  # q, k, v, proj + gate, up, down = 576 weights
KV_POS = 2 * 2 * 1 * 4 * 4  # k and v x layers x KV heads x head_dim x 4 bytes = 64


def test_decode_profile_by_hand():
    """Completions of c tokens decode c - 1 steps after the prefill's first token: the
    3-token one 2 steps (positions 4, 5), the 2-token one 1 step (position 6), the 1-token
    none."""
    assert RF.decode_profile(PROMPTS, COMPLETIONS) == [[2, 4 + 6], [1, 5]]
    assert RF.decode_profile([4], [[1, 1]]) == []


def test_weight_and_kv_bytes_by_hand():
    assert RF.kv_bytes_per_position(TINY, 4) == KV_POS
    for live in (1, 2, 7):  # layers + output layer 8 x 10 + the live tokens' embedding rows
        assert RF.weight_bytes(TINY, 4, live) == (2 * LAYER + 80 + 8 * live) * 4
    assert RF.weight_bytes(TINY, 2, 1) == (2 * LAYER + 80 + 8) * 2


def test_step_costs_and_floor_by_hand():
    """Per step: FLOPs = live x (2 x 1152 + 2 x 8 x 10) + 4 x 8 x 2 x ctx, bytes = weights +
    64 x ctx; the KV bytes summed over the decode are 64 x (10 + 5); the floor at 1000 FLOP/s
    and 1000 B/s takes the larger of each step's two times (both steps bytes-bound here)."""
    prefill, costs = RF.rollout_costs(TINY, 4, PROMPTS, COMPLETIONS)
    hand_bytes = [(2 * LAYER + 80 + 8 * 2) * 4 + KV_POS * 10, (2 * LAYER + 80 + 8) * 4 + KV_POS * 5]
    hand_flops = [2 * 2464 + 64 * 10, 2464 + 64 * 5]
    assert costs == [[float(f), float(b)] for f, b in zip(hand_flops, hand_bytes)]
    kv_total = sum(b for _, b in costs) - sum(RF.weight_bytes(TINY, 4, n) for n in (2, 1))
    assert kv_total == KV_POS * 15
    # prefill: 2 x 1152 x p dense + 2 x 8 x 2 x p (p + 1) attention + 160 first-token logits
    assert prefill == (2 * 1152 * 3 + 32 * 12 + 160) + (2 * 1152 * 5 + 32 * 30 + 160)
    # the FLOPs are _workloads.rollout_flops' (the FLOP-only floor of earlier records)
    assert prefill + sum(f for f, _ in costs) == W.rollout_flops(TINY, PROMPTS, COMPLETIONS)
    ro = RF.rollout_floor([[prefill, costs]], gflops=1e-6, gbs=1e-6)
    assert ro["floor_s"] == pytest.approx((prefill + sum(hand_bytes)) / 1000)
    assert (ro["steps"], ro["bandwidth_bound_steps"]) == (2, 2)
    fast_memory = RF.rollout_floor([[prefill, costs]], gflops=1e-6, gbs=1e9)
    assert fast_memory["floor_s"] == pytest.approx(W.rollout_flops(TINY, PROMPTS, COMPLETIONS)
                                                   / 1000)
    assert fast_memory["bandwidth_bound_steps"] == 0


def test_moe_reads_only_the_experts_the_live_tokens_can_touch():
    moe = ModelConfig(architecture="qwen3_moe", hidden_size=8, num_layers=1,
                      num_attention_heads=2, num_query_groups=1, head_dim=4, ffn_hidden_size=16,
                      num_experts=8, moe_topk=2, moe_ffn_hidden_size=4, vocab_size=10,
                      max_position_embeddings=32)
    attention, router, expert = 8 * 16 + 64, 8 * 8, 3 * 8 * 4
    for live, experts in ((1, 2), (3, 6), (4, 8), (50, 8)):
        assert RF.weight_bytes(moe, 4, live) == (
            attention + router + experts * expert + 80 + 8 * live) * 4


def test_grpo_step_record_prices_the_rollout_at_both_limits(monkeypatch):
    """add_mfu: with the rollouts' costs and a bandwidth, the rollout floor (and the step's) is
    rollout_floor's per measured step; without, the FLOP floor as before (rates given: the
    measurements are replaced by 1000 FLOP/s and 1000 B/s)."""
    import megagrpo.runtime.machine

    monkeypatch.setattr(W, "gemm_gflops", lambda dtype, threads: (1e-6, 8))
    monkeypatch.setattr(megagrpo.runtime.machine, "memory_read_gbs",
                        lambda threads: (1e-6, "given"))
    prefill, costs = RF.rollout_costs(TINY, 4, PROMPTS, COMPLETIONS)
    flops = W.rollout_flops(TINY, PROMPTS, COMPLETIONS)
    rec = dict(nproc=1, threads=1, steps=2, step_s=1.0, time_rollout_s=0.5, time_score_s=0.1,
               time_update_s=0.2, flops_rollout=flops, flops_score=1e3, flops_update=3e3,
               rollout_profiles=[[prefill, costs]] * 2)
    got = grpo_step.add_mfu(dict(rec), "float32", {}, {})
    per_step = (prefill + sum(b for _, b in costs)) / 1000
    assert got["floor_rollout_s"] == pytest.approx(per_step)
    assert got["floor_rollout_flops_only_s"] == pytest.approx(flops / 1000)
    assert got["floor_step_s"] == pytest.approx(per_step + 1.0 + 3.0)
    assert got["rollout_bandwidth_bound_steps"] == 4 and got["mem_read_method"] == "given"
    old = grpo_step.add_mfu(dict(rec), "float32", {})
    assert old["floor_rollout_s"] == pytest.approx(flops / 1000) and "mem_read_gbs" not in old


def test_memory_read_bandwidth_is_measured():
    rate, method = memory_read_gbs(1, nbytes=64 << 20, iters=1)
    assert rate > 0 and "torch.sum" in method and "0.06 GiB" in method


def test_performance_doc_rollout_floor_table_is_the_results_table():
    """docs/performance.md's rollout floor table is rollout_floor.py --table on its results."""
    got = RF.table(str(BENCH / "results" / "rollout_floor_epyc_cpu.jsonl"))
    assert_generated_table(ROOT / "docs" / "performance.md",
                           "<!-- rollout floor table: generated by benchmarks/rollout_floor.py",
                           "<!-- end of rollout floor table -->", got)



def test_performance_doc_rollout_settings_table_is_the_results_table():
    """docs/performance.md's vLLM settings table is rollout_settings.py --table on its results."""
    import rollout_settings

    got = rollout_settings.table(str(BENCH / "results" / "rollout_settings_epyc_cpu.jsonl"))
    assert_generated_table(ROOT / "docs" / "performance.md",
                           "<!-- rollout settings table: generated by benchmarks/rollout_settings",
                           "<!-- end of rollout settings table -->", got)
