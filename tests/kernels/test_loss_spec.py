"""The loss spec, its two new loss types and how megagrpo builds it.

SAPO (arXiv:2511.20347) and DeepSeek-V3.2's bias-corrected KL (arXiv:2512.02556, Sec. 3.1)
each equal a float64 implementation of their paper's formula - loss and gradient w.r.t. the
logits (and, through the fused output layer, w.r.t. hidden states and weight) - written here
from the papers in probability space, sharing no code with megagrpo.kernels. TP=2 runs in the
kernel tests' shared gloo spawn (conftest.py). Also: LossSpec's checks name the field;
megagrpo builds one spec per loss context (not per micro-batch); LossCounts.num_seqs counts
every real sequence, as TRL's grpo / dr_grpo normalisers do.
"""
from __future__ import annotations

import math

import pytest
import torch

from megagrpo.kernels import LossSpec, TokenInputs, VocabPass, kl_penalty, token_loss
from tests.kernels.fused_cases import fused_case, shard
from tests.kernels.kernels_oracle import K3_IS, SAPO_STEEP, assert_close, grpo_case, row_scale

IMPLS = ["triton", "torch"]
SAPO = dict(policy_loss="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05)


# ------------------------------------------------------------------------------ float64 papers
def paper_loss(logits64: torch.Tensor, case: dict) -> torch.Tensor:
    """Per-token loss [T] from differentiable float64 logits, the papers' formulas in
    probability space: SAPO's -f(r) A, f(r) = sigmoid(tau (r - 1)) 4 / tau, tau = tau_pos for
    A > 0 else tau_neg; else PPO's clipped term; plus beta * (pi / pi_old) (pi_ref / pi -
    log(pi_ref / pi) - 1) for k3_is. Masked tokens: 0."""
    o, mask = case["kwargs"], case["mask"]
    logsm = torch.log_softmax(logits64 / case["temperature"], dim=-1)
    pi = logsm.gather(1, case["target"][:, None]).squeeze(1).exp()
    pi_old = torch.where(mask, case["old_logp"].double(), 0.0).exp()
    adv = case["advantages"].double()
    r = pi / pi_old
    if o.get("policy_loss") == "sapo":
        tau = torch.where(adv > 0, o["sapo_tau_pos"], o["sapo_tau_neg"]).double()
        loss = -torch.sigmoid(tau * (r - 1.0)) * 4.0 / tau * adv
    else:
        clipped = r.clamp(1 - o.get("eps_low", 0.2), 1 + o.get("eps_high", 0.2))
        loss = -torch.minimum(r * adv, clipped * adv)
    if o.get("beta"):
        pi_ref = torch.where(mask, o["ref_logp"].double(), 0.0).exp()
        rho = pi_ref / pi
        loss = loss + o["beta"] * (pi / pi_old) * (rho - torch.log(rho) - 1.0)
    return torch.where(mask, loss, 0.0)


def paper_logits(case) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss [T], d sum(g * loss) / d logits [T, V]) in float64."""
    x = case["logits"].detach().double().requires_grad_()
    loss = paper_loss(x, case)
    (loss * case["g"].double()).sum().backward()
    return loss.detach(), x.grad


def run_op(case, impl: str) -> dict:
    """token_loss on the logits at TP=1 (what the trainer calls), backward of sum(g * loss)."""
    x = case["logits"].clone().requires_grad_()
    spec = LossSpec(temperature=case["temperature"], **{
        k: v for k, v in case["kwargs"].items() if k in LossSpec.__dataclass_fields__})
    inputs = TokenInputs(case["old_logp"], case["advantages"], case["mask"],
                         ref_logp=case["kwargs"].get("ref_logp"))
    loss, _, metrics = token_loss(x, case["target"], spec, inputs, run=VocabPass(impl=impl))
    (loss * case["g"]).sum().backward()
    return dict(metrics, loss=loss.detach(), grad=x.grad)


def check(case, out, what):
    loss, grad = paper_logits(case)
    scale = row_scale(case)
    assert_close(out["loss"], loss, scale, f"{what} loss")
    assert out["grad"].dtype == case["logits"].dtype
    assert_close(out["grad"], grad, scale, f"{what} grad")


# ------------------------------------------------------------------------------ SAPO
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("options", [SAPO, SAPO_STEEP], ids=["paper_taus", "steep_taus"])
def test_sapo_matches_the_paper_float64(options, impl):
    case = grpo_case(30, 700, 1, torch.float32, seed=5, options=options)
    out = run_op(case, impl)
    check(case, out, f"sapo/{impl}")
    assert not out["clipped_low"].any() and not out["clipped_high"].any()


def test_sapo_gradient_is_the_soft_gate_weight():
    """The paper's gradient in closed form: d loss / d logits = -A 4 s (1 - s) r (onehot - p) / T,
    s = sigmoid(tau (r - 1)); 1 x the policy gradient at r = 1 (on-policy), smaller off it."""
    case = grpo_case(24, 300, 1, torch.float32, seed=8, options=SAPO_STEEP)
    out = run_op(case, "torch")
    x = case["logits"].double()
    logsm = torch.log_softmax(x / case["temperature"], dim=-1)
    logp = logsm.gather(1, case["target"][:, None]).squeeze(1)
    m, adv = case["mask"], case["advantages"].double()
    r = torch.exp(logp - torch.where(m, case["old_logp"].double(), 0.0))
    tau = torch.where(adv > 0, 0.5, 3.0).double()
    s = torch.sigmoid(tau * (r - 1.0))
    d_logp = torch.where(m, -adv * 4.0 * s * (1.0 - s) * r, 0.0) * case["g"].double()
    onehot = torch.nn.functional.one_hot(case["target"], x.shape[1]).double()
    want = d_logp[:, None] * (onehot - logsm.exp()) / case["temperature"]
    assert_close(out["grad"], want, row_scale(case), "sapo closed-form grad")
    # the gate does act: off-policy tokens get less than the plain policy gradient
    weight = 4.0 * s * (1.0 - s)
    assert (weight[m] < 0.9).any() and (weight[m] > 0.99).any()


# ------------------------------------------------------------------------------ k3_is
@pytest.mark.parametrize("impl", IMPLS)
def test_k3_is_matches_deepseek_v32_float64(impl):
    case = grpo_case(30, 700, 1, torch.float32, seed=6, options=K3_IS)
    out = run_op(case, impl)
    check(case, out, f"k3_is/{impl}")
    # inside the default clamps (20, 10), so the formula above is the whole story
    d = (out["logp"] - case["kwargs"]["ref_logp"])[case["mask"]]
    assert d.abs().max() < 20 and out["kl"].max() < 10


def test_k3_is_gradient_is_the_reverse_kl_gradient():
    """Advantages 0 leave the KL term alone: its gradient w.r.t. logp is beta r (logp - ref),
    the importance-weighted gradient of KL(pi || pi_ref) (the paper's point), whereas plain
    k3's is beta (1 - pi_ref / pi)."""
    case = grpo_case(24, 300, 1, torch.float32, seed=9, options=K3_IS)
    case["advantages"] = torch.zeros(24)
    out = run_op(case, "torch")
    x = case["logits"].double()
    logsm = torch.log_softmax(x / case["temperature"], dim=-1)
    logp = logsm.gather(1, case["target"][:, None]).squeeze(1)
    m = case["mask"]
    old = torch.where(m, case["old_logp"].double(), 0.0)
    ref = case["kwargs"]["ref_logp"].double()
    d_logp = torch.where(m, 0.3 * torch.exp(logp - old) * (logp - ref), 0.0) * case["g"].double()
    onehot = torch.nn.functional.one_hot(case["target"], x.shape[1]).double()
    want = d_logp[:, None] * (onehot - logsm.exp()) / case["temperature"]
    assert_close(out["grad"], want, row_scale(case), "k3_is closed-form grad")
    plain = run_op(dict(case, kwargs=dict(case["kwargs"], kl_estimator="k3")), "torch")
    assert not torch.allclose(plain["grad"], out["grad"], atol=1e-4), "k3_is == k3"


def test_k3_is_without_a_ratio_is_k3():
    """The KL-in-reward path (pi_theta = pi_old, no ratio) gets plain k3, same clamp."""
    logp = torch.tensor([-1.0, -2.0, -30.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -2.0, -1.0], dtype=torch.float64)
    assert torch.equal(kl_penalty(logp, ref, "k3_is"), kl_penalty(logp, ref, "k3"))
    ratio = torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64)
    d = logp - ref
    want = (ratio * (torch.exp(-d) + d - 1)).clamp(max=10.0)
    assert torch.allclose(kl_penalty(logp, ref, "k3_is", ratio=ratio), want)


# ------------------------------------------------------------------------------ hidden states
@pytest.mark.parametrize("grad_in_forward", [True, False], ids=["forward_grads", "recompute"])
@pytest.mark.parametrize("options", [SAPO_STEEP, K3_IS], ids=["sapo", "k3_is"])
def test_hidden_state_op_matches_the_papers(options, grad_in_forward):
    """token_loss from hidden states + weight (padded vocab): loss, dh, dW against the float64
    formulas on h W^T; weighted (gradient in the forward) and per-token (recomputing)."""
    case = fused_case(18, 16, 600, 1, torch.float32, 31, options=options, pad=37)
    kw = case["kwargs"]
    spec = LossSpec(temperature=case["temperature"], **{
        k: v for k, v in kw.items() if k in LossSpec.__dataclass_fields__})
    inputs = TokenInputs(case["old_logp"], case["advantages"], case["mask"],
                         ref_logp=kw.get("ref_logp"))
    w_local, valid = shard(case, 0, 1)
    h, w = case["h"].clone().requires_grad_(), w_local.clone().requires_grad_()
    run = VocabPass(impl="torch", valid_vocab=valid, chunk_tokens=5, chunk_vocab=128,
                    grad_in_forward=grad_in_forward)
    weights = case["g"] if grad_in_forward else None
    loss, tok, _ = token_loss(h, case["target"], spec, inputs, weight=w, token_weight=weights,
                              run=run)
    (loss if grad_in_forward else (loss * case["g"]).sum()).backward()
    h64 = case["h"].double().requires_grad_()
    w64 = case["w"][:case["real"]].double().requires_grad_()
    want = paper_loss(h64 @ w64.T, dict(case, target=case["target"]))
    (want * case["g"].double()).sum().backward()
    ones = torch.ones(18, dtype=torch.float64)
    assert_close(tok, want.detach(), ones * 10, "loss")
    assert_close(h.grad, h64.grad, ones * 10, "dh")
    assert_close(w.grad[:case["real"]], w64.grad, torch.ones(case["real"]) * 10, "dW")
    assert (w.grad[case["real"]:] == 0).all()


# ------------------------------------------------------------------------------ TP = 2
def test_tensor_parallel_over_gloo(tp_spawn):
    """Both new loss types at TP=2 in the kernel tests' shared gloo spawn (conftest.py: both
    paths, one collective per call), the concatenated shard gradients against the float64
    papers."""
    cases, ranks = tp_spawn[2]
    spec = {name: case for name, case in cases.items() if case["kind"] == "spec"}
    assert len(spec) == 2
    for name, case in spec.items():
        for impl in IMPLS:
            outs = [r[(name, impl)] for r in ranks]
            assert all(o["collectives"] == 1 for o in outs), f"{name}/{impl}"
            check(case, dict(outs[0], grad=torch.cat([o["grad"] for o in outs], dim=1)),
                  f"tp2/{name}/{impl}")


# ------------------------------------------------------------------------------ the spec
@pytest.mark.parametrize("field, value", [
    ("policy_loss", "ppo2"), ("ratio_level", "seq"), ("kl_estimator", "k4"),
    ("eps_low", -0.1), ("eps_high", float("nan")), ("beta", -1.0), ("dual_clip_c", 0.5),
    ("is_cap", 0.0), ("sapo_tau_pos", 0.0), ("sapo_tau_neg", -1.0), ("temperature", 0.0),
    ("kl_clamp", (1.0,)), ("kl_clamp", (0.0, 1.0)),
])
def test_spec_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"LossSpec\.{field}="):
        LossSpec(**{field: value})


def test_spec_is_frozen_and_inputs_are_checked_against_it():
    spec = LossSpec(beta=0.1, ratio_level="sequence")
    with pytest.raises(AttributeError):
        spec.beta = 0.0
    v, m = torch.zeros(2), torch.ones(2, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"LossSpec\.beta=0\.1 .*ref_logp"):
        spec.check(TokenInputs(v, v, m, seq_ids=torch.zeros(2, dtype=torch.long)))
    with pytest.raises(ValueError, match=r"LossSpec\.ratio_level=.*seq_ids"):
        spec.check(TokenInputs(v, v, m, ref_logp=v))
    spec.check(TokenInputs(v, v, m, ref_logp=v, seq_ids=torch.zeros(2, dtype=torch.long)))


# ------------------------------------------------------------------------------ megagrpo side
def _algo(**kw):
    from megagrpo.config.algo import AlgoConfig

    a = AlgoConfig(**kw)
    a.validate()
    return a


def test_spec_from_the_algo_config():
    from megagrpo.train.losses import loss_spec

    s = loss_spec(_algo(policy_loss="sapo", sapo_tau_pos=0.7, sapo_tau_neg=1.3,
                        kl_estimator="k3_is", kl_clamp_output=0.0), 0.9)
    assert (s.policy_loss, s.sapo_tau_pos, s.sapo_tau_neg, s.kl_estimator) == (
        "sapo", 0.7, 1.3, "k3_is")
    assert s.kl_clamp == (20.0, math.inf) and s.temperature == 0.9 and s.beta == 0.04
    c = loss_spec(_algo(loss_agg="cispo", cispo_eps_high=4.0, dual_clip_c=3.0), 1.0)
    assert (c.policy_loss, c.eps_high, c.dual_clip_c, c.ratio_level) == ("cispo", 4.0, 3.0,
                                                                         "token")
    g = loss_spec(_algo(loss_agg="gspo", kl_in_reward=True, kl_estimator="k1"), 1.0)
    assert (g.ratio_level, g.beta, g.kl_clamp, g.dual_clip_c) == ("sequence", 0.0, None, None)


@pytest.mark.parametrize("overrides, field", [
    (dict(policy_loss="clip"), "policy_loss"), (dict(sapo_tau_pos=0.0), "sapo_tau_pos"),
    (dict(sapo_tau_neg=float("nan")), "sapo_tau_neg"),
    (dict(policy_loss="sapo", loss_agg="gspo"), "policy_loss"),
    (dict(kl_estimator="k5"), "kl_estimator"),
])
def test_algo_config_checks_the_new_options(overrides, field):
    with pytest.raises(ValueError, match=rf"algo\.{field}="):
        _algo(**overrides)


def _batch(rows: list[int], width: int, seed: int):
    """A Batch of len(rows) real sequences with rows[i] loss tokens each (0: none)."""
    from megagrpo.parallel.batch import Batch

    g = torch.Generator().manual_seed(seed)
    n = len(rows)
    mask = torch.arange(width)[None, :] < torch.tensor(rows)[:, None]
    logp = -torch.rand(n, width, generator=g) - 0.5
    return Batch(ids=torch.randint(0, 11, (n, width), generator=g),
                 target=torch.randint(0, 11, (n, width), generator=g), mask=mask,
                 advantages=torch.where(mask, torch.randn(n, 1, generator=g), 0.0),
                 rollout_logp=logp, seq_valid=torch.ones(n, dtype=torch.bool),
                 old_logp=torch.where(mask, logp, 0.0),
                 ref_logp=torch.where(mask, logp + 0.1, 0.0))


def test_one_spec_per_context_not_per_micro_batch(monkeypatch):
    from megagrpo import algo
    from megagrpo.train.losses import LossContext, grpo_loss

    built = [0]
    init = LossSpec.__post_init__

    def counted(self):
        built[0] += 1
        init(self)

    monkeypatch.setattr(LossSpec, "__post_init__", counted)
    batch = _batch([3, 4, 2, 5], 6, seed=1)
    ctx = LossContext(tp_group=None, valid_local_vocab=11, temperature=1.0, impl="torch",
                      counts=algo.LossCounts(num_tokens=14.0, num_seqs=4.0),
                      algo=_algo(policy_loss="sapo", kl_estimator="k3_is"))
    assert built == [1] and ctx.spec.policy_loss == "sapo"
    for i in range(4):  # four micro-batches of one sequence
        mb = batch.rows(i, i + 1)
        loss, _ = grpo_loss(ctx, mb, torch.randn(1, 6, 11, requires_grad=True).clone())
        assert torch.isfinite(loss)
    assert built == [1]


@pytest.mark.parametrize("mode", ["grpo", "dr_grpo"])
def test_num_seqs_counts_sequences_without_loss_tokens(mode, monkeypatch):
    """Sequence 2 has no loss token (e.g. masked as truncated): it still counts, as TRL's
    grpo (`.mean()` over the batch) and dr_grpo (`size(0) * max_completion_length`) count
    it: the step loss is 1/4 of the per-sequence sum, not 1/3."""
    import megagrpo.train.passes as passes_mod
    from megagrpo import algo
    from megagrpo.config.train import TrainConfig

    monkeypatch.setattr(passes_mod.dist, "all_reduce", lambda t, group=None: t)  # one replica
    batch = _batch([3, 4, 0, 5], 6, seed=2)
    cfg = TrainConfig()
    cfg.algo.dr_grpo_max_len = 6
    counts = passes_mod.Passes(cfg).counts(batch, 1)
    assert counts.num_seqs == 4.0 and counts.num_tokens == 12.0
    tok = torch.randn(4, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    got = algo.aggregate_loss(tok.reshape(-1), batch.mask.reshape(-1).double(),
                              torch.arange(4).repeat_interleave(6), mode=mode, counts=counts,
                              num_local_seqs=4)
    per_seq = [float((tok[i] * batch.mask[i]).sum()) for i in range(4)]
    lens = [int(batch.mask[i].sum()) for i in range(4)]
    want = (sum(s / max(n, 1) for s, n in zip(per_seq, lens)) / 4 if mode == "grpo"
            else sum(per_seq) / (4 * 6))
    assert float(got) == pytest.approx(want, rel=1e-12)
