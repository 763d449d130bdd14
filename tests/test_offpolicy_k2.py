"""Issue 30, item 4 at k = 2: the expected gradient of the default async configuration
(algo.rollout_is: none, rollout.max_staleness: 2) on a three-token bandit equals the
importance-corrected one (the policy's own gradient, float64) within sampling error.

Unlike tests/test_offpolicy.py's k = 1 bandit (enumerated exactly, the correction applied by
hand) this one goes through `Trainer.prepare`, so the per-sample decisions are the trainer's:
samples two updates old are within the bound (not dropped) and corrected, a batch mixing lags
0, 1 and 2 (top-ups, in-flight updates) weights each sample by its own behaviour policy.
Monte Carlo over 8,000 one-token completions; the standard error comes from the per-sample
gradients, and the uncorrected gradient is shown to lie many standard errors away."""
from __future__ import annotations

import pytest
import torch

from megagrpo.config.train import TrainConfig
from megagrpo.engine import Completion
from megagrpo.stream import Rollout
from megagrpo.trainer import Trainer
from tests.test_offpolicy import _loss

G, PROMPTS = 4, 2000
R = torch.tensor([0.0, 1.0, 0.3], dtype=torch.float64)
THETA = torch.tensor([0.1, 0.3, 0.0], dtype=torch.float64)  # the trainer's policy, version 2
BEHAVIOUR = {  # the policies of versions 0 and 1 (version 2: THETA itself)
    0: torch.softmax(torch.tensor([0.5, -0.4, 0.2], dtype=torch.float64), 0),
    1: torch.softmax(torch.tensor([0.3, -0.1, 0.1], dtype=torch.float64), 0),
    2: torch.softmax(THETA, 0),
}


def _policy_gradient() -> torch.Tensor:
    """-d/dtheta E_{y ~ pi}[r(y)] in float64: what an unbiased estimator's mean must be."""
    t = THETA.clone().requires_grad_(True)
    (-(torch.softmax(t, 0) * R).sum()).backward()
    return t.grad


def _batch_gradient(versions: list[int], seed: int, corrected: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples one token per completion from the policy of its version, trains it through
    `Trainer.prepare` (trainer at version 2, k = 2, the default rollout_is none) and returns
    (the loss's gradient w.r.t. theta [3], its standard error [3]). `corrected` False drops
    the importance weights (the uncorrected path)."""
    cfg = TrainConfig()
    cfg.algo.group_size, cfg.algo.beta = G, 0.0
    cfg.rollout.max_staleness = 2
    tr = Trainer(cfg)
    tr.version = 2
    pi = torch.softmax(THETA, 0)
    logpi = pi.log().float()
    tr.passes.logprobs = lambda model, batch, rows=None: torch.where(
        batch.mask, logpi[batch.target.clamp(0, 2)], 0.0)
    gen = torch.Generator().manual_seed(seed)
    n = PROMPTS * G
    ver = torch.tensor(versions).repeat(n // len(versions) + 1)[:n]
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    cdf = torch.stack([BEHAVIOUR[int(v)].cumsum(0) for v in ver])  # [n, 3]
    y = (u[:, None] > cdf).sum(1).clamp(max=2)  # inverse-CDF sampling from each's policy
    mu_logp = torch.stack([BEHAVIOUR[int(v)] for v in ver]).gather(1, y[:, None])[:, 0].log()
    comps = [Completion(prompt_index=k // G, sample_index=k % G, token_ids=[yk],
                        logprobs=[lp], finish_reason="length", version=vk)
             for k, (yk, lp, vk) in enumerate(zip(y.tolist(), mu_logp.tolist(), ver.tolist()))]
    ro = Rollout(prompts=[[0]] * PROMPTS, answers=["x"] * PROMPTS, completions=comps,
                 rewards=R[y].float(), version=min(versions))
    batch, prep = tr.prepare(ro)
    assert prep.metrics["stale_dropped"] == 0 and prep.metrics["staleness_max"] == 2
    adv = R[y] - (pi * R).sum()  # a constant baseline: the estimator's mean is unchanged
    batch.set_advantages(adv)
    if not corrected:
        batch.is_weight = None
    x = THETA.float().expand(*batch.ids.shape, 3).clone().requires_grad_(True)
    _loss(batch, x, cfg.algo).backward()
    grad = x.grad.sum((0, 1)).double()
    # per-sample gradients at the first pass (ratio 1, no clip): -w A (e_y - pi), w the weight
    w = (batch.is_weight[batch.mask].double() if batch.is_weight is not None
         else torch.ones(n, dtype=torch.float64))
    per = -(w * adv)[:, None] * (torch.nn.functional.one_hot(y, 3).double() - pi)
    assert torch.allclose(grad, per.mean(0), atol=1e-5)  # the loss is that sample mean
    return grad, per.std(0) / n ** 0.5


@pytest.mark.parametrize("versions", [[0], [0, 1, 2]], ids=["lag2", "lags012"])
def test_k2_default_async_gradient_is_importance_corrected(versions):
    want = _policy_gradient()
    got, se = _batch_gradient(versions, seed=7, corrected=True)
    assert bool(((got - want).abs() < 4 * se).all()), (got, want, se)
    biased, se_b = _batch_gradient(versions, seed=7, corrected=False)
    # without the weights: the behaviour policies' gradient, far outside the sampling error
    assert float((biased - want).abs().max()) > 10 * float(se_b.max()), (biased, want, se_b)
