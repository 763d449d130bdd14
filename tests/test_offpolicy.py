"""Stale (async) batches train with the decoupled PPO objective by default (issue 30, item 4).

The objective (megagrpo/train/offpolicy.py): loss_t = min(pi_old / mu, cap) * ppo_clip(pi / pi_old,
A), mu = vLLM's behaviour log-probs, pi_old = the trainer's recomputed ones. Checked here against a
float64 implementation (loss and gradient, cap and clips active); the trainer's choice of it is
checked from the batch's recorded version through `Trainer.prepare`; and on a three-token
bandit the expected gradient of the default async configuration is the policy's gradient,
while the uncorrected path (what `rollout_is: none` trained before) follows the behaviour
policy's.
"""
import pytest
import torch

from megagrpo import algo
from megagrpo.config.algo import AlgoConfig
from megagrpo.config.train import TrainConfig
from megagrpo.engine import Completion
from megagrpo.parallel.batch import Batch
from megagrpo.rollout.stream import Rollout
from megagrpo.train.advantage import rollout_is
from megagrpo.train.losses import LossContext, grpo_loss
from megagrpo.train.offpolicy import correction_mode, is_stale
from megagrpo.train.trainer import Trainer

EPS = 0.2


def _batch(target: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor,
           behaviour: torch.Tensor) -> Batch:
    """A Batch [N, S] with the given targets, mask, per-token advantages and vLLM log-probs."""
    n = target.shape[0]
    return Batch(ids=target.clone(), target=target, mask=mask, advantages=adv.float(),
                 rollout_logp=torch.where(mask, behaviour, 0.0).float(),
                 seq_valid=torch.ones(n, dtype=torch.bool))


def _loss(batch: Batch, logits: torch.Tensor, a: AlgoConfig) -> torch.Tensor:
    """The project's training loss (torch kernel path) of `batch` at `logits` [N, S, V]."""
    counts = algo.LossCounts(num_tokens=float(batch.mask.sum()), num_seqs=float(batch.num_seqs))
    ctx = LossContext(tp_group=None, valid_local_vocab=logits.shape[-1], temperature=1.0,
                      impl="torch", counts=counts, algo=a)
    loss, _ = grpo_loss(ctx, batch, logits)
    return loss


def _stale_correction(batch: Batch, a: AlgoConfig) -> None:
    """What `Trainer.prepare` does to a batch sampled one version behind."""
    corr = rollout_is(batch, None, a, mode=correction_mode(a.rollout_is, stale=is_stale(0, 1)))
    batch.mask, batch.is_weight = corr.mask, corr.weight


def test_decision_comes_from_the_versions():
    assert is_stale(3, 4) and not is_stale(4, 4)
    assert correction_mode("none", stale=True) == "truncate"
    assert correction_mode("none", stale=False) == "none"
    for mode in ("truncate", "token_mask", "seq_mask"):  # explicit choices run as chosen
        assert correction_mode(mode, stale=True) == mode == correction_mode(mode, stale=False)


def test_decoupled_objective_and_gradient_match_float64():
    """Token level, dapo aggregation (token mean): loss and d loss / d logits of the default
    configuration on a stale batch equal a float64 hand-written decoupled objective, with
    tokens beyond the cap and on both clips."""
    g = torch.Generator().manual_seed(0)
    N, S, V = 4, 6, 7
    a = AlgoConfig(loss_agg="dapo", beta=0.0, rollout_is_cap=1.5, eps_low=EPS, eps_high=EPS)
    logits = torch.randn(N, S, V, generator=g, dtype=torch.float64)
    target = torch.randint(0, V, (N, S), generator=g)
    mask = torch.rand(N, S, generator=g) < 0.8
    adv = torch.randn(N, S, generator=g, dtype=torch.float64)
    logp = torch.log_softmax(logits, -1).gather(2, target[..., None])[..., 0]
    prox = logp + 0.4 * torch.randn(N, S, generator=g, dtype=torch.float64)  # r off 1: clips
    behav = prox + 0.6 * torch.randn(N, S, generator=g, dtype=torch.float64)  # some > cap
    batch = _batch(target, mask, adv, behav)
    batch.old_logp = torch.where(mask, prox, 0.0).float()
    _stale_correction(batch, a)

    x = logits.float().clone().requires_grad_(True)
    got = _loss(batch, x, a)
    got.backward()

    # float64 reference, from the float32 inputs the trainer holds
    x64 = logits.clone().requires_grad_(True)
    lp = torch.log_softmax(x64, -1).gather(2, target[..., None])[..., 0]
    old, mu = batch.old_logp.double(), batch.rollout_logp.double()
    r = torch.exp(lp - old)
    w = torch.exp(old - mu).clamp(max=a.rollout_is_cap)
    pg = torch.maximum(-adv * r, -adv * r.clamp(1 - EPS, 1 + EPS)) * w
    want = (pg * mask).sum() / mask.sum()
    want.backward()

    capped = (torch.exp(old - mu) > a.rollout_is_cap) & mask
    clipped = ((r < 1 - EPS) & (adv < 0) | (r > 1 + EPS) & (adv > 0)) & mask
    assert capped.any() and clipped.any() and (~capped & mask).any()
    assert float(got) == pytest.approx(float(want), rel=1e-5, abs=1e-7)
    assert torch.allclose(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-6)
    # the weight matters: without it (the old path) the gradient differs
    batch.is_weight = None
    x.grad = None
    _loss(batch, x, a).backward()
    assert not torch.allclose(x.grad.double(), x64.grad, rtol=1e-2, atol=1e-3)


def _completion(prompt: int, sample: int, tokens: list[int], logps: list[float]) -> Completion:
    return Completion(prompt_index=prompt, sample_index=sample, token_ids=tokens, logprobs=logps,
                      finish_reason="stop")


@pytest.mark.parametrize("batch_version, corrected", [(0, True), (1, False)])
def test_trainer_corrects_the_batch_by_its_version(batch_version, corrected):
    """`Trainer.prepare` with the default config: a batch sampled one update behind the trainer
    (version 0 vs 1) trains with the weights min(exp(old - vLLM), cap); a fresh one with none.
    The scoring pass is the only stand-in (it returns vLLM's log-probs + 0.5 on loss tokens)."""
    cfg = TrainConfig()
    cfg.algo.group_size, cfg.algo.beta = 2, 0.0
    cfg.run.async_rollout = True  # k = 1: a lag of one is within the bound (k = 0 would drop it)
    tr = Trainer(cfg)
    tr.version = 1
    scored = []

    def logprobs(model, batch, rows=None):
        scored.append(True)
        return torch.where(batch.mask, batch.rollout_logp + 0.5, 0.0)

    tr.passes.logprobs = logprobs
    ro = Rollout(prompts=[[1, 2]], answers=["x"],
                 completions=[_completion(0, 0, [3, 4], [-1.0, -2.0]),
                              _completion(0, 1, [5], [-0.5])],
                 rewards=torch.tensor([0.0, 1.0]), version=batch_version)
    batch, prep = tr.prepare(ro)
    assert prep.metrics["policy_lag"] == 1 - batch_version
    assert prep.metrics["offpolicy_corrected"] == float(corrected)
    if corrected:
        assert scored and batch.is_weight is not None
        w = batch.is_weight[batch.mask]
        assert torch.allclose(w, torch.full_like(w, min(float(torch.tensor(0.5).exp()), 2.0)))
        assert prep.metrics["rollout_logp_gap_mean"] == pytest.approx(0.5)
    else:  # on-policy, one pass: no old log-probs scored, nothing to correct
        assert not scored and batch.is_weight is None and batch.old_logp is None


def _bandit_expected_grad(theta: torch.Tensor, mu: torch.Tensor, adv: torch.Tensor,
                          a: AlgoConfig, stale_default: bool) -> torch.Tensor:
    """E_{y ~ mu}[d loss(y) / d theta] of the project's loss for one-token completions y of a
    3-token bandit, enumerated exactly (weights mu(y)): the old log-probs are the trainer's
    recomputed ones (ratio 1 at the first pass), the behaviour log-probs mu's."""
    total = torch.zeros(3, dtype=torch.float64)
    logpi = torch.log_softmax(theta, 0)
    for y in range(3):
        target = torch.tensor([[y, 0]])
        mask = torch.tensor([[True, False]])
        batch = _batch(target, mask, torch.tensor([[float(adv[y]), 0.0]]),
                       torch.tensor([[float(mu[y].log()), 0.0]], dtype=torch.float64))
        batch.old_logp = torch.where(mask, float(logpi[y]), 0.0).float()
        if stale_default:
            _stale_correction(batch, a)
        x = theta.float().expand(1, 2, 3).clone().requires_grad_(True)
        _loss(batch, x, a).backward()
        total += float(mu[y]) * x.grad[0, 0].double()
    return total


def test_bandit_default_async_gradient_is_importance_corrected():
    """A 3-token bandit whose last update moved the policy from mu (which sampled the batch) to
    pi. The expected gradient of the default configuration (rollout_is none, a stale batch)
    equals -d/dtheta E_{y ~ pi}[r(y)], computed in float64; the uncorrected loss (weights 1,
    what rollout_is none trained before) gives mu's gradient instead, far from it."""
    a = AlgoConfig(loss_agg="dapo", beta=0.0)
    r = torch.tensor([0.0, 1.0, 0.3], dtype=torch.float64)
    mu = torch.softmax(torch.tensor([0.4, -0.3, 0.1], dtype=torch.float64), 0)
    theta = torch.tensor([0.1, 0.3, 0.0], dtype=torch.float64)  # after the update
    pi = torch.softmax(theta, 0)
    assert float((pi / mu).max()) < a.rollout_is_cap  # the cap is not what is tested here
    adv = r - (pi * r).sum()  # any constant baseline: sum_y pi(y) d log pi(y) = 0

    t = theta.clone().requires_grad_(True)
    (-(torch.softmax(t, 0) * r).sum()).backward()
    want = t.grad

    corrected = _bandit_expected_grad(theta, mu, adv, a, stale_default=True)
    uncorrected = _bandit_expected_grad(theta, mu, adv, a, stale_default=False)
    assert torch.allclose(corrected, want, atol=1e-6), (corrected, want)
    # the old path: E_mu[-A d log pi], the behaviour policy's weighting
    jac = torch.eye(3, dtype=torch.float64) - pi  # d log pi(y) / d theta, row y
    biased = -(mu[:, None] * adv[:, None] * jac).sum(0)
    assert torch.allclose(uncorrected, biased, atol=1e-6)
    # here: [0.163, -0.177, 0.014] against [0.153, -0.204, 0.051], 18% of the gradient's norm
    assert float((uncorrected - want).norm()) > 0.15 * float(want.norm())


def test_async_with_nucleus_sampling_is_refused():
    """The decoupled weights need vLLM's log-probs of the full softmax: async with top_p < 1
    and processed log-probs is refused before the run, naming the fields and the fixes."""
    from pathlib import Path

    from megagrpo.config.train import load_config
    from megagrpo.preflight import preflight

    demo = str(Path(__file__).resolve().parents[1] / "examples" / "demo.yaml")
    with pytest.raises(ValueError, match=r"rollout\.top_p=0\.9 .* run\.async_rollout=true.*"
                                         r"or set run\.async_rollout=false"):
        preflight(load_config(demo, ["rollout.top_p=0.9", "run.async_rollout=true"]), 2)
    preflight(load_config(demo, ["run.async_rollout=true"]), 2)


@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "dapo"])
def test_stale_drop_counts_the_sequence_not_its_tokens(mode, monkeypatch):
    """rollout.stale_policy=drop (docs/async.md): the dropped sample's tokens leave the mask,
    the step's sequence count keeps it and its token count does not; so grpo and dr_grpo leave
    the kept tokens' weights as they were, dapo raises them by (all tokens) / (kept tokens)."""
    import megagrpo.train.passes as passes_mod

    monkeypatch.setattr(passes_mod.dist, "all_reduce", lambda t, group=None: t)  # one replica
    rows, width = [3, 4, 5], 6
    mask = torch.arange(width)[None, :] < torch.tensor(rows)[:, None]
    cfg = TrainConfig()
    cfg.algo.dr_grpo_max_len = width

    def weights(m: torch.Tensor) -> tuple[algo.LossCounts, torch.Tensor]:
        batch = Batch(ids=torch.zeros(3, width, dtype=torch.long),
                      target=torch.zeros(3, width, dtype=torch.long), mask=m,
                      advantages=torch.zeros(3, width), rollout_logp=torch.zeros(3, width),
                      seq_valid=torch.ones(3, dtype=torch.bool))
        counts = passes_mod.Passes(cfg).counts(batch, 1)
        w = algo.aggregation_weights(m.reshape(-1).double(), torch.arange(3).repeat_interleave(
            width), mode=mode, counts=counts, num_local_seqs=3)
        return counts, w.reshape(3, width)

    full, w_full = weights(mask)
    dropped = mask.clone()
    dropped[1] = False  # what _bound_staleness does to an over-stale row
    counts, w = weights(dropped)
    assert counts.num_seqs == full.num_seqs == 3
    assert counts.num_tokens == full.num_tokens - rows[1]
    kept = dropped
    assert not w[1].any()
    factor = full.num_tokens / counts.num_tokens if mode == "dapo" else 1.0
    torch.testing.assert_close(w[kept], w_full[kept] * factor, rtol=1e-12, atol=0)
