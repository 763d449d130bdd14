"""bf16 mixed precision on CPU (tests/_bf16_worker.py, one rank launch, TP=2): the policy and
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

from tests.support.bf16 import BF16_GAP_MAX  # measured 5.2e-4 / 6.8e-4 here
from tests.support.launch import run_ranks_results, worker_env

WORKER = os.path.join(os.path.dirname(__file__), "_bf16_worker.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    work = tmp_path_factory.mktemp("bf16")
    return run_ranks_results(WORKER, 2, work, timeout=900)


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


# fp16 keeps 11 significant bits: one rounding is off by up to u = 2^-11 (relative). The main
# gradients went through a few fp16 roundings (logit gradient, each layer's activation
# gradients, the weight gradient before it is accumulated into the fp32 main grad), measured
# 2.1u in relative L2 norm per parameter; 8u = 2^-8 leaves 4x for other CPUs' kernels, while a
# gradient left unscaled (or scaled and never unscaled) is off by ~1 (measured 1.36).
FP16_GRAD_MAX = 8 * 2.0 ** -11


def test_fp16_loss_scaling_keeps_small_gradients(results):
    for r in results:
        g = r["fp16"]["grads"]
        d, u = g["dynamic"], g["unscaled"]
        assert d["dtypes"] == ["torch.float16"] and d["scale"] == 2.0 ** 16, d["scale"]
        assert not d["found_inf"] and d["max_rel_err"] < FP16_GRAD_MAX, d["errs"]
        assert d["flushed"] < 1e-3, d["flushed"]
        # the same loss without scaling: fp16 flushes its gradients (the case is a real one)
        assert u["scale"] == 1.0 and u["flushed"] > 0.1 and u["max_rel_err"] > 0.5, u["errs"]


def test_fp16_overflow_skips_the_step_and_halves_the_scale(results):
    for r in results:
        o = r["fp16"]["overflow"]
        steps = o["steps"]
        assert steps[0]["scale"] == 2.0 ** 24 and not steps[0]["applied"], steps
        assert [s["applied"] for s in steps] == [False] * (len(steps) - 1) + [True], steps
        # hysteresis 1: every overflowing step halves the scale for the next one
        assert all(b["scale"] == a["scale"] / 2 for a, b in zip(steps, steps[1:])), steps
        assert all(s["probe"] for s in steps) and not o["probe_at_floor"], o
        assert o["skipped_left_state"] and o["applied_moved"], o


def test_fp16_loss_scale_is_checkpointed(results):
    for r in results:
        res = r["fp16"]["overflow"]["resume"]
        assert res["fresh_scale"] != res["saved"]["scale"], res  # a load has work to do
        assert res["loaded"] == res["saved"], res
