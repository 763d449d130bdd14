"""HF checkpoint files <-> megatron shards: the lazy safetensors reader, loading each rank's
slices (only the rows/columns its TP/PP/EP shard needs, safetensors' lazy slices), the header
check, writing a checkpoint directory, and the tensor conversions between HF tensors and fused
megatron shards. What is fused and split how (names, shapes, TP/EP/PP) is the layout in
`megagrpo.config.params` (the QKV interleave too: `qkv_rows`); this module only moves tensors in
it. Export goes through `megagrpo.sync.source`, the same generator that feeds vLLM.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Iterable, Iterator

import torch

from megagrpo.config.model import ModelConfig, ParallelConfig
from megagrpo.config.params import ParamSpec, hf_shapes, param_specs, qkv_rows
from megagrpo.hf.config import hf_config_dict
from megagrpo.model.gpt import unwrap


# ---------------------------------------------------------------- layout conversions
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, model: ModelConfig
             ) -> torch.Tensor:
    """HF q [g*nh/ng*hd, ...], k/v [g*hd, ...] of g KV groups (all of them, or one TP rank's)
    -> megatron's fused [g*(nh/ng+2)*hd, ...], interleaved per group as `qkv_rows` says."""
    rest = q.shape[1:]
    (q0, q1), (k0, k1), (v0, v1) = qkv_rows(model)
    groups = k.shape[0] // (k1 - k0)
    out = q.new_empty(groups, v1, *rest)
    for t, lo, hi in ((q, q0, q1), (k, k0, k1), (v, v0, v1)):
        out[:, lo:hi] = t.reshape(groups, hi - lo, *rest)
    return out.reshape(-1, *rest)


def split_qkv(fused: torch.Tensor, model: ModelConfig) -> list[torch.Tensor]:
    """Megatron's fused QKV rows [g*(nh/ng+2)*hd, ...] (all groups, or one TP rank's) -> views
    [g, rows, ...] of its q, k and v parts, per group (`qkv_rows`); `.reshape(-1, ...)` of one
    is HF's tensor (of those groups)."""
    rest = fused.shape[1:]
    rows = qkv_rows(model)
    grouped = fused.view(-1, rows[-1][1], *rest)
    return [grouped[:, lo:hi] for lo, hi in rows]


def unfuse_shards(shards: list[torch.Tensor], spec: ParamSpec, model: ModelConfig
                  ) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors of `spec` from its TP shards (rank order): QKV split per group, gate/up
    split, vocab padding stripped. Each HF tensor is built with one copy straight from the
    shards (at TP=1 views where possible), so no full fused tensor is ever materialised."""
    if spec.kind == "replicated":
        return [(spec.hf[0], shards[0])]
    if spec.kind == "row":
        return [(spec.hf[0], _cat(shards, 1))]
    if spec.kind == "vocab":
        rows, parts = shards[0].shape[0], []
        for r, sh in enumerate(shards):
            if r * rows < model.vocab_size:
                parts.append(sh[: model.vocab_size - r * rows])
        return [(spec.hf[0], _cat(parts, 0))]
    if spec.kind == "gate_up":  # rank r holds cat(gate_r, up_r)
        half = shards[0].shape[0] // 2
        return [(spec.hf[0], _cat([s[:half] for s in shards], 0)),
                (spec.hf[1], _cat([s[half:] for s in shards], 0))]
    rest = shards[0].shape[1:]
    parts = [split_qkv(s, model) for s in shards]  # per rank: q, k, v [groups_r, rows, ...]
    out = []
    for i, name in enumerate(spec.hf):
        part = torch.cat([p[i] for p in parts]) if len(parts) > 1 else parts[0][i].contiguous()
        out.append((name, part.view(-1, *rest)))
    return out


def slice_pairs(shard: torch.Tensor, spec: ParamSpec, model: ModelConfig, tp_rank: int,
                 stats=None) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's TP shard of `spec` -> its HF tensors, one at a time, each full-shape with only
    this rank's slice written (the rest is left uninitialised: vLLM's weight loaders narrow each
    tensor to exactly this TP rank's rows/columns, which for q/k/v, gate/up, o_proj and
    down_proj are the megatron shard's). Each slice is copied once, straight from the shard.
    `stats`: anything with a `convert_s` counter (the weight stream's `ReshardStats`). The
    colocated shard-to-shard stream (`megagrpo.sync.source.iter_vllm_slices`) and a rollout
    rank of a TP > 1 engine under separate placement (`megagrpo.engine.shard_feed`) both build
    their slices here."""
    shapes = hf_shapes(model)
    # (HF name, this rank's part of it, split dim, rows/columns of the slice along that dim)
    if spec.kind == "row":
        parts = [(spec.hf[0], shard, 1, shard.shape[1])]
    elif spec.kind == "gate_up":  # the shard is cat(gate_r, up_r)
        half = shard.shape[0] // 2
        parts = [(spec.hf[0], shard[:half], 0, half), (spec.hf[1], shard[half:], 0, half)]
    else:  # qkv: [groups_r, q + k + v rows, ...] per KV group
        parts = [(name, part, 0, part.shape[0] * part.shape[1])
                 for name, part in zip(spec.hf, split_qkv(shard, model))]
    for name, part, dim, n in parts:
        t0 = time.perf_counter()
        full = torch.empty(shapes[name], dtype=shard.dtype, device=shard.device)
        full.narrow(dim, tp_rank * n, n).view(part.shape).copy_(part)
        if stats is not None:
            stats.convert_s += time.perf_counter() - t0
        yield name, full
        del full


def _cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


class HFCheckpoint:
    """Lazy reader of a local HF safetensors checkpoint (single file or sharded with index)."""

    def __init__(self, hf_dir: str | os.PathLike):
        from safetensors import safe_open

        self.dir = Path(hf_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            self.files = json.loads(index.read_text())["weight_map"]
        elif (self.dir / "model.safetensors").exists():
            with safe_open(self.dir / "model.safetensors", "pt") as f:
                self.files = {k: "model.safetensors" for k in f.keys()}
        else:
            raise FileNotFoundError(
                f"{self.dir}: no model.safetensors or model.safetensors.index.json")
        self._open = safe_open
        self._handles: dict[str, object] = {}

    def _handle(self, name: str, needed_by: str):
        if name not in self.files:
            raise ValueError(
                f"checkpoint {self.dir} lacks tensor {name!r} (needed for {needed_by})")
        fname = self.files[name]
        if fname not in self._handles:
            self._handles[fname] = self._open(self.dir / fname, "pt")
        return self._handles[fname]

    def shape(self, name: str, needed_by: str) -> tuple[int, ...]:
        return tuple(self._handle(name, needed_by).get_slice(name).get_shape())

    def rows(self, name: str, start: int, stop: int, needed_by: str) -> torch.Tensor:
        """Rows [start, stop) of dim 0, read without loading the rest."""
        return self._handle(name, needed_by).get_slice(name)[start:stop]

    def cols(self, name: str, start: int, stop: int, needed_by: str) -> torch.Tensor:
        return self._handle(name, needed_by).get_slice(name)[:, start:stop]


def check_hf_checkpoint(hf_dir: str | os.PathLike, model: ModelConfig) -> None:
    """Every tensor the model needs is present with the right shape (reads headers only)."""
    ckpt = HFCheckpoint(hf_dir)
    expected = hf_shapes(model)
    missing = sorted(n for n in expected if n not in ckpt.files)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint {ckpt.dir} lacks tensors {missing[:5]}{more}")
    for name, shape in expected.items():
        got = ckpt.shape(name, name)
        if got != shape:
            raise ValueError(f"checkpoint {ckpt.dir}: tensor {name!r} has shape {list(got)}, "
                             f"expected {list(shape)} for this config")


def read_shard(ckpt: HFCheckpoint, spec: ParamSpec, model: ModelConfig, tp_rank: int, tp: int,
               expected: dict[str, tuple[int, ...]]) -> torch.Tensor:
    """The TP shard `tp_rank` of `spec`, built from only the HF rows/columns it needs."""
    for name in spec.hf:
        got = ckpt.shape(name, spec.local)
        if got != expected[name]:
            raise ValueError(f"checkpoint {ckpt.dir}: tensor {name!r} has shape {list(got)}, "
                             f"expected {list(expected[name])} for this config")
    if spec.kind == "replicated":
        return ckpt.rows(spec.hf[0], 0, spec.full_shape[0], spec.local)
    if spec.kind == "row":
        n = spec.full_shape[1] // tp
        return ckpt.cols(spec.hf[0], tp_rank * n, (tp_rank + 1) * n, spec.local)
    if spec.kind == "gate_up":
        n = spec.full_shape[0] // 2 // tp
        return torch.cat([ckpt.rows(h, tp_rank * n, (tp_rank + 1) * n, spec.local)
                          for h in spec.hf])
    if spec.kind == "qkv":
        ng, hd = model.num_query_groups // tp, model.head_dim
        qn = model.num_attention_heads // model.num_query_groups * hd * ng
        q = ckpt.rows(spec.hf[0], tp_rank * qn, (tp_rank + 1) * qn, spec.local)
        k = ckpt.rows(spec.hf[1], tp_rank * ng * hd, (tp_rank + 1) * ng * hd, spec.local)
        v = ckpt.rows(spec.hf[2], tp_rank * ng * hd, (tp_rank + 1) * ng * hd, spec.local)
        return fuse_qkv(q, k, v, model)
    # vocab: rows of this rank's padded slice that exist in HF, zero padding after
    n = spec.full_shape[0] // tp
    lo, hi = tp_rank * n, min((tp_rank + 1) * n, model.vocab_size)
    shard = torch.zeros(n, *spec.full_shape[1:], dtype=_dtype_of(ckpt, spec))
    if hi > lo:
        shard[: hi - lo] = ckpt.rows(spec.hf[0], lo, hi, spec.local)
    return shard


def _dtype_of(ckpt: HFCheckpoint, spec: ParamSpec) -> torch.dtype:
    return ckpt.rows(spec.hf[0], 0, 1, spec.local).dtype


def load_hf_weights(gpt: torch.nn.Module, hf_dir: str | os.PathLike, model: ModelConfig,
                    parallel: ParallelConfig, *, tp_rank: int, pp_rank: int,
                    ep_rank: int | None = None) -> int:
    """Copies this rank's shards of an HF checkpoint into `gpt` (a GPTModel stage) in place
    (routed experts: those of expert-parallel rank `ep_rank`, default megatron's).
    Every tensor is checked (present, right shape) before any parameter is written.
    Returns the number of bytes read."""
    gpt = unwrap(gpt)
    params = dict(gpt.named_parameters())
    impl = "transformer_engine" if any("layer_norm_weight" in n for n in params) else "local"
    if ep_rank is None:
        ep_rank = expert_parallel_rank(parallel)
    specs = param_specs(model, parallel, pp_rank, impl, ep_rank)
    expected = hf_shapes(model)
    missing = sorted(set(params) - {s.local for s in specs})
    if missing:
        raise RuntimeError(f"megatron parameters without an HF source: {missing}")
    ckpt = HFCheckpoint(hf_dir)
    shards = {s.local: read_shard(ckpt, s, model, tp_rank, parallel.tp, expected) for s in specs}
    nbytes = 0
    with torch.no_grad():
        for s in specs:
            p, t = params[s.local], shards[s.local]
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"{s.local}: shard shape {list(t.shape)} != parameter "
                                 f"{list(p.shape)}")
            p.copy_(t)
            nbytes += t.numel() * t.element_size()
    return nbytes


def expert_parallel_rank(parallel: ParallelConfig) -> int:
    """This rank's expert-parallel rank (megatron's parallel_state; 0 without EP)."""
    if parallel.ep == 1:
        return 0
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_rank()


def save_hf_dir(out_dir: str | os.PathLike, model: ModelConfig,
                pairs: Iterable[tuple[str, torch.Tensor]], *, write: bool = True,
                shard_bytes: int = 2 << 30) -> None:
    """Writes an HF checkpoint from a stream of (name, tensor) pairs: safetensors shards of at
    most `shard_bytes` (one tensor if larger) plus the index and config.json, renamed into place
    at the end. `write=False` only drains the stream (ranks other than the writer must still
    take part in its collectives)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    files: list[list[str]] = []
    cur: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        out.mkdir(parents=True, exist_ok=True)
        save_file(cur, str(out / f"shard-{len(files):05d}.tmp"), metadata={"format": "pt"})
        files.append(list(cur))

    for name, tensor in pairs:
        if not write:
            continue
        n = tensor.numel() * tensor.element_size()
        if cur and size + n > shard_bytes:
            flush()
            cur, size = {}, 0
        cur[name] = tensor.contiguous()
        size += n
    if not write:
        return
    if cur:
        flush()
    total, weight_map, nbytes = len(files), {}, 0
    for i, names in enumerate(files):
        final = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        os.replace(out / f"shard-{i:05d}.tmp", out / final)
        weight_map.update({n: final for n in names})
        nbytes += (out / final).stat().st_size
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": nbytes}, "weight_map": dict(sorted(weight_map.items()))},
        indent=1))
    (out / "config.json").write_text(json.dumps(hf_config_dict(model), indent=1))
