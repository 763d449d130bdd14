"""LoRA adapters beside megatron-core's tensor-parallel linears, and the reference they make free.

A targeted linear y = W x gets y = W x + s * B A x with s = lora.alpha / lora.rank, A [r, in]
and B [out, r] (B starts at zero, so the adapted model starts as the base). The base (every
parameter of the model, embeddings and norms included) is frozen before megatron's DDP wraps
the model: DDP makes grad buffers, and the optimizer state, for the adapters only.

Tensor parallelism: each adapter is split like the weight it sits beside, so every rank holds
the adapter shards that pair with its weight shard.
- column-parallel (qkv, fc1: W [out/tp, in] per rank): A [r, in] replicated, B [out/tp, r] split
  on dim 0. h = A x is the same on every rank; it goes through megatron's
  `copy_to_tensor_model_parallel_region` (identity forward, all-reduce of dL/dh backward), so
  A's gradient and the input's gradient from the adapter are the full sums on every rank.
- row-parallel (proj, fc2: W [out, in/tp], input x split): A [r, in/tp] split on dim 1, B
  [out, r] replicated. h = A_local x_local is a partial sum, all-reduced over TP
  (`reduce_from_tensor_model_parallel_region`: all-reduce forward, identity backward) before
  B: B's gradient then is the same on every rank without a TP reduction (adding B A_local
  x_local to the partial output before megatron's own all-reduce would leave B's gradient
  partial). The cost is an all-reduce of [tokens, r] per row layer.
Replicated adapter tensors carry megatron's defaults (tensor_model_parallel=False), so the
gradient norm counts them once; split ones carry the TP attributes of their weight.

Sequence parallelism (the layers' activations [S/tp, b, h]): the adapter does the base's
communication on its own rank-r activations. Column: h = A x_local [S/tp, b, r] is all-gathered
along the sequence (`gather_from_sequence_parallel_region`, backward the reduce-scatter of dL/dh:
the sum over TP ranks of each rank's B_local contribution, for this rank's tokens), which equals
A applied to the gathered input. Row: the partial sums A_local x_local [S, b, r] are
reduce-scattered to this rank's [S/tp, b, r] before B, as the base's output is. The replicated
tensor (column A, row B) then holds the gradient of this rank's tokens only: it carries
megatron's `sequence_parallel` mark, so `finalize_model_grads` sums it over TP as it does the
layer norms'. Expert linears whose communication the token dispatcher does
(`explicit_expert_comm`) see whole token sets and take neither step.

MoE layers: fc1 / fc2 targets put an adapter on every routed expert's linear_fc1 / linear_fc2
(megatron's SequentialMLP: one MLP per local expert), on the shared expert's when the model
has one, and on the MLP of the model's dense layers; the router is never adapted. The adapters
live where their expert lives: each expert-parallel rank builds those of its own experts, with
the expert weight's `allreduce=False` mark, so megatron's DDP reduces their gradients over the
expert-data-parallel group as it does the expert weights'. Every adapter's A is drawn from a
stream of its own (seed, layer, target, expert), so any EP layout holds the same adapters.
Expert tensor parallelism (expert linears with `explicit_expert_comm` at TP > 1, whose TP
communication the token dispatcher does) is not built: `LoRAConfig.validate` refuses it.

Fused layers: the fused QKV (per KV group [q, k, v]) and fc1 (cat(gate, up)) get one adapter
over the fused output, i.e. a LoRA of the fused matrix: A is shared by q, k and v (by gate and
up), B has a row block per part in the weight's own row order, so a merge adds each part's rows
to the right rows of the shard. A per-projection adapter (peft's q_proj/k_proj/v_proj, each its
own A) is a different, larger parameterisation (rank 3r for QKV); exporting this one to peft
repeats A for each part. Merges are exact either way.

The reference (`LoRAReference`): the policy with the adapters off (`adapters_disabled`), no
second model. A reset with mixing weight a merges: W += a * s * B A on each rank's own shards
(B_local A for a column layer, B A_local for a row layer: exactly the rows/columns of that
rank's W shard), then B *= (1 - a). The policy W + s B A keeps the adapter's contribution: the
add is rounded once into W, and where W is bf16/fp16 the part of it the rounding dropped is
folded back into B (least squares onto A's rows, `merge_adapters`), so the policy moves by less
than one rounding of its merged weight; the reference W' = W + a s B A is a * policy + (1 - a)
* ref in weight space (up to that rounding), as `megagrpo.model.reference.sync_reference` does for a
full reference. A is kept
(B = 0 makes any A a valid start, and the trained A is a good one). Adam's moments are kept
too, B's as they are (the policy does not move at a reset and B's gradient s dL/dW A^T does not
depend on B; zeroing moments while keeping Adam's step count would make the next updates ~3x
larger), A's scaled like A's gradient s B^T dL/dW, which B *= (1 - a) scales: first moment x
(1 - a), second x (1 - a)^2 (`LoRAReference.rescale_moments`), so A's steps keep their size
(kept moments would make them ~(1 - a) of it for hundreds of steps, and at a = 1 move A on
stale momentum with a zero gradient).
"""
from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator, Mapping
from typing import ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megagrpo.config.lora import LoRAConfig
from megagrpo.config.train import ReferenceConfig
from megagrpo.model.gpt import unwrap
from megagrpo.model.optim import scale_adam_moments
from megagrpo.model.reference import ReferenceSchedule, ReferenceState

log = logging.getLogger("megagrpo")

TARGET_MODULES = {"qkv": "self_attention.linear_qkv", "proj": "self_attention.linear_proj",
                  "fc1": "mlp.linear_fc1", "fc2": "mlp.linear_fc2"}
"""Where each target sits inside a TransformerLayer with a dense MLP (an MoE layer's fc1 / fc2
are its experts', `_target_linears`)."""
ROW_TARGETS = ("proj", "fc2")
SHARED_EXPERT = -1
"""The expert index of an MoE layer's shared expert in the adapters' init streams."""


# ---------------------------------------------------------------------- the adapted linears
def _lora_forward(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out + s * B A x for a column- or row-parallel linear's input x [S, b, in or in/tp] and
    output out [S, b, out/tp or out]."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
        reduce_from_tensor_model_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
    )

    if not self.lora_enabled:
        return out
    if self.lora_dropout > 0 and self.training:
        x = F.dropout(x, self.lora_dropout)
    h = F.linear(x.to(self.lora_A.dtype), self.lora_A)  # [S or S/tp, b, r]
    if self.lora_row and self.lora_sp:  # partial sums over TP -> this rank's [S/tp, b, r]
        h = reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)
    elif self.lora_row:
        h = reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
    elif self.lora_sp:  # [S/tp, b, r] -> [S, b, r]; backward: reduce-scatter of dL/dh
        h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True,
                                                 group=self.tp_group)
    else:
        h = copy_to_tensor_model_parallel_region(h, group=self.tp_group)
    return out + (F.linear(h, self.lora_B) * self.lora_scale).to(out.dtype)


def _adapted_forward(self, input_: torch.Tensor, *args, **kwargs):
    out, bias = super(self.__class__, self).forward(input_, *args, **kwargs)
    return _lora_forward(self, input_, out), bias


def _adapted_sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
    """megatron's sharded state dict with the adapters split like their weight (megatron's own
    marks every tensor it does not know as replicated, which a split A or B is not)."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    axes = {"weight": 1, "lora_A": 1} if self.lora_row else {"weight": 0, "bias": 0,
                                                              "lora_B": 0}
    sd = make_sharded_tensors_for_checkpoint(
        self.state_dict(prefix="", keep_vars=True), prefix, axes, sharded_offsets,
        tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])
    if self.lora_glu:
        # fc1's B rows are cat(gate_r, up_r) per rank like its weight: saved as the two halves
        # (megatron's MLP does the same for the weight), so they reshard to another TP
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

        key = f"{prefix}lora_B"
        sd[key] = apply_swiglu_sharded_factory(
            sd[key], sharded_offsets, (metadata or {}).get("singleton_local_shards", False))
    return sd


@functools.lru_cache(maxsize=None)
def _adapted_class(base: type) -> type:
    """`base` (megatron's ColumnParallelLinear or RowParallelLinear) with an adapter: a module
    keeps its class's parameters and names (`...linear_qkv.weight`), and gains `lora_A`,
    `lora_B`."""
    return type(f"LoRA{base.__name__}", (base,), {
        "forward": _adapted_forward, "sharded_state_dict": _adapted_sharded_state_dict})


def _init_a(shape: tuple[int, int], seed: int, layer: int, target: int,
            expert: int | None = None) -> torch.Tensor:
    """The full A [r, in] of one adapter: uniform(+-1/sqrt(in)) (kaiming-uniform with a=sqrt(5),
    as torch's Linear and peft), from a stream of its own, so every TP rank draws the same
    full tensor and any layout holds shards of one A. `expert`: the global routed-expert index
    (or SHARED_EXPERT) of an MoE layer's fc1 / fc2, None elsewhere (dense streams unchanged)."""
    stream = seed * 1_000_003 + layer * 16 + target
    if expert is not None:  # far above any dense stream: (expert + 2) * 2^40
        stream += (expert + 2) << 40
    g = torch.Generator().manual_seed(stream)
    bound = 1.0 / shape[1] ** 0.5
    return (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1).mul_(bound).float()


def _attach(linear: torch.nn.Module, cfg: LoRAConfig, row: bool, seed: int, layer: int,
            target: int, glu: bool = False, expert: int | None = None) -> None:
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    w = linear.weight
    tp, tp_rank = linear.tp_group.size(), linear.tp_group.rank()  # expert TP for experts
    if getattr(linear, "explicit_expert_comm", False) and tp > 1:
        raise RuntimeError("lora: adapters on experts at expert tensor parallelism > 1 are not "
                           "built (LoRAConfig.validate refuses it)")
    out_local, in_local = w.shape
    in_full = in_local * tp if row else in_local
    a = _init_a((cfg.rank, in_full), seed, layer, target, expert)
    if row:
        a = a[:, tp_rank * in_local:(tp_rank + 1) * in_local]
    linear.lora_A = torch.nn.Parameter(a.to(w.dtype).contiguous().to(w.device))
    linear.lora_B = torch.nn.Parameter(torch.zeros(out_local, cfg.rank, dtype=w.dtype,
                                                   device=w.device))
    split = linear.lora_A if row else linear.lora_B
    set_tensor_model_parallel_attributes(split, True, 1 if row else 0, 1)
    if hasattr(w, "allreduce"):  # expert weights (EP > 1): reduced over expert-DP, not DP
        linear.lora_A.allreduce = linear.lora_B.allreduce = w.allreduce
    # sequence parallelism as the base linear does it (megatron turns it off at TP 1 and where
    # the token dispatcher does an expert's communication)
    sp = bool(getattr(linear, "sequence_parallel", False)) and not getattr(
        linear, "explicit_expert_comm", False)
    if sp:  # the replicated tensor's gradient covers this rank's tokens: summed over TP
        (linear.lora_B if row else linear.lora_A).sequence_parallel = True
    linear.lora_row, linear.lora_scale, linear.lora_dropout = row, cfg.scale, cfg.dropout
    linear.lora_sp = sp
    linear.lora_glu = glu
    linear.lora_enabled = True
    linear.__class__ = _adapted_class(type(linear))


def add_adapters(gpt: torch.nn.Module, cfg: LoRAConfig, *, seed: int) -> int:
    """Freezes every parameter of this rank's GPTModel stage and puts an adapter beside each
    targeted linear of its layers (before `megagrpo.model.optim.wrap_ddp`). Returns the adapters'
    element count on this rank."""
    from megatron.core import parallel_state as ps

    gpt = unwrap(gpt)
    for p in gpt.parameters():
        p.requires_grad_(False)
    ep_rank = ps.get_expert_model_parallel_rank()
    n = 0
    for layer in gpt.decoder.layers:
        for t, name in enumerate(cfg.targets):
            for linear, expert in _target_linears(layer, name, ep_rank):
                if getattr(linear, "gather_output", False):
                    raise RuntimeError(f"lora: {name} gathers its output; not supported")
                _attach(linear, cfg, name in ROW_TARGETS, seed, layer.layer_number, t,
                        glu=name == "fc1", expert=expert)
                n += linear.lora_A.numel() + linear.lora_B.numel()
    return n


def _target_linears(layer: torch.nn.Module, name: str, ep_rank: int
                    ) -> list[tuple[torch.nn.Module, int | None]]:
    """(linear, expert index) of target `name` in one TransformerLayer: the dense linear
    (expert None), or in an MoE layer (fc1 / fc2) every local routed expert's, with its global
    index (EP rank r holds experts r * E_local ...), then the shared expert's (SHARED_EXPERT).
    The router is no target."""
    mlp = layer.mlp
    if name in ("qkv", "proj") or not hasattr(mlp, "experts"):
        return [(layer.get_submodule(TARGET_MODULES[name]), None)]
    attr = TARGET_MODULES[name].split(".")[-1]  # linear_fc1 / linear_fc2
    local = mlp.experts.local_experts  # SequentialMLP: megagrpo builds no grouped GEMM
    out = [(getattr(e, attr), ep_rank * len(local) + i) for i, e in enumerate(local)]
    if getattr(mlp, "shared_experts", None) is not None:
        out.append((getattr(mlp.shared_experts, attr), SHARED_EXPERT))
    return out


def adapted(model: torch.nn.Module | list) -> list[torch.nn.Module]:
    """The linears of `model` (or of its chunks) that carry an adapter."""
    chunks = model if isinstance(model, list) else [model]
    return [m for c in chunks for m in unwrap(c).modules() if hasattr(m, "lora_B")]


def has_adapters(model: torch.nn.Module | list) -> bool:
    return bool(adapted(model))


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module | list) -> Iterator[None]:
    """Forwards of `model` inside run without the adapters: the base, i.e. the reference."""
    mods = adapted(model)
    for m in mods:
        m.lora_enabled = False
    try:
        yield
    finally:
        for m in mods:
            m.lora_enabled = True


def _delta(m: torch.nn.Module) -> torch.Tensor:
    """s * B A for this rank's shards, in float32 or wider: [out/tp, in] (column: B_local A) or
    [out, in/tp] (row: B A_local), the exact rows/columns of this rank's weight shard."""
    dt = torch.promote_types(m.lora_B.dtype, torch.float32)
    return (m.lora_B.detach().to(dt) @ m.lora_A.detach().to(dt)) * m.lora_scale


def _tp_sum(t: torch.Tensor, group) -> torch.Tensor:
    """`t` summed over the adapter's TP group (in place; no-op on one rank)."""
    if group is not None and group.size() > 1:
        dist.all_reduce(t, group=group)
    return t


def _fold_residual(m: torch.nn.Module, resid: torch.Tensor) -> torch.Tensor:
    """X [out_local, r] minimising |s X A - resid| (resid [out_local, in_local], the part of the
    merge's add that the narrow base did not absorb): resid's projection onto A's row space,
    where the adapter's contribution s B A lives. Row layers hold a column block of W and A, so
    the normal equations' two products are summed over TP (B is replicated there); column
    layers hold all of A and their own rows of B: no communication."""
    a = m.lora_A.detach().to(torch.float64)
    ra = resid.to(torch.float64) @ a.T  # [out_local, r]
    gram = a @ a.T  # [r, r]
    if m.lora_row:
        ra, gram = _tp_sum(ra, m.tp_group), _tp_sum(gram, m.tp_group)
    return ra @ torch.linalg.pinv(gram, hermitian=True) / m.lora_scale


def _row_scales(m: torch.nn.Module, b_old: torch.Tensor, b_new: torch.Tensor) -> torch.Tensor:
    """c [r, 1]: A's gradient s B^T dL/dW scales by c_k on row k when B's column k goes from
    b_old to b_new (least squares c_k = <b_new_k, b_old_k> / |b_old_k|^2: exactly 1 - alpha
    without a folded residual; 1 where the column was zero). Column layers sum over TP (their
    B rows are split)."""
    num = (b_new.double() * b_old.double()).sum(0)
    den = b_old.double().square().sum(0)
    if not m.lora_row:
        both = _tp_sum(torch.stack([num, den]), m.tp_group)
        num, den = both[0], both[1]
    return torch.where(den > 0, num / den.clamp_min(1e-300), torch.ones_like(num))[:, None]


@torch.no_grad()
def merge_adapters(model: torch.nn.Module | list, alpha: float = 1.0
                   ) -> dict[torch.nn.Parameter, torch.Tensor]:
    """W += alpha * s * B A, then B *= (1 - alpha), per shard, in place. With alpha = 1 the
    adapter restarts from B = 0 (in float32; below) and the base (the reference) becomes the
    policy.

    The policy W + s B A keeps the adapter's contribution: the add is computed in float32 (or
    wider) and rounded once into W; where W is narrower (bf16/fp16) an adapter's delta can sit
    below half an ulp of W and vanish in that rounding (W rms 0.02 in bf16, delta rms 2e-5:
    46% of it in tests/test_lora_merge.py, more for smaller deltas), so the residual
    (W + alpha delta) - W_new is folded back into B by least squares onto A's rows
    (`_fold_residual`; s B A lies in them, so the adapter's part of the residual returns
    whole and only rounding noise outside A's rows is left). B is then not
    zero at alpha = 1 in bf16/fp16: the reference (the base) is the policy rounded once to the
    base's dtype. Two small all-reduces over TP per layer (`_fold_residual`, `_row_scales`);
    in float32 the add's rounding (2^-24 of W) is left as it is and nothing is communicated.

    Returns, per adapter's A, its gradient scale c [r, 1] (A's gradient s B^T dL/dW follows B:
    1 - alpha, or `_row_scales` where a residual was folded), for
    `megagrpo.model.optim.scale_adam_moments`."""
    scales = {}
    for m in adapted(model):
        w, b = m.weight, m.lora_B
        dt = torch.promote_types(w.dtype, torch.float32)
        exact = w.to(dt) + alpha * _delta(m)
        w.copy_(exact.to(w.dtype))
        b_old = b.detach().to(dt)
        b_new = (1.0 - alpha) * b_old
        scale = torch.full((b.shape[1], 1), 1.0 - alpha, dtype=torch.float64)
        if w.dtype != dt:  # the rounding of a narrow base can eat small deltas: fold it back
            b_new = b_new + _fold_residual(m, exact - w.to(dt)).to(dt)
            scale = _row_scales(m, b_old, b_new.to(b.dtype).to(dt))
        b.copy_(b_new.to(b.dtype))
        scales[m.lora_A] = scale
    return scales


class MergedParams(Mapping):
    """The stage's named parameters with each adapted weight read as its merged value
    W + s B A (computed when read, one tensor at a time): what vLLM and an HF export get.
    The adapters themselves are not listed."""

    def __init__(self, gpt: torch.nn.Module):
        self._params = {n: p for n, p in gpt.named_parameters() if ".lora_" not in n}
        self._adapted = {f"{n}.weight": m for n, m in gpt.named_modules() if hasattr(m, "lora_B")}

    def __getitem__(self, name: str) -> torch.Tensor:
        p = self._params[name]
        m = self._adapted.get(name)
        if m is None or not m.lora_enabled:
            return p
        return (p.detach().to(torch.promote_types(p.dtype, torch.float32)) + _delta(m)).to(
            p.dtype)

    def __iter__(self):
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


def parameters_for_refit(gpt: torch.nn.Module) -> Mapping[str, torch.Tensor]:
    """Named parameters of the stage inside `gpt` (DDP-wrapped or not) as vLLM / export should
    see them: merged where adapted (with the adapters off: W). What a LoRA policy hands the
    weight stream (`megagrpo.sync.source`: `params=`)."""
    gpt = unwrap(gpt)
    return MergedParams(gpt) if has_adapters(gpt) else dict(gpt.named_parameters())


# ---------------------------------------------------------------------- the reference
class LoRAReference(ReferenceSchedule):
    """The KL reference of a LoRA policy: the policy with its adapters off. Same schedule and
    interface as `megagrpo.model.reference.Reference`; `onload` / `offload` bracket a scoring pass
    (adapters off / back on), `sync` merges."""

    separate_model: ClassVar[bool] = False
    """No model of its own: a checkpoint saves nothing for it beyond the schedule."""

    def __init__(self, policy: torch.nn.Module | list, cfg: ReferenceConfig):
        self.cfg = cfg
        self.state = ReferenceState()
        self.policy = policy
        self._scoring: contextlib.ExitStack | None = None
        self.merges = 0
        """Merges so far (the cold start's reset included): which base a checkpoint holds
        (`megagrpo.lora.checkpoint`)."""
        self.a_grad_scales: dict[torch.nn.Parameter, torch.Tensor] = {}
        """A's gradient scale per row [r, 1] from the last merge, until `rescale_moments` hands
        it to the optimizer."""

    @property
    def model(self) -> torch.nn.Module | list:
        """What the scoring pass runs: the policy (between `onload` and `offload`, the adapters
        are off)."""
        return self.policy

    def reinit(self, policy: torch.nn.Module | list, alpha: float = 1.0) -> None:
        """The reference moves to alpha * policy + (1 - alpha) * reference: a merge."""
        self.a_grad_scales = merge_adapters(policy, alpha)
        self.merges += 1

    def rescale_moments(self, optimizer) -> None:
        """After a merge: Adam's moments of every A scaled like A's gradient (B *= 1 - alpha
        scales it), so A's next steps are the size they would be without the merge rather
        than ~(1 - alpha) of it, and A does not drift on stale momentum at alpha = 1."""
        scale_adam_moments(optimizer, self.a_grad_scales)
        self.a_grad_scales = {}

    def state_dict(self) -> dict:
        """The schedule's state and the merge count."""
        return {**super().state_dict(), "merges": self.merges}

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        self.merges = state.pop("merges", 0)
        super().load_state_dict(state)

    def equals(self, policy: torch.nn.Module | list, group=None) -> bool:
        """Whether every adapter's B is zero on every rank of `group` (the adapters then add
        exactly 0, so the reference's log-probs are the policy's)."""
        same = all(not m.lora_B.any() for m in adapted(policy))
        flag = torch.tensor([1.0 if same else 0.0])
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        return bool(flag.item())

    def onload(self) -> None:
        """Before a scoring pass: adapters off."""
        self._scoring = contextlib.ExitStack()
        self._scoring.enter_context(adapters_disabled(self.policy))

    def offload(self) -> None:
        """After a scoring pass: adapters back on."""
        if self._scoring is not None:
            self._scoring.close()
            self._scoring = None


def describe(n_adapter: int, n_total: int, cfg: LoRAConfig, no_adapter_refit: str = "") -> str:
    """One console line: what trains, and how vLLM gets it (`no_adapter_refit`: why vLLM
    cannot serve the adapters, '' when it does; `megagrpo.sync.adapters.unavailable`)."""
    refit = ("vLLM serves the adapters (LoRA request per rollout): refits carry the adapters, "
             "the base only after a merge" if not no_adapter_refit else
             f"vLLM is refit with the merged weights (W + s B A) after each update "
             f"(no adapter-only refit: {no_adapter_refit})")
    return (f"lora: rank {cfg.rank}, alpha {cfg.alpha:g} on {','.join(cfg.targets)}: "
            f"{n_adapter:,} trainable of {n_total:,} parameters on this rank "
            f"({100 * n_adapter / max(n_total, 1):.2f}%); the reference is the adapters off; "
            f"{refit}")
