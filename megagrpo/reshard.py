"""Sharded policy -> stream of (HF name, full tensor) pairs, moved in buckets of bounded bytes.

One code path for the vLLM weight update and the HF export. For each pipeline stage s and each
bucket of s's parameters (at most `bucket_bytes` of full tensors, or one tensor if larger):
  1. the TP ranks of stage s all-gather their shards of the bucket into one buffer (one
     collective; the buffer keeps the gathered rank-major layout),
  2. stage s broadcasts that buffer to the other stages (one collective on the PP group),
  3. every rank builds the bucket's HF tensors one parameter at a time straight from the shards
     in the buffer (QKV split per group, gate/up split, vocab padding stripped) and yields them.
Every rank of a TP x PP model-parallel group receives every tensor. Peak extra memory per rank:
one bucket buffer plus the HF tensors of one parameter; never the whole model.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from megagrpo.config.model import ModelConfig, ParallelConfig
from megagrpo.hf import ParamSpec, param_specs, unfuse_shards
from megagrpo.model import DTYPE, unwrap


@dataclass
class ReshardStats:
    """Filled while the generator runs."""

    bytes: int = 0
    tensors: int = 0
    gather_s: float = 0.0
    convert_s: float = 0.0
    buckets: int = 0
    peak_buffer_bytes: int = 0


def _buckets(specs: list[ParamSpec], bucket_bytes: int, esize: int) -> list[list[ParamSpec]]:
    out, cur, size = [], [], 0
    for s in specs:
        n = esize * _numel(s.full_shape)
        if cur and size + n > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(s)
        size += n
    if cur:
        out.append(cur)
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _exported(specs: list[ParamSpec], model: ModelConfig) -> list[ParamSpec]:
    # the last stage's copy of a tied embedding is not exported (stage 0 exports it)
    tied = model.tie_word_embeddings
    return [s for s in specs if not (tied and s.local == "output_layer.weight")]


def _shards(buf: torch.Tensor, spec: ParamSpec, offset: int, n_local: int, tp: int
            ) -> list[torch.Tensor]:
    """Views of `spec`'s TP shards in the gathered buffer [tp * n_local] (rank-major: rank r's
    shards of the bucket, concatenated, at [r * n_local, (r + 1) * n_local))."""
    shape = spec.local_shape(tp)
    n = _numel(shape)
    shards = [buf[r * n_local + offset: r * n_local + offset + n].view(shape) for r in range(tp)]
    return shards[:1] if spec.split_dim is None else shards


def _gather_in_place(buf: torch.Tensor, n_local: int, tp: int, tp_group) -> None:
    """All-gather over TP where each rank's part already sits in its slice of `buf`. NCCL
    gathers in place with one collective; gloo's all_gather stages the whole output in a
    second buffer, so there each rank broadcasts its slice instead (tp collectives, no copy)."""
    if dist.get_backend(tp_group) != "gloo":
        r = dist.get_rank(tp_group)
        dist.all_gather_into_tensor(buf, buf[r * n_local:(r + 1) * n_local], group=tp_group)
        return
    for r in range(tp):
        dist.broadcast(buf[r * n_local:(r + 1) * n_local], src=dist.get_global_rank(tp_group, r),
                       group=tp_group)


def _fill_bucket(buf, bucket, params, my_stage, stage, tp, tp_group, pp_group) -> int:
    """Gathers this bucket into the front of `buf` on every rank of the model-parallel group:
    the owning stage copies its shards into its own slice and gathers in place; the stage then
    broadcasts. Returns the per-rank element count of the bucket."""
    n_local = sum(_numel(s.local_shape(tp)) for s in bucket)
    if stage == my_stage:
        r = dist.get_rank(tp_group) if tp > 1 else 0
        mine = buf[r * n_local:(r + 1) * n_local]
        off = 0
        for s in bucket:
            p = params[s.local].detach().reshape(-1)
            mine[off:off + p.numel()].copy_(p)
            off += p.numel()
        if tp > 1:
            _gather_in_place(buf, n_local, tp, tp_group)
    if dist.get_world_size(pp_group) > 1:
        dist.broadcast(buf[: tp * n_local], src=dist.get_global_rank(pp_group, stage),
                       group=pp_group)
    return n_local


def iter_hf_weights(
    gpt: torch.nn.Module,
    model: ModelConfig,
    parallel: ParallelConfig,
    *,
    bucket_bytes: int = 256 << 20,
    stats: ReshardStats | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (hf_name, full tensor) for the policy of this rank's model-parallel group.
    Collective over the TP and PP groups: every rank must drive the generator to the end.
    Tensors may be views of live parameters or of the bucket buffer: copy them if kept, never
    write to them."""
    from megatron.core import parallel_state as ps

    stats = stats if stats is not None else ReshardStats()
    gpt = unwrap(gpt)
    params = dict(gpt.named_parameters())
    impl = "transformer_engine" if any("layer_norm_weight" in n for n in params) else "local"
    tp, pp = parallel.tp, parallel.pp
    tp_group = ps.get_tensor_model_parallel_group()
    pp_group = ps.get_pipeline_model_parallel_group()
    my_stage = ps.get_pipeline_model_parallel_rank()
    dtype = DTYPE[model.dtype]
    esize = torch.empty((), dtype=dtype).element_size()
    device = next(iter(params.values())).device
    plan = [(stage, bucket) for stage in range(pp)
            for bucket in _buckets(_exported(param_specs(model, parallel, stage, impl), model),
                                   bucket_bytes, esize)]
    moving = tp > 1 or pp > 1
    # one receive buffer for the whole stream, reused bucket after bucket: a fresh one per
    # bucket would briefly coexist with the last (gloo frees a finished collective's tensors
    # on its own thread)
    size = max(tp * sum(_numel(s.local_shape(tp)) for s in b) for _, b in plan) if moving else 0
    buf = torch.empty(size, dtype=dtype, device=device)
    stats.peak_buffer_bytes = size * esize
    for stage, bucket in plan:
        t0 = time.perf_counter()
        n_local = _fill_bucket(buf, bucket, params, my_stage, stage, tp, tp_group,
                               pp_group) if moving else 0
        stats.gather_s += time.perf_counter() - t0
        stats.buckets += 1
        offset = 0
        for spec in bucket:
            t1 = time.perf_counter()
            shards = (_shards(buf, spec, offset, n_local, tp) if moving
                      else [params[spec.local].detach()])
            offset += _numel(spec.local_shape(tp))
            # views into the reused buffer are copied: the consumer may keep what it got
            pairs = [(n, t.clone() if moving and _shares(t, buf) else t)
                     for n, t in unfuse_shards(shards, spec, model)]
            del shards
            stats.convert_s += time.perf_counter() - t1
            while pairs:  # pop, so this frame holds no tensor the consumer has dropped
                name, tensor = pairs.pop(0)
                stats.bytes += tensor.numel() * tensor.element_size()
                stats.tensors += 1
                yield name, tensor
                del tensor


def _shares(t: torch.Tensor, buf: torch.Tensor) -> bool:
    return t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()


def export_hf(gpt: torch.nn.Module, out_dir: str, model: ModelConfig, parallel: ParallelConfig,
              *, bucket_bytes: int = 256 << 20) -> None:
    """Writes the sharded policy as an HF checkpoint directory (global rank 0 writes; every rank
    of the model-parallel group must call this)."""
    from megagrpo.hf import save_hf_dir

    write = dist.get_rank() == 0 if dist.is_initialized() else True
    save_hf_dir(out_dir, model, iter_hf_weights(gpt, model, parallel, bucket_bytes=bucket_bytes),
                write=write)
