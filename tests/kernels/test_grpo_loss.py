"""grpo_token_loss against a token-by-token float64 formula on the unsharded logits.

Every loss option runs on both paths ("triton" under the interpreter, "torch"); the TP=2/4
cases come from the shared gloo spawn in conftest.py.
"""
from __future__ import annotations

import pytest
import torch

from megagrpo.kernels import grpo_token_loss, kl_penalty
from tests.kernels.kernels_oracle import (
    GRPO_OPTIONS,
    assert_close,
    grpo_case,
    oracle_grpo,
    oracle_logprob,
    row_scale,
    run_case,
)

IMPLS = ["triton", "torch"]


def check_grpo(case, out, what):
    loss, grad, flags = oracle_grpo(case)
    scale = row_scale(case)
    assert_close(out["loss"], loss, scale, f"{what} loss")
    assert (out["loss"][~case["mask"]] == 0).all(), f"{what}: masked tokens have a loss"
    assert out["grad"].dtype == case["logits"].dtype
    assert_close(out["grad"], grad, scale, f"{what} grad")
    for key, want in flags.items():
        assert torch.equal(out[key], want), f"{what}: {key}"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("option", list(GRPO_OPTIONS))
def test_tp1_matches_float64(option, impl):
    dtype = torch.bfloat16 if option in ("ppo_dual_clip", "cispo") else torch.float32
    case = grpo_case(30, 700, 1, dtype, seed=sum(map(ord, option)), options=GRPO_OPTIONS[option])
    check_grpo(case, run_case(case, impl), f"{option}/{impl}")


def test_options_are_exercised():
    """The random cases really hit the branches they are meant to test."""
    ppo = oracle_grpo(grpo_case(30, 700, 1, torch.float32, 1, GRPO_OPTIONS["ppo_clip"]))[2]
    assert ppo["clipped_low"].any() and ppo["clipped_high"].any()
    case = grpo_case(30, 700, 1, torch.float32, 2, GRPO_OPTIONS["ppo_dual_clip"])
    out = run_case(case, "torch")
    assert out["clipped_dual"].any(), "no token reached the dual-clip cap"
    seq = run_case(grpo_case(30, 700, 1, torch.float32, 3, GRPO_OPTIONS["gspo_sequence"]), "torch")
    assert seq["clipped_low"].any() or seq["clipped_high"].any()


@pytest.mark.parametrize("impl", IMPLS)
def test_metrics(impl):
    case = grpo_case(24, 500, 1, torch.float32, 9, GRPO_OPTIONS["kl_k3_clamped"])
    out = run_case(case, impl)
    logp, ent, _ = oracle_logprob(case["logits"], case["target"], case["temperature"],
                                  ~case["mask"])
    scale = row_scale(case)
    assert_close(out["logp"], logp, scale, "logp")
    assert_close(out["entropy"], ent, scale, "entropy")
    m = case["mask"]
    ratio = torch.exp(logp[m] - case["old_logp"][m].double())
    assert_close(out["ratio"][m], ratio, scale[m], "ratio")
    # k3 written out in float64 (not the kl_penalty the loss calls), with the case's clamp
    # kl_clamp=(1.0, 0.5): d = logp - ref clamped to [-1, 1], the estimate to [-0.5, 0.5]
    d = (logp[m] - case["kwargs"]["ref_logp"][m].double()).clamp(-1.0, 1.0)
    k3 = torch.exp(-d) - 1.0 + d
    kl = k3.clamp(-0.5, 0.5)
    # the output clamp and the unclamped branch are both exercised (a missing output clamp or a
    # wrong estimator fails; this case has no |d| in (1, 1.2), where only the input clamp shows)
    assert (k3 > 0.5).any() and (k3 < 0.5).any()
    assert_close(out["kl"][m], kl, scale[m], "kl")
    assert out["kl"].abs().max() <= 0.5  # output clamp


@pytest.mark.parametrize("impl", IMPLS)
def test_on_policy_old_logp_none(impl):
    """old_logp=None means on-policy: ratio 1, the same loss and grad as old_logp = sg(logp)."""
    case = grpo_case(20, 400, 1, torch.float32, 12, GRPO_OPTIONS["kl_k1"])
    with torch.no_grad():
        logp_now = grpo_token_loss(case["logits"], case["target"], case["old_logp"],
                                   case["advantages"], case["mask"], impl=impl,
                                   temperature=case["temperature"], **case["kwargs"])[1]["logp"]
    out_none = run_case(dict(case, old_logp=None), impl)
    out_sg = run_case(dict(case, old_logp=logp_now), impl)
    assert torch.equal(out_none["ratio"][case["mask"]], torch.ones(int(case["mask"].sum())))
    assert torch.allclose(out_none["loss"], out_sg["loss"])
    assert torch.allclose(out_none["grad"], out_sg["grad"])


def test_kl_estimators():
    logp = torch.tensor([-1.0, -2.0, -30.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -2.0, -1.0], dtype=torch.float64)
    d = logp - ref
    assert torch.allclose(kl_penalty(logp, ref, "k1", (50.0, 50.0)), d)
    assert torch.allclose(kl_penalty(logp, ref, "k2", (50.0, 1e30)), d * d / 2)
    assert torch.allclose(kl_penalty(logp, ref, "k3", (50.0, 1e30)), torch.exp(-d) + d - 1)
    assert kl_penalty(logp, ref, "k3", (20.0, 10.0))[2] == 10.0  # clamped in, then out
    # per-estimator defaults: k3 keeps its overflow clamp, k1 and k2 are not clamped
    assert kl_penalty(logp, ref, "k3")[2] == 10.0
    assert torch.equal(kl_penalty(logp, ref, "k1"), d)
    assert torch.equal(kl_penalty(logp, ref, "k2"), 0.5 * d * d)
    with pytest.raises(ValueError):
        kl_penalty(logp, ref, "k4")


@pytest.mark.parametrize("est", ["k3", "k3_is"])
def test_k3_keeps_its_digits_for_tiny_log_ratios(est):
    """k3 = exp(-d) + d - 1 ~ d^2 / 2 for small d: in fp32 the sum cancels to rounding noise
    of 1 (6e-8, against 5e-9 at d = 1e-4), so it is computed as expm1(-d) + d, whose error is
    a rounding of d's size (2 fp32 eps |d| + eps k3 against float64 from the same fp32
    inputs): the precision d itself has, as a difference of two fp32 log-probs."""
    logp = torch.full((6,), -1.25)
    d = torch.tensor([1e-6, -3e-5, 1e-4, -1e-3, 1e-2, -0.1])
    ref = logp - d  # the fp32 inputs; d as the op sees it is (logp - ref) in fp32
    d64 = (logp - ref).double()
    want = torch.expm1(-d64) + d64
    got = kl_penalty(logp, ref, est, ratio=torch.ones(6) if est == "k3_is" else None)
    err = (got.double() - want).abs()
    eps = torch.finfo(torch.float32).eps
    print(f"\n{est} fp32 relative error at d = {d.tolist()}: {(err / want).tolist()}")
    assert bool((err <= 2 * eps * d64.abs() + eps * want).all())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("est, gap", [("k1", 15.0), ("k2", 6.0), ("k3", 30.0)])
def test_kl_gradient_far_from_reference(est, gap, impl):
    """|logp - ref| beyond the old shared clamp (10 for k1, sqrt(20) for k2): k1 and k2 keep
    their gradient (float64 autograd of the unclamped estimator), k3 keeps its clamp."""
    case = grpo_case(24, 300, 1, torch.float32, 31, dict(beta=0.2, kl_estimator=est))
    logp = oracle_logprob(case["logits"], case["target"], 0.9, ~case["mask"])[0].float()
    sign = torch.where(torch.arange(24) % 2 == 0, 1.0, -1.0)
    case["kwargs"]["ref_logp"] = logp + sign * gap  # d = logp - ref = -+gap
    out = run_case(case, impl)
    check_grpo(case, out, f"{est}/{impl}")
    kl = out["kl"][case["mask"]]
    if est == "k3":
        assert kl.max() == 10.0  # the output clamp is active and documented
    else:
        d = -sign[case["mask"]] * gap
        want = d if est == "k1" else 0.5 * d * d
        assert torch.allclose(kl, want, atol=1e-4), (kl, want)


def test_masked_garbage_and_extreme_logits_stay_finite():
    case = grpo_case(16, 300, 1, torch.bfloat16, 4, GRPO_OPTIONS["kl_k2"])
    case["logits"] = (torch.sign(torch.randn(16, 300)) * 1e4).to(torch.bfloat16)
    case["advantages"][~case["mask"]] = float("nan")
    case["logits"][~case["mask"]] = float("nan")  # padding rows may hold anything
    for impl in IMPLS:
        out = run_case(case, impl)
        assert torch.isfinite(out["loss"]).all() and torch.isfinite(out["grad"].float()).all()
        assert (out["grad"][~case["mask"]] == 0).all()


def test_argument_checks():
    x = torch.zeros(2, 5)
    t = torch.zeros(2, dtype=torch.long)
    v = torch.zeros(2)
    m = torch.ones(2, dtype=torch.bool)
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_token_loss(x, t, v, v, m, beta=0.1, impl="torch")
    with pytest.raises(ValueError, match="seq_ids"):
        grpo_token_loss(x, t, v, v, m, ratio_level="sequence", impl="torch")
    with pytest.raises(ValueError, match="dual_clip_c"):
        grpo_token_loss(x, t, v, v, m, dual_clip_c=0.5, impl="torch")


def test_tensor_parallel_over_gloo(tp_run):
    """GRPO cases of the shared TP=2/TP=4 spawn: loss, metrics and sharded grads."""
    tp, cases, ranks = tp_run
    for name, case in cases.items():
        if case["kind"] != "grpo":
            continue
        for impl in IMPLS:
            outs = [r[(name, impl)] for r in ranks]
            what = f"tp{tp}/{name}/{impl}"
            assert all(o["collectives"] == 1 for o in outs), f"{what}: not one collective per call"
            same = all(torch.equal(o["loss"], outs[0]["loss"]) for o in outs)
            assert same, f"{what}: ranks differ"
            check_grpo(case, dict(outs[0], grad=torch.cat([o["grad"] for o in outs], dim=1)), what)
