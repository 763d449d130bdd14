"""megagrpo.model.optim.use_fused_adam: torch's fused AdamW kernel applies the same update rule as
the per-parameter loop megatron-core builds without TE/Apex (checked against float64 math), and the
switch reaches megatron's optimizer wrappers (tests/_trainer_worker.py checks the trainer's)."""
import torch

from megagrpo.model.optim import torch_adams, use_fused_adam

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-8, 0.1


def _adamw_float64(p0, grads):
    """AdamW (decoupled weight decay, bias-corrected moments) in float64."""
    p, m, v = p0.double().clone(), torch.zeros_like(p0, dtype=torch.float64), \
        torch.zeros_like(p0, dtype=torch.float64)
    b1, b2 = BETAS
    for t, g in enumerate(grads, start=1):
        g = g.double()
        p.mul_(1 - LR * WD)
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = (v / (1 - b2 ** t)).sqrt().add_(EPS)
        p.addcdiv_(m / (1 - b1 ** t), denom, value=-LR)
    return p


def _run(fused: bool, p0, grads):
    p = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)  # megatron's call
    if fused:
        assert use_fused_adam(opt)
        assert opt.param_groups[0]["fused"] is True and opt.param_groups[0]["foreach"] is False
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


def test_fused_adam_matches_float64_adamw_and_the_loop():
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(37, 19, generator=gen)
    grads = [torch.randn(37, 19, generator=gen) * s for s in (1.0, 1e-3, 10.0, 0.5)]
    ref = _adamw_float64(p0, grads)
    fused, loop = _run(True, p0, grads), _run(False, p0, grads)
    assert not torch.equal(fused, p0)
    torch.testing.assert_close(fused.double(), ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(loop.double(), ref, rtol=0, atol=1e-6)


def test_only_torch_adams_are_switched():
    p = torch.nn.Parameter(torch.zeros(3))
    sgd = torch.optim.SGD([p], lr=0.1)
    assert torch_adams(sgd) == [] and use_fused_adam(sgd) is False
    assert "fused" not in sgd.param_groups[0] or not sgd.param_groups[0]["fused"]


def test_the_switch_survives_a_state_dict_from_the_loop():
    """A checkpoint written by the per-parameter loop carries fused=None in its groups;
    load_state_dict takes the flags from it, so megagrpo switches again after loading."""
    p = torch.nn.Parameter(torch.ones(4))
    loop = torch.optim.AdamW([p], lr=LR)
    p.grad = torch.ones(4)
    loop.step()
    q = torch.nn.Parameter(p.detach().clone())
    opt = torch.optim.AdamW([q], lr=LR)
    use_fused_adam(opt)
    opt.load_state_dict(loop.state_dict())
    assert not opt.param_groups[0]["fused"]
    assert use_fused_adam(opt) and opt.param_groups[0]["fused"]
    q.grad = torch.ones(4)
    opt.step()  # the loop's state (its 'step' tensor included) steps fused
    assert float(opt.state[q]["step"]) == 2.0
