"""A LoRA merge (the reference reset, `megagrpo.lora.merge_adapters`) in float64 on one linear
of a bf16 base: the merged policy W_new + s B_new A keeps the adapter's contribution s B A even
where it sits below half an ulp of W (which a plain rounded add drops), and its output differs
from the exact policy by no more than one bf16 rounding of the merged weight does."""
import pytest
import torch

from megagrpo.lora import merge_adapters

OUT, IN, R, SCALE = 64, 256, 4, 2.0


class _Adapted(torch.nn.Module):
    """One column-parallel linear with an adapter, as `megagrpo.lora._attach` leaves it (one
    rank: no TP group)."""

    def __init__(self, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(w, requires_grad=False)
        self.lora_A, self.lora_B = torch.nn.Parameter(a), torch.nn.Parameter(b)
        self.lora_row, self.lora_scale, self.tp_group = False, SCALE, None

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
