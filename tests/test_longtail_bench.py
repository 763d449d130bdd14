"""benchmarks/longtail.py: its reward and target lengths by hand, its per-step figures and
its projection against hand computations, a refused configuration, one real (smallest)
separate-placement run (heavy; by default tests/test_placement.py summarizes its own
separate-placement run with this script), and docs/performance.md's tables are the ones it
prints from the committed results."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.bench import bench_module
from tests.support.docs import assert_generated_table

ROOT = Path(__file__).resolve().parents[1]
PERF_DOC = ROOT / "docs" / "performance.md"
RESULTS = ROOT / "benchmarks" / "results" / "longtail_epyc_cpu.jsonl"


def _bench():
    return bench_module("longtail")


def test_target_lengths_spread_10x_and_the_reward_by_hand():
    bench = _bench()
    # answers are reversed sums: the first character is the sum's last digit
    assert [bench.target_tokens(str(d) + "3") for d in range(10)] == list(range(4, 41, 4))
    assert bench.target_length("x" * 40, "91") == 1.0
    assert bench.target_length("x" * 32, "91") == 1.0  # 20% short of 40: still within
    assert bench.target_length("x" * 31, "91") == pytest.approx(1 - 9 / 40)
    assert bench.target_length("x" * 48, "91") == 1.0  # 20% over
    assert bench.target_length("x" * 12, "0") == pytest.approx(0.0)  # 3x the target of 4
    assert bench.target_length("", "0") == 0.0


def test_summary_is_the_hand_computed_one():
    bench = _bench()
    n = bench.BATCH * bench.GROUP
    first = {"reward_mean": 0.1, "time_rollout": 50.0, "tokens_per_s": 1.0,
             "completion_len": 1.0}
    a = {"reward_mean": 0.2, "time_rollout": 1.0, "time_update": 3.0, "tokens_per_s": 100.0,
         "completion_len": 20.0, "stale_dropped": 8.0, "staleness_mean": 0.5,
         "staleness_max": 1.0, "trainer_idle_s": 1.0, "rollout_idle_s": 2.0,
         "rollout_queue_depth": 1.0, "inflight_midway": 1.0, "token_lag_mean": 0.25}
    b = dict(a, reward_mean=0.4, time_update=1.0, tokens_per_s=300.0, stale_dropped=0.0,
             staleness_max=2.0, inflight_midway=0.0)
    s = bench.summarize([first, a, b], dp=2)
    assert s["steps_kept"] == 2 and s["step_s"] == pytest.approx(3.0)  # (4 + 2) / 2
    # completion tokens: 100 x 4 + 300 x 2 over 6 s; trained: less 8 x 2 of n samples in a
    assert s["gen_tokens_per_s"] == pytest.approx(1000 / 6)
    assert s["trained_tokens_per_s"] == pytest.approx((400 * (1 - 16 / n) + 600) / 6)
    assert s["phases"] == {"time_rollout": 1.0, "time_update": 2.0}
    assert s["lag_mean"] == 0.5 and s["lag_max"] == 2.0 and s["stale_dropped"] == 8.0
    assert s["inflight_midway"] == 0.5 and s["token_lag_mean"] == 0.25
    assert s["reward_curve"] == [[50.0, 0.1], [54.0, 0.2], [56.0, 0.4]]
    assert s["reward_last3"] == pytest.approx(0.7 / 3)


def test_reward_windows_by_hand():
    bench = _bench()
    curve = [[3.0, 0.1], [9.9, 0.3], [10.0, 0.5], [31.0, 0.7]]
    assert bench.reward_windows(curve, 10.0, 4) == [pytest.approx(0.2), 0.5, None, 0.7]


def test_projection_by_hand():
    bench = _bench()
    sync = {"step_s": 10.0, "phases": {"time_rollout": 4.0, "time_weight_sync": 1.0}}
    p = bench.projection(sync, gpus=8, train_ranks=4)
    assert (p["g"], p["work"], p["s"]) == (4.0, 10.0, 1.0)  # W = 2 x (10 - 4 - 1)
    assert p["colocated_sync_s"] == pytest.approx(4 + 10 / 8 + 1)
    assert p["separate_s"] == pytest.approx(max(4, 10 / 4) + 1)
    assert p["separate_inflight_s"] == pytest.approx(max(4, 10 / 4 + 1))
    slow = bench.projection({**sync, "step_s": 45.0}, gpus=8, train_ranks=4)  # training-bound
    assert slow["separate_s"] == slow["separate_inflight_s"] == pytest.approx(80 / 4 + 1)
    scored = bench.projection(sync, gpus=8, train_ranks=4, score_ratio=1.0)
    assert scored["work_async"] == 20.0 and scored["separate_s"] == pytest.approx(20 / 4 + 1)
    assert scored["colocated_sync_s"] == p["colocated_sync_s"]  # a sync step scores nothing


def test_longtail_refused_configuration_is_recorded_not_launched(monkeypatch):
    bench = _bench()
    monkeypatch.setitem(bench.CONFIGS, "separate-tp2",
                        [*bench.SEPARATE, "rollout.tensor_parallel_size=2"])
    refused = bench.measure("separate-tp2", steps=2)
    assert "rollout.rollout_ranks=1 do not divide into engines" in refused["refused"]
    assert "wall_s" not in refused


# heavy: a launch of its own (~30 s on 2 cores); by default its figures are checked on the
# separate-placement run's metrics (tests/test_placement.py, the same configuration at DP=2)
@pytest.mark.heavy
def test_longtail_benchmark_smallest(tmp_path, monkeypatch):
    """One real run (2 steps, separate placement with in-flight updates, k = 1) and a
    configuration the config check refuses (recorded, not launched)."""
    bench = _bench()
    r = bench.measure("separate-k1-inflight", steps=2)
    assert r["steps_kept"] == 1 and len(r["reward_curve"]) == 2
    assert r["gen_tokens_per_s"] > 0 and r["trained_tokens_per_s"] <= r["gen_tokens_per_s"]
    assert 1 <= r["completion_len"] <= bench.MAX_TOKENS
    # step 2 trains a batch sampled at most k = 1 version behind (the per-sample stamps)
    assert 0.0 <= r["lag_mean"] <= r["lag_max"] <= 1.0 and r["stale_dropped"] == 0
    assert r["phases"]["time_update"] > 0 and "time_weight_sync" in r["phases"]
    monkeypatch.setitem(bench.CONFIGS, "separate-tp2",
                        [*bench.SEPARATE, "rollout.tensor_parallel_size=2"])
    refused = bench.measure("separate-tp2", steps=2)
    assert "rollout.rollout_ranks=1 do not divide into engines" in refused["refused"]
    assert "wall_s" not in refused
    out = tmp_path / "r.jsonl"
    out.write_text(json.dumps(dict(r, config="colocated-sync")) + "\n" + json.dumps(r) + "\n"
                   + json.dumps(refused) + "\n")
    text = bench.table(out)
    assert "| separate-k1-inflight | 0 |" in text and "| separate-tp2 | | refused" in text
    assert "| 8 | 4 |" in text


def test_performance_doc_longtail_tables_are_the_results():
    bench = _bench()
    assert_generated_table(PERF_DOC, "<!-- longtail tables: generated by benchmarks/longtail.py",
                           "<!-- end of longtail tables -->", bench.table(RESULTS))


PARTIAL_RESULTS = ROOT / "benchmarks" / "results" / "longtail_partial_cpu.jsonl"
ASYNC_DOC = ROOT / "docs" / "async.md"


def test_partial_table_by_hand(tmp_path):
    """The per-token lag shares are the steps' means; each partial row's tokens/s ratio is
    against the run without partial rollouts at the same k."""
    bench = _bench()
    step = {"reward_mean": 0.5, "time_rollout": 1.0, "time_update": 1.0, "tokens_per_s": 50.0,
            "completion_len": 10.0}
    first = dict(step, time_rollout=9.0)
    part = [dict(step, token_lag_share_0=0.2, token_lag_share_1=0.8, partial_continued=4.0,
                 partial_recomputed_tokens=30.0),
            dict(step, tokens_per_s=150.0, token_lag_share_0=0.4, token_lag_share_1=0.6,
                 partial_continued=2.0, partial_recomputed_tokens=10.0)]
    s = bench.summarize([first, *part], dp=2)
    assert s["token_lag_shares"] == {0: pytest.approx(0.3), 1: pytest.approx(0.7)}
    assert s["partial_continued"] == 3.0 and s["partial_recomputed_tokens"] == 20.0
    assert bench.summarize([first, step, step], dp=2)["token_lag_shares"] == {}
    base = {"steps": 3, "seed": 0, "nproc": 2, "cpu": "C", "cores": 2, "loadavg_1m_start": 3.0,
            "loadavg_1m_end": 4.0}
    rows = [dict(base, config="colocated-k1", **bench.summarize([first, step, step], dp=2)),
            dict(base, config="colocated-k1-partial", **json.loads(json.dumps(s)))]
    out = tmp_path / "p.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = bench.partial_table(out)
    # 100 tokens/s against 50: 2.00x; the shares in lag order
    assert "| colocated-k1-partial | 2.00 | 100 | 2.00x |" in text
    assert "| 0.30/0.70 | 3.0 | 20 |" in text
    assert "| colocated-k1 | 2.00 | 50 |  |" in text


def test_async_doc_partial_table_is_the_results():
    bench = _bench()
    assert_generated_table(ASYNC_DOC, "<!-- partial rollouts table: generated by "
                           "benchmarks/longtail.py", "<!-- end of partial rollouts table -->",
                           bench.partial_table(PARTIAL_RESULTS))
