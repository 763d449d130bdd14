"""The output layer and the vocab pass only where a loss is taken.

A GRPO micro-batch [b, S] carries a loss only at completion tokens; the prompt and padding
positions need hidden states (attention reads them) but no logits. The output layer (hidden x
vocab, the biggest matmul of a small model's step) and the fused log-prob / loss kernels then
run on the n selected positions instead of all b x S: `OutputPositions` is a forward pre-hook
on megatron's `output_layer` that keeps the selected rows of its input [S, b, h] -> [n, 1, h],
so the model returns logits [1, n, V_local] and backward scatters the gradient back (autograd).

With the fused output layer (compute.fused_output_layer) the same hook goes one step further:
it keeps the selected hidden states [n, h] and this stage's output weight (the tied embedding
when the stage holds it) for the loss, and hands the output layer zero rows, so megatron's
matmul and its [n, V_local] logits never happen; the loss runs `kernels/fused_output.py` on
the hidden states. Backward reaches the decoder through those hidden states only (the output
layer's zero-row branch is not on the loss's graph), and the weight's gradient comes from the
fused op.

Under sequence parallelism (parallel.sequence_parallel) the output layer's input is this TP
rank's slice of the sequence [S/tp, b, h]: the hook all-gathers it first ([S, b, h], backward:
this rank's slice of the gradient) and runs megatron's output layer without its own gather for
that call; megatron's layer then all-reduces its input gradient over TP (the fused op does the
same), so together the backward is megatron's reduce-scatter. Positions beyond the
micro-batch's width (padding to a multiple of tp) are dropped.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

log = logging.getLogger("megagrpo")
_SAID: set[str] = set()  # output-layer paths already named on the console

LOGITS_SHARE_GPU = 4
"""compute.fused_output_layer=auto on a GPU runs megatron's logits path for a micro-batch whose
logits ``[n, V_local]`` (model dtype) take at most 1/LOGITS_SHARE_GPU of the GPU memory free
then (the logits path peaks at ~1.0x its logits beyond inputs and outputs), the fused layer
otherwise. On the H200 (bf16, H 1024, V 151,936, forward + backward) the logits path took 6.4 /
26.6 / 53.3 ms at T = 4096 / 16384 / 32768, the fused layer's best chunk shapes 7.8-9.2 / 30-37
ms (docs/performance.md, "Fused output layer on the H200"): it is the path for when memory, not
time, is short. On the CPU auto keeps the fused layer wherever it runs."""


def auto_output_path(rows: int, v_local: int, itemsize: int, free_bytes: int | None
                     ) -> tuple[bool, str]:
    """(fused?, why) of compute.fused_output_layer=auto for ``rows`` output positions of a
    ``v_local``-wide shard in ``itemsize``-byte logits, with ``free_bytes`` of GPU memory free
    (None: not a GPU, the fused layer)."""
    if free_bytes is None:
        return True, "fused with the loss: hidden states -> loss, no [tokens, vocab] logits"
    need = rows * v_local * itemsize
    if need * LOGITS_SHARE_GPU <= free_bytes:
        return False, (f"logits path (auto on GPU: the micro-batch's [{rows}, {v_local}] logits, "
                       f"{need / 2**30:.2f} GiB, fit in 1/{LOGITS_SHARE_GPU} of the free "
                       f"{free_bytes / 2**30:.1f} GiB, and the logits path is the faster one)")
    return True, (f"fused with the loss (auto on GPU: the micro-batch's [{rows}, {v_local}] "
                  f"logits, {need / 2**30:.2f} GiB, exceed 1/{LOGITS_SHARE_GPU} of the free "
                  f"{free_bytes / 2**30:.1f} GiB): hidden states -> loss, no logits")


def free_gpu_bytes(device: torch.device, group=None) -> int | None:
    """Free memory of ``device`` for a new tensor: the driver's free bytes plus what torch's
    caching allocator holds unused, the least over ``group`` (the output layer's TP group: its
    ranks must take the same path, whose collectives differ); None off a GPU."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        least = torch.tensor([free], dtype=torch.int64, device=device)
        dist.all_reduce(least, op=dist.ReduceOp.MIN, group=group)
        free = int(least.item())
    return free


def loss_positions(mask: Tensor) -> Tensor:
    """[b, S] bool -> flat indices [n] (row-major into b x S) of the loss positions; one
    position (0, whose mask is False) when there is none, so every pass has a non-empty
    output and the same code path."""
    flat = mask.reshape(-1).nonzero().squeeze(1)
    return flat if flat.numel() else torch.zeros(1, dtype=torch.long, device=mask.device)


class OutputPositions:
    """Restricts a GPTModel stage's output layer to chosen positions while `at` is active, and
    with `fused` takes its input (and weight) for the fused output layer instead."""

    def __init__(self, output_layer: torch.nn.Module, gpt: torch.nn.Module | None = None):
        self.sequence_parallel = bool(getattr(output_layer, "sequence_parallel", False))
        """The output layer's input is split over the TP ranks along the sequence."""
        self.flat: Tensor | None = None
        """[n] flat indices into [b, S] while active; None: every position."""
        self.width = 0
        """S of the active micro-batch."""
        self.fused = False
        """Keep the selected hidden states for the fused output layer (output layer skipped)."""
        self.layer = output_layer
        """megatron's output layer (its weight, or the tied embedding's, sizes the logits)."""
        self.gpt = gpt
        """The GPTModel stage holding it (None in unit tests)."""
        self.hidden: Tensor | None = None
        """[n, h] the hidden states at the selected positions, after a fused forward."""
        self.weight: Tensor | None = None
        """[V_local, h] the weight the output layer would have used (tied: the embedding's)."""
        self.blocker = fused_blocker(output_layer, gpt)
        """Why the fused output layer cannot replace this output layer (None: it can)."""
        output_layer.register_forward_pre_hook(self._select, with_kwargs=True)
        if self.sequence_parallel:
            output_layer.register_forward_hook(self._restore)

    @classmethod
    def of(cls, gpt: torch.nn.Module) -> "OutputPositions | None":
        """The (lazily installed) selector of a GPTModel stage; None off the last stage."""
        layer = getattr(gpt, "output_layer", None) if getattr(gpt, "post_process", False) \
            else None
        if layer is None:
            return None
        if not hasattr(gpt, "_megagrpo_positions"):
            gpt._megagrpo_positions = cls(layer, gpt)
        return gpt._megagrpo_positions

    def use_fused(self, setting: bool | str, rows: int = 0) -> bool:
        """compute.fused_output_layer (True / False / "auto") for this stage and a micro-batch of
        ``rows`` output positions: "auto" runs the fused layer unless `blocker` says why not or,
        on a GPU, the logits fit (`auto_output_path`); True where it cannot run is an error.
        Says once per process each path its output layer takes, and why."""
        if setting is True and self.blocker:
            raise ValueError(f"compute.fused_output_layer=true, but the fused output layer "
                             f"cannot run here: {self.blocker}; set "
                             "compute.fused_output_layer=auto or false")
        if setting == "auto" and self.blocker is None:
            w = self.output_weight()
            fused, why = auto_output_path(rows, w.shape[0], w.element_size(), free_gpu_bytes(
                w.device, getattr(self.layer, "tp_group", None)))
        else:
            fused = setting is True
            why = ("fused with the loss: hidden states -> loss, no [tokens, vocab] logits"
                   if fused else f"logits path ({self.blocker})" if setting == "auto"
                   else "logits path (compute.fused_output_layer=false)")
        key = why.split(" (")[0] + ("" if "auto on GPU" not in why else " auto")
        if key not in _SAID:  # once per process: the policy and the reference say the same
            _SAID.add(key)
            log.info("output layer: %s", why)
        return fused

    def output_weight(self) -> Tensor:
        """[V_local, h] the weight this stage's output layer multiplies by (tied: the
        embedding's on the first stage, where megatron's layer holds none)."""
        w = getattr(self.layer, "weight", None)
        if w is None and self.gpt is not None:
            w = self.gpt.shared_embedding_or_output_weight()
        return w

    def _select(self, module, args: tuple, kwargs: dict):
        if self.flat is None and not self.fused:
            return None
        hidden = args[0]  # [S, b, h]
        if self.sequence_parallel:  # [S_pad/tp, b, h] -> [S, b, h] (module doc)
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=False, group=module.tp_group)[:self.width]
            module.sequence_parallel = False  # this call's input is whole: no second gather
        if self.flat is None:  # every position, row-major over [b, S] like `take`
            picked = hidden.transpose(0, 1).reshape(-1, hidden.shape[-1])
        else:
            rows, cols = self.flat // self.width, self.flat % self.width
            picked = hidden[cols, rows]
        if not self.fused:
            return (picked.unsqueeze(1), *args[1:]), kwargs
        weight = kwargs.get("weight")
        self.hidden, self.weight = picked, module.weight if weight is None else weight
        # zero rows: megatron's matmul and logits vanish, the call itself stays megatron's
        return (picked[:0].unsqueeze(1), *args[1:]), kwargs

    def _restore(self, module, args, output) -> None:
        module.sequence_parallel = True

    @contextmanager
    def at(self, flat: Tensor | None, width: int, fused: bool = False) -> Iterator[None]:
        """Within the block, the output layer computes only positions `flat` of [b, width]
        (None: all); with `fused`, `take_hidden` returns their hidden states instead."""
        self.flat, self.width, self.fused = flat, width, fused
        try:
            yield
        finally:
            self.flat, self.fused = None, False

    def take_hidden(self) -> tuple[Tensor, Tensor]:
        """([n, h] hidden states, [V_local, h] output weight) of the last fused forward."""
        hidden, weight = self.hidden, self.weight
        self.hidden = self.weight = None
        if hidden is None:
            raise RuntimeError("fused output layer: the model's forward never reached its "
                               "output layer")
        return hidden, weight


def fused_blocker(output_layer: torch.nn.Module, gpt: torch.nn.Module | None) -> str | None:
    """What keeps the fused output layer from replacing `output_layer` (None: nothing)."""
    if getattr(output_layer, "bias", None) is not None:
        return "the output layer has a bias"
    if gpt is not None and getattr(getattr(gpt, "config", None), "mtp_num_layers", None):
        return "multi-token prediction runs the output layer on its own hidden states"
    return None


class RotaryPositions:
    """Rotary embeddings at chosen per-token positions while `at` is active.

    megatron's GPTModel builds its RoPE table for positions 0..S-1 of the sequence it is given
    and its layers apply row t to token t. A packed micro-batch
    (`megagrpo.parallel.batch.PackedRows`) is one sequence of T tokens whose positions restart on
    every row, so a forward hook on the model's `rotary_pos_emb` module gathers the table's rows at
    those positions ([S, 1, 1, d] -> [T, 1, 1, d]); the layers' ordinary (bshd) RoPE then rotates
    each token by its own position. (megatron's `thd` RoPE does the same per sequence, with a Python
    loop over sequences that cost a third of a packed forward at ~100 sequences per micro-batch.)"""

    def __init__(self, rotary: torch.nn.Module):
        self.positions: Tensor | None = None
        rotary.register_forward_hook(self._gather)

    @classmethod
    def of(cls, gpt: torch.nn.Module) -> "RotaryPositions | None":
        """The (lazily installed) hook of a GPTModel stage; None without rotary embeddings."""
        rotary = getattr(gpt, "rotary_pos_emb", None)
        if rotary is None:
            return None
        if not hasattr(gpt, "_megagrpo_rotary"):
            gpt._megagrpo_rotary = cls(rotary)
        return gpt._megagrpo_rotary

    def _gather(self, module, args, out):
        if self.positions is None:
            return None
        if out.shape[0] <= int(self.positions.max()):
            raise RuntimeError(f"RoPE table of {out.shape[0]} positions for position "
                               f"{int(self.positions.max())}")
        return out[self.positions]

    @contextmanager
    def at(self, positions: Tensor) -> Iterator[None]:
        """Within the block, token t gets the rotary embedding of position positions[t]."""
        self.positions = positions
        try:
            yield
        finally:
            self.positions = None


def take(t: Tensor | None, flat: Tensor | None) -> Tensor | None:
    """[b, S] per-token tensor -> [n] at the selected positions (all b*S when flat is None)."""
    if t is None:
        return None
    t = t.reshape(-1)
    return t if flat is None else t[flat]


def put(values: Tensor, flat: Tensor | None, shape: tuple[int, int]) -> Tensor:
    """[n] values at the selected positions -> [b, S] (0 elsewhere)."""
    if flat is None:
        return values.view(shape)
    out = values.new_zeros(shape[0] * shape[1])
    out[flat] = values
    return out.view(shape)
