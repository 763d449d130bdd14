"""Shard-to-shard weight sync to rollout ranks of their own (`sync.transport=shards`, separate
placement): the wire both sides speak.

Each training rank of DP replica 0 (TP rank r of pipeline stage s) sends its own megatron
shards, nothing gathered, straight to every rollout rank over a gloo group of the whole world
(`Placement.weights`): in buckets of at most rollout.sync_bucket_mb of its shards, each bucket
a small JSON header (the stage, the layer spec, the local parameter names, the dtype) and one
flat buffer; an `end` header closes a rank's sync. Every TP rank of a stage holds shards of the
same shapes, so the ranks of a stage cut the same buckets. A rollout rank receives bucket b of
stage s from each of its TP ranks and reassembles the HF tensors of the bucket's parameters
from their shards in TP rank order (`megagrpo.hf.unfuse_shards`, the same conversion as the
gathered stream's: QKV split per KV group, gate/up split, vocab padding stripped), stage after
stage, into its engine's layout (an engine of TP 1, or of another TP than training's: whole
tensors, which vLLM slices). Senders announce themselves in the store as
`shards/{stage}/{tp_rank}` -> global rank.

Engines of TP k = training TP > 1 (`lined_up`; rollout rank j is vLLM TP rank j % k of engine
j // k): a stage's sync is two streams. First each training TP rank r sends its own non-vocab
shards only to the rollout ranks of vLLM TP rank r (`engine_dsts`), which write their slices
from them (`megagrpo.hf.slice_pairs`, as the colocated shard-to-shard stream does); then every
TP rank sends its vocab shards to every rollout rank, which reassembles those tensors whole
(vLLM pads the vocab to a multiple of 64 and splits that: its slice is not a megatron shard).
No rollout rank receives more than its 1/k of the projections, the norms and the vocab
tensors.

rollout.sync_delta: a sender keeps a digest of every shard it sent (`SentDigests`) and sends
only the shards whose bytes changed since; the TP ranks of a stage agree on the changed
parameters first (a MAX all-reduce of the flags over their TP group), so they still cut the
same buckets, and a rollout rank reassembles just those parameters (a partial update of its
engine, every fused layer whole).
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

from megagrpo.config.model import ModelConfig, ParallelConfig
from megagrpo.config.params import param_specs
from megagrpo.hf import slice_pairs, unfuse_shards

TAG = 1
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def send_json(group, obj: dict, dst: int) -> int:
    """A small header to rank `dst`: its length, then its bytes. Returns the bytes sent."""
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    group.send([torch.tensor([data.numel()], dtype=torch.int64)], dst, TAG).wait()
    group.send([data], dst, TAG).wait()
    return data.numel() + 8


def recv_json(group, src: int) -> dict:
    n = torch.empty(1, dtype=torch.int64)
    group.recv([n], src, TAG).wait()
    data = torch.empty(int(n.item()), dtype=torch.uint8)
    group.recv([data], src, TAG).wait()
    return json.loads(data.numpy().tobytes().decode())


def buckets(shards: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
            ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """This rank's (local name, shard) pairs cut into buckets of at most `bucket_bytes` (one
    shard if larger); every TP rank of a stage cuts the same ones."""
    cur, size = [], 0
    for name, t in shards:
        n = t.numel() * t.element_size()
        if cur and size + n > bucket_bytes:
            yield cur
            cur, size = [], 0
        cur.append((name, t))
        size += n
    if cur:
        yield cur


def send_bucket(group, bucket: list[tuple[str, torch.Tensor]], stage: int, impl: str,
                dsts: list[int]) -> int:
    """One bucket of this rank's shards to every rollout rank in `dsts`. Returns bytes sent."""
    dtype = bucket[0][1].dtype
    flat = torch.cat([t.detach().to("cpu", dtype).reshape(-1) for _, t in bucket])
    head = {"stage": stage, "impl": impl, "names": [n for n, _ in bucket],
            "dtype": str(dtype).removeprefix("torch.")}
    moved = 0
    for dst in dsts:
        moved += send_json(group, head, dst)
        group.send([flat], dst, TAG).wait()
        moved += flat.numel() * flat.element_size()
    return moved


def send_end(group, dsts: list[int]) -> None:
    for dst in dsts:
        send_json(group, {"end": True}, dst)


def digest(t: torch.Tensor) -> bytes:
    """A 128-bit blake2b digest of the tensor's bytes (on the host)."""
    raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return hashlib.blake2b(memoryview(raw.numpy()), digest_size=16).digest()


class SentDigests:
    """Sender side of rollout.sync_delta: the digest of each shard (by local name) as the
    engines last received it."""

    def __init__(self) -> None:
        self.sent: dict[str, bytes] = {}

    def changed(self, shards: list[tuple[str, torch.Tensor]], tp_group=None
                ) -> list[tuple[str, torch.Tensor]]:
        """The shards to send: those whose bytes differ from the last sent (all at first), or
        whose parameter changed on another TP rank of the stage (`tp_group`, collective over
        it: the ranks of a stage send the same parameters). Records them as sent."""
        digests = [digest(t) for _, t in shards]
        flags = torch.tensor([self.sent.get(n) != d for (n, _), d in zip(shards, digests)],
                             dtype=torch.int32)
        if tp_group is not None and flags.numel():
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.MAX
            tp_group.allreduce([flags], opts).wait()
        for (n, _), d in zip(shards, digests):
            self.sent[n] = d
        return [pair for pair, f in zip(shards, flags.tolist()) if f]


def sender_ranks(store, parallel: ParallelConfig) -> list[list[int]]:
    """[stage][tp_rank] -> the global rank that sends those shards (as the senders announced)."""
    return [[int(store.get(f"shards/{s}/{r}")) for r in range(parallel.tp)]
            for s in range(parallel.pp)]


def lined_up(parallel: ParallelConfig, engine_tp: int) -> bool:
    """Whether each rollout rank of an engine of `engine_tp` ranks takes its vLLM slices from
    one training TP rank's shards (engine TP = training TP > 1: vLLM TP rank r's slice of every
    non-vocab tensor is megatron TP rank r's shard), so no rollout rank reassembles them."""
    return engine_tp > 1 and engine_tp == parallel.tp


def engine_dsts(train_world: int, rollout_ranks: int, engine_tp: int, tp_rank: int
                ) -> list[int]:
    """The global ranks of the rollout ranks at vLLM TP rank `tp_rank` of their engine (rollout
    rank j is TP rank j % engine_tp of engine j // engine_tp): the ones a lined-up training TP
    rank sends its own shards to."""
    return [train_world + j for j in range(rollout_ranks) if j % engine_tp == tp_rank]


def received_tensors(group, store, model: ModelConfig, parallel: ParallelConfig,
                     engine_tp: int = 1, engine_rank: int = 0, counts=None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Rollout rank: one sync's (HF name, tensor) pairs, stage by stage, bucket by bucket
    (module docstring). Engines of one rank, or of another TP than training's: whole tensors,
    reassembled from the shards of every training TP rank. Lined up (`lined_up`): first this
    rank's slices, built from training TP rank `engine_rank`'s shards alone (full-shape
    tensors with only this rank's vLLM slice written, `megagrpo.hf.slice_pairs`, as the
    colocated shard-to-shard stream builds them), then the vocab tensors whole from every TP
    rank (vLLM pads and splits the vocab its own way). `counts`: anything with a
    `received_bytes` counter, which grows by the bytes received."""
    ranks = sender_ranks(store, parallel)
    lined = lined_up(parallel, engine_tp)
    for stage, tp_ranks in enumerate(ranks):
        specs: dict[str, dict] = {}
        if lined:
            yield from _received(group, [tp_ranks[engine_rank]], stage, specs, model, parallel,
                                 counts, slice_of=engine_rank)
        yield from _received(group, tp_ranks, stage, specs, model, parallel, counts)


def _received(group, tp_ranks: list[int], stage: int, specs: dict, model: ModelConfig,
              parallel: ParallelConfig, counts=None, slice_of: int | None = None
              ) -> Iterator[tuple[str, torch.Tensor]]:
    """One stream of buckets from the senders `tp_ranks` (TP rank order) up to their `end`s:
    the HF tensors reassembled from their shards, or with `slice_of` (one sender, TP rank
    `slice_of`) this rank's vLLM slices of them."""
    while True:
        heads = [recv_json(group, src) for src in tp_ranks]
        if heads[0].get("end"):
            if not all(h.get("end") for h in heads):
                raise RuntimeError(f"shard sync: the TP ranks of stage {stage} sent "
                                   "different bucket counts")
            return
        if any(h["names"] != heads[0]["names"] for h in heads):
            raise RuntimeError(f"shard sync: the TP ranks of stage {stage} cut different "
                               f"buckets ({heads[0]['names'][:2]}...)")
        head = heads[0]
        by_local = specs.setdefault(head["impl"], {
            s.local: s for s in param_specs(model, parallel, stage, head["impl"])})
        bucket = [by_local[n] for n in head["names"]]
        shapes = [s.local_shape(parallel.tp) for s in bucket]
        numel = sum(torch.Size(sh).numel() for sh in shapes)
        flats = []
        for src in tp_ranks:
            flat = torch.empty(numel, dtype=DTYPES[head["dtype"]])
            group.recv([flat], src, TAG).wait()
            flats.append(flat)
            if counts is not None:
                counts.received_bytes += flat.numel() * flat.element_size()
        off = 0
        for spec, shape in zip(bucket, shapes):
            n = torch.Size(shape).numel()
            shards = [f[off:off + n].view(shape) for f in flats]
            off += n
            if spec.split_dim is None:
                shards = shards[:1]
            elif slice_of is not None:
                if spec.kind == "vocab":
                    raise RuntimeError(f"shard sync: {spec.local} (vocab) came in the slices' "
                                       "stream; the vocab tensors travel whole")
                yield from slice_pairs(shards[0], spec, model, slice_of)
                continue
            yield from unfuse_shards(shards, spec, model)


__all__ = ["SentDigests", "buckets", "digest", "engine_dsts", "lined_up", "received_tensors",
           "send_bucket", "send_end", "sender_ranks"]
