"""Causal core attention through `torch.nn.functional.scaled_dot_product_attention` for
megatron-core's local (no Transformer Engine) layer spec.

megatron's local `DotProductAttention` repeats the KV heads for GQA, materialises the
[b, heads, sq, sk] scores (baddbmm), runs a masked softmax and a bmm. torch's SDPA has fused
kernels on CPU (flash-style, fp32 and bf16, causal) that never hold the full score matrix and
take GQA directly (`enable_gqa`). `SdpaAttention` is a drop-in for the spec's
`core_attention` slot: same constructor, same forward signature, same result. `build_model`
chooses it through `parallel.attention_impl` (see `attention_impl_name`).

Two deliberate departures from megatron's module, neither of which changes results:
- No RNG-tracker fork. megatron forks the model-parallel RNG around its (p=0) dropout; a p=0
  dropout draws no random numbers and the fork restores the state it saved, so the streams are
  identical either way (tests/test_attention.py checks the RNG state after a step).
- Padding beyond a row's length needs no mask: attention is causal and megagrpo right-pads, so a
  padded position is never attended to by an earlier (real) one.

Packed micro-batches (`megagrpo.parallel.batch.PackedRows`, rows laid end to end and handed over as
`packed_seq_params`) are computed too: the rows are gathered into a padded grid for one SDPA
call, so only attention, not the dense layers, sees padding.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor


def _tp_size(pg_collection) -> int:
    """This module's tensor-parallel size (megatron's global TP group when none is given)."""
    if pg_collection is not None and getattr(pg_collection, "tp", None) is not None:
        return pg_collection.tp.size()
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_world_size()


def _cp_group(config: TransformerConfig, pg_collection):
    """The context-parallel group when config.context_parallel_size > 1 (megatron's global
    one when no collection is given), else None."""
    if config.context_parallel_size == 1:
        return None
    if pg_collection is not None and getattr(pg_collection, "cp", None) is not None:
        return pg_collection.cp
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_group()


def _check_supported(config: TransformerConfig, attn_mask_type: AttnMaskType,
                     attention_dropout: float | None) -> None:
    """Raises for configurations `SdpaAttention` does not implement (megatron's module does)."""
    dropout = config.attention_dropout if attention_dropout is None else attention_dropout
    if dropout > 0:
        raise ValueError(f"attention_dropout={dropout}: SdpaAttention has no dropout (megagrpo "
                         "trains with 0); set parallel.attention_impl='megatron' to use it")
    if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask, AttnMaskType.padding):
        raise ValueError(f"attn_mask_type={attn_mask_type}: SdpaAttention supports causal, "
                         "padding and no_mask; set parallel.attention_impl='megatron'")
    if getattr(config, "window_size", None) is not None:
        raise ValueError(f"window_size={config.window_size}: sliding-window attention is not "
                         "implemented by SdpaAttention; set parallel.attention_impl='megatron'")
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        raise ValueError(f"softmax_type={config.softmax_type!r}: SdpaAttention implements the "
                         "vanilla softmax only; set parallel.attention_impl='megatron'")


class SdpaAttention(MegatronModule):
    """megatron `DotProductAttention`'s interface, computed with torch's fused SDPA.

    Softmax scale as megatron's: `softmax_scale` or 1/sqrt(head_dim). megatron's
    `apply_query_key_layer_scaling` divides the scores by the layer number and multiplies them
    back inside its softmax (an fp16 range trick); the product is the same scale, so it is not
    repeated here (SDPA accumulates in fp32).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        _check_supported(config, attn_mask_type, attention_dropout)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        tp = _tp_size(pg_collection)
        if config.num_attention_heads % tp or config.num_query_groups % tp:
            raise ValueError(f"tensor-parallel size {tp} must divide num_attention_heads="
                             f"{config.num_attention_heads} and num_query_groups="
                             f"{config.num_query_groups}")
        self.num_heads = config.num_attention_heads // tp
        """Query heads on this TP rank (np)."""
        self.num_groups = config.num_query_groups // tp
        """KV heads on this TP rank (ng)."""
        self.head_dim = config.kv_channels
        self.softmax_scale = (1.0 / math.sqrt(self.head_dim) if softmax_scale is None
                              else softmax_scale)
        self.cp_group = _cp_group(config, pg_collection)
        """The context-parallel group (None at cp = 1): `megagrpo.parallel.context_parallel`."""

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params=None,
    ) -> Tensor:
        """query [sq, b, np, hn], key/value [sk, b, ng, hn] -> context [sq, b, np * hn].

        Masking follows megatron's softmax: `attention_mask` (bool, True = masked out,
        broadcastable to [b, np, sq, sk]) is used when given; otherwise a causal module (the
        type it was built with; megatron ignores the forward's `attn_mask_type` too) lets query
        i see keys 0..i, except for a single query, which sees every key. (megatron fills masked
        scores with -10000, SDPA with -inf: the same unless a row is masked entirely.)
        """
        if attention_bias is not None:
            raise ValueError("SdpaAttention takes no attention_bias (like megatron's "
                             "DotProductAttention); use Transformer Engine's")
        if self.cp_group is not None:
            return self._context_parallel(query, key, value, attention_mask, packed_seq_params)
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        sq, sk = query.shape[0], key.shape[0]
        causal = attention_mask is None and self.attn_mask_type == AttnMaskType.causal
        # a branch, not `and sq > 1`: under torch.compile with dynamic shapes the comparison is
        # symbolic and SDPA's is_causal takes a Python bool (compute.compile_layers)
        if sq == 1:
            causal = False
        if causal and sq != sk:
            raise ValueError(f"causal attention with {sq} queries and {sk} keys: megatron's "
                             "default causal mask is square; pass an explicit attention_mask")
        # [s, b, heads, hn] -> [b, heads, s, hn]: views; SDPA reads the strides.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        mask = None if attention_mask is None else ~attention_mask.to(torch.bool)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=causal,
            scale=self.softmax_scale, enable_gqa=self.num_heads != self.num_groups)
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return out.permute(2, 0, 1, 3).reshape(sq, query.shape[1], self.num_heads * self.head_dim)

    def _context_parallel(self, query: Tensor, key: Tensor, value: Tensor,
                          attention_mask: Tensor | None, packed_seq_params) -> Tensor:
        """This CP rank's 2 chunks of each row: query [s, b, np, hn], key/value [s, b, ng, hn]
        -> [s, b, np * hn], attending causally over the whole row
        (`megagrpo.parallel.context_parallel.cp_attention`); packed rows (b = 1, the rank's chunks
        of every row end to end: `ChunkRows`) each over its own row (`cp_packed_attention`)."""
        from megagrpo.parallel.context_parallel import ChunkRows, cp_attention, cp_packed_attention

        rows = getattr(packed_seq_params, "megagrpo_rows", None)
        if attention_mask is not None or (packed_seq_params is not None
                                          and not isinstance(rows, ChunkRows)):
            raise ValueError("context parallelism (parallel.cp > 1) runs causal rows, padded "
                             "or packed by megagrpo.parallel.context_parallel.ChunkSplit: no "
                             "attention_mask or other packed_seq_params")
        if rows is None:
            out = cp_attention(query, key, value, group=self.cp_group, scale=self.softmax_scale,
                               gqa=self.num_heads != self.num_groups)
        else:
            out = cp_packed_attention(query, key, value, rows, group=self.cp_group,
                                      scale=self.softmax_scale)
        # [b, np, s, hn] -> [s, b, np * hn]
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1],
                                               self.num_heads * self.head_dim)

    def _packed(self, query: Tensor, key: Tensor, value: Tensor, params) -> Tensor:
        """Rows laid end to end (`megagrpo.parallel.batch.PackedRows`): query [T', 1, np, hn] (one
        sequence, 'sbhd'), key/value [T', 1, ng, hn] -> [T', 1, np * hn], each row attending
        causally to itself only. The rows are placed in a zero-padded [b, max_len] grid for one
        batched SDPA call and gathered back; a row's padding sits after its real tokens, which
        a causal query never reads. T' >= T, the rows' tokens: sequence parallelism pads the
        stream to a multiple of tp (`megagrpo.parallel.seqpar.packed_inputs`); those last T' - T
        tokens belong to no row, attend to nothing and get 0."""
        rows = getattr(params, "megagrpo_rows", None)
        if rows is None or query.dim() != 4 or query.shape[1] != 1:
            raise ValueError("SdpaAttention's packed path takes "
                             "megagrpo.parallel.batch.PackedRows' seq_params() (one 'sbhd' "
                             "sequence); other packed formats need "
                             "Transformer Engine")
        T, extra = rows.unpad_index.numel(), query.shape[0] - rows.unpad_index.numel()
        query, key, value = (t[:T].squeeze(1) for t in (query, key, value))
        b, L = rows.grid

        def grid(t: Tensor) -> Tensor:  # [T, heads, hn] -> [b, heads, L, hn], zeros as padding
            g = t.new_zeros((b * L, *t.shape[1:])).index_copy(0, rows.unpad_index, t)
            return g.view(b, L, *t.shape[1:]).transpose(1, 2)

        # index_copy / index_select: their backwards are a gather and an index_add (advanced
        # indexing's backward is an accumulating index_put, several times slower on CPU)
        q, k, v = grid(query), grid(key), grid(value)
        causal = True
        if L == 1:  # a branch: under torch.compile `L > 1` may be symbolic (see forward)
            causal = False
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=0.0, is_causal=causal, scale=self.softmax_scale,
            enable_gqa=self.num_heads != self.num_groups)
        # [b, np, L, hn] -> [b * L, np * hn] -> the real tokens [T, np * hn]
        out = out.transpose(1, 2).reshape(b * L, self.num_heads * self.head_dim)
        out = out.index_select(0, rows.unpad_index)
        if extra:  # the sequence-parallel padding: no row, no context
            out = torch.cat([out, out.new_zeros(extra, out.shape[1])])
        return out.unsqueeze(1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        """No parameters, so nothing to checkpoint (megatron's module holds only an optional
        learnable softmax offset, which SdpaAttention refuses)."""
        return {}
