"""Issue 30, item 4 at k = 2: the expected gradient of the default async configuration
(algo.rollout_is: none, rollout.max_staleness: 2) on a three-token bandit equals the
importance-corrected one (the policy's own gradient, float64), exactly.

Unlike tests/test_offpolicy.py's k = 1 bandit (the correction applied by hand) this one goes
through `Trainer.prepare`, so the per-sample decisions are the trainer's: samples two updates
old are within the bound (not dropped) and corrected, a batch mixing lags 0, 1 and 2 (top-ups,
in-flight updates) weights each sample by its own behaviour policy. Every (version, token)
pair is one completion, its advantage scaled by the token's behaviour probability, so the
batch's gradient is the expectation itself (no sampling error); every pi/mu stays below
algo.rollout_is_cap, where the truncated weight is unbiased, so any bias in the weights shows
(a 5% one included). The uncorrected gradient is shown to lie far away."""
from __future__ import annotations

import pytest
import torch

from megagrpo.config.train import TrainConfig
from megagrpo.engine import Completion
from megagrpo.rollout.stream import Rollout
from megagrpo.train.trainer import Trainer
from tests.test_offpolicy import _loss

R = torch.tensor([0.0, 1.0, 0.3], dtype=torch.float64)
THETA = torch.tensor([0.1, 0.3, 0.0], dtype=torch.float64)  # the trainer's policy, version 2
BEHAVIOUR = {  # the policies of versions 0 and 1 (version 2: THETA itself); pi/mu <= 1.9
    0: torch.softmax(torch.tensor([0.5, -0.3, 0.2], dtype=torch.float64), 0),
    1: torch.softmax(torch.tensor([0.3, -0.1, 0.1], dtype=torch.float64), 0),
    2: torch.softmax(THETA, 0),
}


def _policy_gradient() -> torch.Tensor:
    """-d/dtheta E_{y ~ pi}[r(y)] in float64: what an unbiased estimator's mean must be."""
    t = THETA.clone().requires_grad_(True)
    (-(torch.softmax(t, 0) * R).sum()).backward()
    return t.grad


def _expected_gradient(versions: list[int], corrected: bool) -> torch.Tensor:
    """The expected loss gradient w.r.t. theta [3] over samples drawn from each version's policy
    (versions equally often), trained through `Trainer.prepare` (trainer at version 2, k = 2,
    the default rollout_is none): one completion per (version, token), its advantage A(y)
    scaled by 3 mu_v(y), so the batch's token-mean loss gradient is
    (1 / V) sum_v sum_y mu_v(y) g(v, y), g the per-sample gradient. `corrected` False drops
    the importance weights (the uncorrected path)."""
    cfg = TrainConfig()
    cfg.algo.group_size, cfg.algo.beta = 3, 0.0
    cfg.rollout.max_staleness = 2
    tr = Trainer(cfg)
    tr.version = 2
    pi = torch.softmax(THETA, 0)
    logpi = pi.log().float()
    tr.passes.logprobs = lambda model, batch, rows=None: torch.where(
        batch.mask, logpi[batch.target.clamp(0, 2)], 0.0)
    ver = torch.tensor(versions).repeat_interleave(3)
    y = torch.arange(3).repeat(len(versions))
    mu = torch.stack([BEHAVIOUR[int(v)] for v in ver]).gather(1, y[:, None])[:, 0]
    comps = [Completion(prompt_index=k // 3, sample_index=k % 3, token_ids=[yk],
                        logprobs=[lp], finish_reason="length", version=vk)
             for k, (yk, lp, vk) in enumerate(zip(y.tolist(), mu.log().tolist(), ver.tolist()))]
    ro = Rollout(prompts=[[0]] * len(versions), answers=["x"] * len(versions),
                 completions=comps, rewards=R[y].float(), version=min(versions))
    batch, prep = tr.prepare(ro)
    assert prep.metrics["stale_dropped"] == 0 and prep.metrics["staleness_max"] == 2
    adv = R[y] - (pi * R).sum()  # a constant baseline: the expectation is unchanged
    batch.set_advantages(3 * mu * adv)
    if not corrected:
        batch.is_weight = None
    x = THETA.float().expand(*batch.ids.shape, 3).clone().requires_grad_(True)
    _loss(batch, x, cfg.algo).backward()
    return x.grad.sum((0, 1)).double()


def test_weights_stay_below_the_cap():
    """The premise: where pi/mu exceeds algo.rollout_is_cap the truncated weight is biased by
    design, which would hide a small bias of the implementation."""
    pi = BEHAVIOUR[2]
    for mu in BEHAVIOUR.values():
        assert float((pi / mu).max()) < TrainConfig().algo.rollout_is_cap


@pytest.mark.parametrize("versions", [[0], [0, 1, 2]], ids=["lag2", "lags012"])
def test_k2_default_async_gradient_is_importance_corrected(versions):
    want = _policy_gradient()
    got = _expected_gradient(versions, corrected=True)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-7), (got, want)
    biased = _expected_gradient(versions, corrected=False)
    # without the weights: the behaviour policies' gradient, far from the policy's
    assert float((biased - want).abs().max()) > 0.1 * float(want.abs().max()), (biased, want)
