"""A LoRA merge (the reference reset, `megagrpo.lora.layers.merge_adapters`) in float64 on one
linear of a bf16 base: the merged policy W_new + s B_new A keeps the adapter's contribution s B A
even where it sits below half an ulp of W (which a plain rounded add drops), and its output differs
from the exact policy by no more than one bf16 rounding of the merged weight does."""
import pytest
import torch

from megagrpo.lora.layers import merge_adapters

OUT, IN, R, SCALE = 64, 256, 4, 2.0


class _Adapted(torch.nn.Module):
    """One linear with an adapter, as `megagrpo.lora.layers._attach` leaves it: column-parallel on
    one rank (no TP group) unless told otherwise."""

    def __init__(self, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *,
                 row: bool = False, group=None):
        super().__init__()
        self.weight = torch.nn.Parameter(w, requires_grad=False)
        self.lora_A, self.lora_B = torch.nn.Parameter(a), torch.nn.Parameter(b)
        self.lora_row, self.lora_scale, self.tp_group = row, SCALE, group

    def effective(self) -> torch.Tensor:
        """W + s B A in float64 [OUT, IN]: the policy's weight."""
        return self.weight.double() + SCALE * self.lora_B.double() @ self.lora_A.double()


def _layer(dtype: torch.dtype, delta_rms: float, seed: int = 0) -> _Adapted:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(OUT, IN, generator=g, dtype=torch.float64) * 0.02).to(dtype)
    a = ((torch.rand(R, IN, generator=g, dtype=torch.float64) * 2 - 1) / IN ** 0.5).to(dtype)
    b = torch.randn(OUT, R, generator=g, dtype=torch.float64)
    delta = SCALE * b @ a.double()
    b = (b * delta_rms / delta.square().mean().sqrt()).to(dtype)
    return _Adapted(w, a, b)


def _inputs(layer: _Adapted, aligned: bool) -> torch.Tensor:
    """[N, IN]: isotropic, or mostly in A's row space (where a trained A points: its gradient
    B^T dL/dy x^T lies in the inputs' span), norm ~sqrt(IN) either way."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, IN, generator=g, dtype=torch.float64)
    if aligned:
        z = torch.randn(512, R, generator=g, dtype=torch.float64) @ layer.lora_A.double()
        x = z * (IN ** 0.5 / z.norm(dim=1, keepdim=True)) + 0.1 * x
    return x


def _kl(w_p: torch.Tensor, w_q: torch.Tensor, x: torch.Tensor) -> float:
    """Mean KL(softmax(x w_p^T) || softmax(x w_q^T)) over the rows of x."""
    lp, lq = (torch.log_softmax(x @ w.T, -1) for w in (w_p, w_q))
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


def _one_rounding(w: torch.Tensor, dtype: torch.dtype, seed: int = 2) -> torch.Tensor:
    """w [OUT, IN] float64 plus one rounding to `dtype`'s grid as noise independent of w:
    uniform within +-half an ulp of each element."""
    g = torch.Generator().manual_seed(seed)
    ulp = (w.to(dtype).double().abs() * torch.finfo(dtype).eps).clamp_min(1e-30)
    return w + (torch.rand(w.shape, generator=g, dtype=torch.float64) - 0.5) * ulp


@pytest.mark.parametrize("alpha", [1.0, 0.3])
@pytest.mark.parametrize("aligned", [False, True])
def test_bf16_merge_keeps_the_adapters_contribution(alpha, aligned):
    """W rms 0.02, adapter contribution rms 2e-5 (most of it below half a bf16 ulp of W): the
    share of s B A the merged policy keeps is 1 within 1%, and the KL between the exact policy
    and the merged one is at most that of rounding the exact merged weight once to bf16."""
    layer = _layer(torch.bfloat16, 2e-5)
    w0, before = layer.weight.double().clone(), layer.effective()
    delta = before - w0
    merge_adapters(layer, alpha)
    after = layer.effective()
    kept = float(((after - w0) * delta).sum() / delta.square().sum())
    x = _inputs(layer, aligned)
    kl, kl_rounding = _kl(before, after, x), _kl(before, _one_rounding(before, torch.bfloat16), x)
    print(f"\nalpha {alpha} aligned {aligned}: kept {kept:.4f}, KL {kl:.3e}, "
          f"one bf16 rounding {kl_rounding:.3e}")
    assert abs(kept - 1) < 0.01
    assert kl <= kl_rounding


def test_fp32_merge_at_alpha_1_zeroes_b():
    """In float32 the add's rounding (2^-24 of W) is not folded back: B = 0 after a reset, so
    the reference (the adapters off) is the policy bitwise."""
    layer = _layer(torch.float32, 1e-3)
    before = layer.effective()
    merge_adapters(layer, 1.0)
    assert not layer.lora_B.any()
    assert (layer.effective() - before).abs().max() < 1e-8


# ---------------------------------------------------------------------- A's Adam moments
def _steps_on_fixed_grads(layer: _Adapted, opt: torch.optim.Optimizer, steps: int,
                          seed: int, train_b: bool = False) -> list[torch.Tensor]:
    """A's steps [R, IN] under a loss linear in the policy's weight, <W_eff, G_t> with G_t
    [OUT, IN] a random sequence drawn from `seed`, B held unless `train_b`: A's gradient
    s B^T G_t then depends on B alone, so two runs from one state differ only by the scale a
    merge put on B (and A's moments)."""
    layer.lora_B.requires_grad_(train_b)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        grad_w = torch.randn(OUT, IN, generator=g, dtype=torch.float64) + 0.5
        ((layer.weight + SCALE * layer.lora_B @ layer.lora_A) * grad_w).sum().backward()
        a0 = layer.lora_A.detach().clone()
        opt.step()
        out.append(layer.lora_A.detach() - a0)
    return out


def _trained(seed: int = 3) -> tuple[_Adapted, torch.optim.Optimizer]:
    """A float64 layer whose adapters (A and B) took 30 Adam steps."""
    layer = _layer(torch.float64, 1e-3, seed)
    opt = torch.optim.Adam([layer.lora_A, layer.lora_B], lr=1e-3)
    _steps_on_fixed_grads(layer, opt, 30, seed=4, train_b=True)
    return layer, opt


@pytest.mark.parametrize("alpha", [0.3, 0.7])
def test_a_steps_after_a_merge_match_a_run_without(alpha):
    """After a merge (B *= 1 - alpha scales A's gradient by 1 - alpha) A's next Adam steps are
    the size they are without the merge: ratio of the step norms over 20 steps within 1 +- 0.05
    (`_steps_on_fixed_grads`; with the moments kept, the ratio falls toward 1 - alpha)."""
    import copy

    from megagrpo.model.optim import scale_adam_moments

    layer, opt = _trained()
    twin = copy.deepcopy(layer)
    twin_opt = torch.optim.Adam([twin.lora_A, twin.lora_B], lr=1e-3)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # load shares the tensors
    assert scale_adam_moments(opt, merge_adapters(layer, alpha)) == 1
    merged = _steps_on_fixed_grads(layer, opt, 20, seed=5)
    plain = _steps_on_fixed_grads(twin, twin_opt, 20, seed=5)
    ratio = [float(m.norm() / p.norm()) for m, p in zip(merged, plain)]
    print(f"\nalpha {alpha}: A's step after / without a merge, steps 1, 5, 20: "
          f"{ratio[0]:.4f} {ratio[4]:.4f} {ratio[19]:.4f}")
    assert all(abs(r - 1) < 0.05 for r in ratio)


def test_a_does_not_drift_on_stale_momentum_at_alpha_1():
    """alpha = 1: B = 0, so A's gradient is 0; with its moments scaled to 0, A stays put."""
    from megagrpo.model.optim import scale_adam_moments

    layer, opt = _trained()
    scale_adam_moments(opt, merge_adapters(layer, 1.0))
    step = _steps_on_fixed_grads(layer, opt, 1, seed=5)[0]
    print(f"\nalpha 1: A's step {float(step.norm()):.3e}")
    assert not step.any()


def test_moments_are_found_in_megatrons_layouts():
    """`scale_adam_moments` through megatron's wrappers as megatron-core 0.16 lays them out
    (attribute for attribute): the float16 optimizer's state is keyed by `param.main_param`,
    the distributed optimizer's by a flat shard (`model_param_group_index_map`, its range from
    `_get_model_param_range_map(p)["param"]`); every element gets its row's scale."""
    from types import SimpleNamespace

    from megagrpo.model.optim import scale_adam_moments

    def stepped(main: torch.nn.Parameter) -> torch.optim.Adam:
        opt = torch.optim.Adam([main], lr=1e-3)
        main.grad = torch.arange(main.numel(), dtype=main.dtype).reshape(main.shape) + 1.0
        opt.step()
        return opt

    c = torch.tensor([[0.5], [2.0], [0.0], [1.0]], dtype=torch.float64)  # [4, 1] rows
    full = c.expand(4, 6).reshape(-1)
    # float16 layout: an fp32 main copy beside the model's parameter
    p = torch.nn.Parameter(torch.zeros(4, 6, dtype=torch.bfloat16))
    p.main_param = torch.nn.Parameter(torch.zeros(4, 6))
    f16 = SimpleNamespace(optimizer=stepped(p.main_param))
    m0 = f16.optimizer.state[p.main_param]["exp_avg"].clone().reshape(-1)
    v0 = f16.optimizer.state[p.main_param]["exp_avg_sq"].clone().reshape(-1)
    assert scale_adam_moments(SimpleNamespace(chained_optimizers=[f16]), {p: c}) == 1
    st = f16.optimizer.state[p.main_param]
    torch.testing.assert_close(st["exp_avg"].reshape(-1).double(), m0.double() * full)
    torch.testing.assert_close(st["exp_avg_sq"].reshape(-1).double(), v0.double() * full ** 2)
    # distributed layout: this rank owns elements 5..17 of the flat parameter
    q = torch.nn.Parameter(torch.zeros(4, 6))
    shard = torch.nn.Parameter(torch.zeros(12))
    dist_opt = SimpleNamespace(
        optimizer=stepped(shard), model_param_group_index_map={q: (0, 0)},
        _get_model_param_range_map=lambda param: {"param": SimpleNamespace(start=5, end=17)})
    m0 = dist_opt.optimizer.state[shard]["exp_avg"].clone()
    assert scale_adam_moments(dist_opt, {q: c, p: c}) == 1  # p: not this optimizer's
    torch.testing.assert_close(dist_opt.optimizer.state[shard]["exp_avg"].double(),
                               m0.double() * full[5:17])


# ---------------------------------------------------------------------- sharded over TP
def _tp_shard(full: _Adapted, row: bool, rank: int, tp: int, group) -> _Adapted:
    """Rank `rank`'s shards of `full` as megatron splits them: a row layer holds a column
    block of W and A (B replicated), a column layer a row block of W and B (A replicated)."""
    w, a, b = (t.detach().clone() for t in (full.weight, full.lora_A, full.lora_B))
    if row:
        cols = slice(rank * IN // tp, (rank + 1) * IN // tp)
        return _Adapted(w[:, cols], a[:, cols].contiguous(), b, row=True, group=group)
    rows = slice(rank * OUT // tp, (rank + 1) * OUT // tp)
    return _Adapted(w[rows], a, b[rows].contiguous(), group=group)


def _tp_merge_rank(rank, world, rdzv, payload_path, out_dir):
    from tests.support.launch import gloo_rank, save_rank

    out = {}
    with gloo_rank(rank, world, rdzv) as group:
        for row in (False, True):
            layer = _tp_shard(_layer(torch.bfloat16, 2e-5), row, rank, world, group)
            scales = merge_adapters(layer, 0.3)
            out[row] = (layer.weight.clone(), layer.lora_A.detach().clone(),
                        layer.lora_B.detach().clone(), scales[layer.lora_A])
    save_rank(out, out_dir, rank)


def test_bf16_merge_over_tp2_equals_the_unsharded_one(tmp_path):
    """At TP=2 (two spawned gloo ranks) a bf16 merge's folded residual and A's gradient scales
    are the unsharded layer's: the row layer sums the fold's normal equations over TP (B is
    replicated and must stay equal on both ranks), the column layer the scales' sums (B's rows
    are split). The merged policies agree within a bf16 rounding of B's entries."""
    from tests.support.launch import spawn_ranks

    ranks = spawn_ranks(_tp_merge_rank, 2, None, tmp_path)
    for row in (False, True):
        whole = _layer(torch.bfloat16, 2e-5)
        want_scale = merge_adapters(whole, 0.3)[whole.lora_A]
        parts = [r[row] for r in ranks]
        if row:  # B replicated: bitwise the same on both ranks
            assert torch.equal(parts[0][2], parts[1][2])
            w = torch.cat([p[0] for p in parts], 1)
            eff = w.double() + SCALE * parts[0][2].double() @ torch.cat(
                [p[1] for p in parts], 1).double()
        else:
            w = torch.cat([p[0] for p in parts], 0)
            eff = w.double() + SCALE * torch.cat([p[2] for p in parts], 0).double() @ \
                parts[0][1].double()
        assert torch.equal(w, whole.weight)
        for p in parts:
            torch.testing.assert_close(p[3], want_scale, rtol=1e-6, atol=0)
        delta = whole.effective() - whole.weight.double()
        err = float((eff - whole.effective()).norm() / delta.norm())
        print(f"\nrow={row}: TP=2 merged policy vs unsharded, relative to s B A: {err:.1e}")
        assert err < 1e-2
