"""Sharded policy -> stream of (HF name, full tensor) buckets of bounded bytes.

One code path for the vLLM weight update and the HF export. For each pipeline stage s and each
bucket of s's parameters (at most `bucket_bytes` of full tensors, or one tensor if larger):
  1. the TP ranks of stage s all-gather their shards of the bucket (one flat collective),
  2. stage s broadcasts the gathered bucket to the other stages (one collective on the PP group),
  3. every rank undoes the fusions (QKV per group, gate/up), strips vocab padding, renames.
Every rank of a TP x PP model-parallel group receives every tensor, one bucket at a time; no
rank ever holds more than one bucket of full tensors (plus its own shards).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist

from megagrpo.config.model import ModelConfig, ParallelConfig
from megagrpo.hf import ParamSpec, full_to_hf, param_specs
from megagrpo.model import DTYPE, unwrap


@dataclass
class ReshardStats:
    """Filled while the generator runs."""

    bytes: int = 0
    tensors: int = 0
    gather_s: float = 0.0
    convert_s: float = 0.0
    peak_bucket_bytes: int = 0
    buckets: int = 0
    extra: dict = field(default_factory=dict)


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


def _gather_tp(local: list[torch.Tensor], specs: list[ParamSpec], tp: int, group
               ) -> list[torch.Tensor]:
    """All-gathers the TP shards of one bucket with one collective; returns full tensors."""
    flat = torch.cat([t.reshape(-1) for t in local])
    if tp == 1:
        parts = [flat]
    else:
        parts = [torch.empty_like(flat) for _ in range(tp)]
        dist.all_gather(parts, flat, group=group)
    fulls, off = [], 0
    for s in specs:
        shape = s.local_shape(tp)
        n = _numel(shape)
        shards = [p[off:off + n].view(shape) for p in parts]
        if tp == 1 or s.split_dim is None:
            fulls.append(shards[0])
        elif s.kind == "gate_up":  # rank r holds cat(gate_r, up_r); full is cat(gate, up)
            halves = [sh.chunk(2, dim=0) for sh in shards]
            fulls.append(torch.cat([h[0] for h in halves] + [h[1] for h in halves]))
        else:
            fulls.append(torch.cat(shards, dim=s.split_dim))
        off += n
    return fulls


def iter_hf_weights(
    gpt: torch.nn.Module,
    model: ModelConfig,
    parallel: ParallelConfig,
    *,
    bucket_bytes: int = 256 << 20,
    stats: ReshardStats | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yields buckets [(hf_name, full tensor), ...] of this rank's model-parallel group's
    policy. Collective over the TP and PP groups: every rank must drive the generator to the
    end. Tensors in a bucket are views (of the live parameters at TP=PP=1, else of a receive
    buffer): copy them if kept, never write to them."""
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
    for stage in range(pp):
        specs = _exported(param_specs(model, parallel, stage, impl), model)
        for bucket in _buckets(specs, bucket_bytes, esize):
            t0 = time.perf_counter()
            if stage == my_stage and tp == 1 and pp == 1:  # nothing to move: no copy either
                fulls = [params[s.local].detach() for s in bucket]
            elif stage == my_stage:
                fulls = _gather_tp([params[s.local].detach() for s in bucket], bucket, tp, tp_group)
                flat = torch.cat([f.reshape(-1) for f in fulls]) if pp > 1 else None
            else:
                flat = torch.empty(sum(_numel(s.full_shape) for s in bucket), dtype=dtype,
                                   device=device)
            if pp > 1:
                src = dist.get_global_rank(pp_group, stage)
                dist.broadcast(flat, src=src, group=pp_group)
                fulls, off = [], 0
                for s in bucket:
                    n = _numel(s.full_shape)
                    fulls.append(flat[off:off + n].view(s.full_shape))
                    off += n
            t1 = time.perf_counter()
            out = [pair for s, f in zip(bucket, fulls) for pair in full_to_hf(s, f, model)]
            t2 = time.perf_counter()
            nbytes = sum(t.numel() * t.element_size() for _, t in out)
            stats.gather_s += t1 - t0
            stats.convert_s += t2 - t1
            stats.bytes += nbytes
            stats.tensors += len(out)
            stats.buckets += 1
            stats.peak_bucket_bytes = max(stats.peak_bucket_bytes, nbytes)
            yield out


def export_hf(gpt: torch.nn.Module, out_dir: str, model: ModelConfig, parallel: ParallelConfig,
              *, bucket_bytes: int = 256 << 20) -> None:
    """Writes the sharded policy as an HF checkpoint directory (global rank 0 writes; every rank
    of the model-parallel group must call this)."""
    from megagrpo.hf import save_hf_dir

    write = dist.get_rank() == 0 if dist.is_initialized() else True
    save_hf_dir(out_dir, model, iter_hf_weights(gpt, model, parallel, bucket_bytes=bucket_bytes),
                write=write)
