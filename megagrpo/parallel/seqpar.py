"""Sequence parallelism on megagrpo's forward path (parallel.sequence_parallel).

megatron-core's GPTModel scatters the embedding output along the sequence over the TP ranks and
its layers work on [S/tp, b, h]; the sequence must divide by tp. megagrpo's micro-batches are
trimmed to their longest row, so `padded_inputs` pads the token ids on the right (causal
attention: no real position reads a padding one, so no result changes) and the output layer's
hook (`megagrpo.parallel.positions.OutputPositions`) gathers the hidden states and drops the padding
before the vocab pass. A packed micro-batch (`megagrpo.parallel.batch.PackedRows`, one sequence of T
tokens) is padded the same way (`packed_inputs`): the padding tokens belong to no row, so the
packed attention leaves them out (`megagrpo.parallel.attention.SdpaAttention._packed`), no loss
position addresses them, and megatron's router is told to leave them out of the load-balancing and
z-losses (GPTModel's `padding_mask`). A MoE router sees this rank's slice of the [S, b] tokens
(routing replay, which would hand it that slice of vLLM's routes, is refused under SP for now).
"""
from __future__ import annotations

import torch
from torch import Tensor


def sp_size(gpt: torch.nn.Module) -> int:
    """The number of sequence slices of `gpt`'s layers: tp under sequence parallelism, else 1."""
    config = getattr(gpt, "config", None)
    if config is None or not getattr(config, "sequence_parallel", False):
        return 1
    return int(config.tensor_model_parallel_size)


def padded_width(width: int, sp: int) -> int:
    """`width` rounded up to a multiple of `sp`."""
    return -(-width // sp) * sp


def padded_inputs(ids: Tensor, sp: int) -> tuple[Tensor, Tensor]:
    """[b, S] token ids -> ([b, S_pad] ids, [b, S_pad] positions), S_pad a multiple of `sp`
    (padding: token 0, positions continuing)."""
    b, width = ids.shape
    pad = padded_width(width, sp) - width
    if pad:
        ids = torch.cat([ids, ids.new_zeros(b, pad)], dim=1)
    return ids, torch.arange(ids.shape[1], device=ids.device).expand_as(ids)


def packed_inputs(ids: Tensor, positions: Tensor, sp: int
                  ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """A packed micro-batch's [1, T] ids and positions -> ([1, T_pad] ids, [1, T_pad]
    positions, GPTModel keyword arguments), T_pad a multiple of `sp`. The padding (token 0 at
    position 0) follows the last row and belongs to none; the keywords carry megatron's
    `padding_mask` ([1, T_pad] bool, True on the padding), which keeps it out of the MoE
    routers' auxiliary losses (empty when there is no padding)."""
    T = ids.shape[1]
    pad = padded_width(T, sp) - T
    if not pad:
        return ids, positions, {}
    ids = torch.cat([ids, ids.new_zeros(1, pad)], dim=1)
    positions = torch.cat([positions, positions.new_zeros(1, pad)], dim=1)
    mask = torch.arange(T + pad, device=ids.device)[None] >= T
    return ids, positions, {"padding_mask": mask}


class SequenceParallelNorm:
    """torch's RMSNorm in the norm slots of megatron-core's local spec under sequence
    parallelism. megatron's `WrappedTorchNorm` refuses sequence parallelism: each TP rank's
    norm weight then sees only its slice of the tokens, so its gradient must be summed over
    TP, which `finalize_model_grads` does for parameters flagged `sequence_parallel` (TE's and
    Apex's norms set the flag; torch's does not). This sets it."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        setattr(norm.weight, "sequence_parallel", bool(config.sequence_parallel))
        return norm


def sequence_parallel_norms(layers: list, block=None) -> None:
    """Puts `SequenceParallelNorm` in every norm slot of the local-spec `layers` (ModuleSpecs
    of TransformerLayer) and in `block`'s final norm (TransformerBlockSubmodules)."""
    from megatron.core.transformer.identity_op import IdentityOp

    for spec in layers:
        sub = spec.submodules
        sub.input_layernorm = SequenceParallelNorm
        sub.pre_mlp_layernorm = SequenceParallelNorm
        attn = sub.self_attention.submodules
        for slot in ("q_layernorm", "k_layernorm"):
            if getattr(attn, slot, IdentityOp) is not IdentityOp:
                setattr(attn, slot, SequenceParallelNorm)
    if block is not None:
        block.layer_norm = SequenceParallelNorm
