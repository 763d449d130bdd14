"""bf16 mixed precision on CPU (tests/_bf16_worker.py, one torchrun launch, TP=2): the policy and
the vLLM engine run in bf16 (weight matrices and norm weights) while the optimizer keeps
fp32 main parameters (each bf16 weight is its main copy rounded); the vLLM-vs-trainer log-prob
gap that bf16 rounding opens is reported, and the truncated-IS weights the loss gets are
min(exp(old - rollout), cap); a step moves every weight matrix and every fp32 main parameter
with a finite loss; the weight stream (vLLM sync, HF export) carries the model dtype, norm
weights included."""
import json
import math
import os
import subprocess
import sys

import pytest

from tests.support.launch import torchrun_results, worker_env

WORKER = os.path.join(os.path.dirname(__file__), "_bf16_worker.py")
# mean |vLLM - trainer| log-prob gap that bf16 rounding alone opens on this model: measured
# 5.2e-4 before and 6.8e-4 after the step (deterministic run to run; bf16 keeps 8 mantissa bits,
# ~2e-3 relative per op, and the per-token errors partly cancel). 7e-3 is ~10x that, a margin
# for rounding only: a sync or precision defect on top of it (a stale or mis-sharded weight, a
# norm in fp32 on one side only) has no 700x room to hide in, as under the old bound of 0.5.
BF16_GAP_MAX = 7e-3


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    work = tmp_path_factory.mktemp("bf16")
    return torchrun_results(WORKER, 2, work, timeout=900)


def test_optimizer_keeps_fp32_main_params(results):
    for r in results:
        for key in ("dtypes_before", "dtypes_after"):
            d = r[key]
            # megatron's local RMSNorm creates fp32 weights; build_model casts them
            assert d["matrices"] == d["vectors"] == ["torch.bfloat16"], d
            assert d["main"] == ["torch.float32"], d
            assert d["pairs"] > 0 and d["copies_exact"], d
            assert d["optimizer"] == ["Float16OptimizerWithFloat16Params"], d


def test_bf16_gap_is_reported_and_corrected_by_truncated_is(results):
    for r in results:
        c = r["is"]
        m = c["metrics"]
        # bf16 rounding: a real gap (fp32 stays below 1e-4, tests/test_trainer.py), not a bug
        assert 1e-4 < m["rollout_logp_gap_mean"] < BF16_GAP_MAX, m
        assert c["err"] < 1e-6, c  # the weights are exactly the truncated ratios
        assert c["below_one"] > 0 and c["capped"] > 0, c  # both sides of 1 are corrected
        assert m["rollout_is_weight_mean"] != 1.0 and m["rollout_is_capped_frac"] > 0, m


def test_bf16_step_moves_every_main_parameter(results):
    for r in results:
        s = r["step"]
        assert r["moved_matrices"] == r["moved_main"] == 1.0, r
        assert s["update_skipped"] == 0 and math.isfinite(s["loss"]) and s["grad_norm"] > 0, s
        assert 1e-4 < s["logp_gap_vllm_mean"] < BF16_GAP_MAX, s


def test_weight_stream_is_in_the_model_dtype_at_tp1(tmp_path):
    """megatron's local RMSNorm creates fp32 weights in a bf16 model; the stream to vLLM and to an
    HF export carries every tensor in bf16 (vLLM warned once per norm and sync)."""
    p = subprocess.run([sys.executable, WORKER, "--work", str(tmp_path), "--stream-dtypes"],
                       capture_output=True, text=True, env=worker_env(), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    seen = json.loads((tmp_path / "stream_dtypes.json").read_text())
    assert list(seen) == ["torch.bfloat16"], {k: v[:3] for k, v in seen.items()}
