"""The KL term on a stale batch (decoupled objective, megagrpo.train.offpolicy): its tokens were
sampled by the behaviour policy mu, so the loss weights it by min(pi_prox / mu, cap) like the
policy term. On a categorical bandit, enumerated exactly over the support: the KL term's
expected gradient over mu's samples equals the on-policy one (samples from pi_prox, no
weight), on the logits path and through the fused output layer (gradient in the forward)."""
import pytest
import torch

from megagrpo.kernels import LossSpec, TokenInputs, VocabPass, token_loss

V = 6


def _policies(tv: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits [V] of pi_prox, mu and the reference; mu is pi_prox moved by total variation ~tv
    (mixed toward another distribution)."""
    g = torch.Generator().manual_seed(0)
    prox = torch.randn(V, generator=g, dtype=torch.float64)
    other = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 2, 0)
    p = torch.softmax(prox, 0)
    lam = tv / float(0.5 * (other - p).abs().sum())
    mu = ((1 - lam) * p + lam * other).log()
    ref = prox + 0.3 * torch.randn(V, generator=g, dtype=torch.float64)
    return prox, mu, ref


def _expected_grad(theta: torch.Tensor, prox: torch.Tensor, sampler: torch.Tensor,
                   ref: torch.Tensor, estimator: str, weighted: bool, fused: bool
                   ) -> torch.Tensor:
    """d/dtheta of sum_y sampler(y) loss(y): every outcome y a token of probability
    sampler(y), advantage 0 (the KL term alone), old log-probs pi_prox's, importance weights
    pi_prox / sampler when `weighted`. `fused`: through the fused output layer (hidden states
    [V, 1] of ones, output weight [V, 1] = theta) with the probabilities as token weights."""
    y = torch.arange(V)
    logp_prox, logp_s = torch.log_softmax(prox, 0), torch.log_softmax(sampler, 0)
    spec = LossSpec(beta=1.0, kl_estimator=estimator, is_cap=10.0)  # cap never reached here
    inputs = TokenInputs(logp_prox[y].float(), torch.zeros(V), torch.ones(V, dtype=torch.bool),
                         ref_logp=torch.log_softmax(ref, 0)[y].float(),
                         is_weight=(logp_prox - logp_s).exp().float() if weighted else None)
    prob = logp_s.exp().float()
    w = theta.detach().float().clone().requires_grad_()
    if fused:
        loss, _, _ = token_loss(torch.ones(V, 1), y, spec, inputs, weight=w[:, None],
                                token_weight=prob, run=VocabPass(impl="torch"))
    else:
        loss = (token_loss(w.expand(V, V), y, spec, inputs)[0] * prob).sum()
    loss.backward()
    return w.grad.double()


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "k3_is"])
@pytest.mark.parametrize("tv", [0.04, 0.31])
@pytest.mark.parametrize("moved", [False, True])
def test_stale_kl_gradient_is_the_on_policy_one(tv, estimator, fused, moved):
    """`moved`: pi_theta has left pi_prox (a later pass of the batch, ratio != 1)."""
    prox, mu, ref = _policies(tv)
    theta = prox + (0.2 * torch.linspace(-1, 1, V, dtype=torch.float64) if moved else 0)
    on = _expected_grad(theta, prox, prox, ref, estimator, weighted=False, fused=fused)
    stale = _expected_grad(theta, prox, mu, ref, estimator, weighted=True, fused=fused)
    err = float((stale - on).norm() / on.norm())
    print(f"\ntv {tv} {estimator} fused={fused} moved={moved}: relative error {err:.2e}")
    assert (stale - on).abs().max() < 1e-6
