"""`sync.transport=collective` (separate placement, `megagrpo.rollout.placement`): the training
ranks of DP replica 0 drive the full-weight stream (its TP gathers and PP broadcasts) and training
rank 0 broadcasts every tensor to the rollout ranks over the cross group, in flat buckets of at
most rollout.sync_bucket_mb (or one tensor if larger), each announced in the store first; every
rollout rank loads them into its own engine (`megagrpo.rollout.placement.receive_weights`)."""
from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from megagrpo.engine import WeightSyncStats
from megagrpo.engine.shard_feed import buckets
from megagrpo.rollout.placement import WIRE_DTYPES, RemoteEngine, bcast_json
from megagrpo.sync.source import Feed
from megagrpo.sync.transports import NO_BASE, SyncContext, Transport, register


@register("collective")
class Collective(Transport):
    adapters = True

    def __init__(self, remote: RemoteEngine) -> None:
        self.remote = remote
        """The rollout ranks' stand-in: the placement, its sync count, the trainer's loader."""

    @classmethod
    def build(cls, ctx: SyncContext) -> Collective:
        return cls(RemoteEngine.of(ctx.engine, "collective"))

    def deliver(self, feed: Feed, version: int) -> dict:
        return feed.metrics(self.send(feed.pairs))

    def deliver_adapter(self, base: Feed | None, adapters: dict, load) -> dict:
        """The base's full tensors when it changed, then the adapters, over the cross group."""
        return deliver_remote_adapter(self, base, adapters)

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], head: dict | None = None
             ) -> WeightSyncStats:
        """Collective over the training ranks of DP replica 0 (the stream's TP/PP gathers) and
        the cross group: every full tensor reaches every rollout rank (`head`: more of the
        sync's header; an adapter sync with an unchanged base sends no tensor, not even the
        end). Returns what moved."""
        r = self.remote
        t0 = time.perf_counter()
        r.begin_sync("collective", **(head or {}))
        if not r.sends or (head and not head["base"]):
            return WeightSyncStats(tensors=0, bytes=0, seconds=0.0, source_seconds=0.0,
                                   load_seconds=0.0)
        root = r.place.cross is not None
        bucket: list[tuple[str, torch.Tensor]] = []
        size = tensors = moved = 0
        for name, t in named_tensors:  # every sending rank drives the stream's collectives
            if not root:
                continue
            n = t.numel() * t.element_size()
            if bucket and size + n > r.bucket_bytes:
                moved += self._send(bucket)
                bucket, size = [], 0
            bucket.append((name, t.detach().to("cpu", copy=True)))
            size, tensors = size + n, tensors + 1
        if root:
            moved += self._send(bucket) if bucket else 0
            bcast_json(r.place.cross, {"end": True})
        s = time.perf_counter() - t0
        return WeightSyncStats(tensors=tensors, bytes=moved, seconds=s, source_seconds=0.0,
                               load_seconds=s)

    def _send(self, bucket: list[tuple[str, torch.Tensor]]) -> int:
        return send_bucket(self.remote.place.cross, bucket)


def send_bucket(cross, bucket: list[tuple[str, torch.Tensor]]) -> int:
    """One bucket from cross rank 0: a header (names, shapes, dtype), then the tensors as one
    flat buffer. Returns the buffer's bytes."""
    dtype = str(bucket[0][1].dtype).removeprefix("torch.")
    bcast_json(cross, {"names": [n for n, _ in bucket], "dtype": dtype,
                       "shapes": [list(t.shape) for _, t in bucket]})
    flat = torch.cat([t.to(WIRE_DTYPES[dtype]).reshape(-1) for _, t in bucket])
    cross.broadcast(flat, 0).wait()
    return flat.numel() * flat.element_size()


def deliver_remote_adapter(transport: Collective, base: Feed | None,
                           adapters: dict[str, torch.Tensor]) -> dict:
    """An adapter-only LoRA sync to the rollout ranks (`Transport.deliver_adapter` of
    `collective` and `shards`): one sync whose header says so, the base by the transport's own
    `send` only when it changed, then the adapters (`send_adapters`); the rollout ranks load
    both (`megagrpo.rollout.placement.receive_adapter`)."""
    head = {"adapter": True, "base": base is not None}
    if base is None:
        out = dict(NO_BASE, sync_load_s=transport.send((), head).seconds)
    else:
        stats = transport.send(base.pairs, head)
        out = dict(base.metrics(stats), sync_bytes=stats.bytes)
    send_adapters(transport.remote, adapters)
    return out


def send_adapters(remote: RemoteEngine, adapters: dict[str, torch.Tensor]) -> int:
    """Training rank 0: a LoRA policy's adapter tensors (peft names, gathered on every rank)
    to every rollout rank over the cross group, in buckets of one dtype and at most
    rollout.sync_bucket_mb, then the end; the other training ranks send nothing. Returns the
    bytes broadcast."""
    cross = remote.place.cross
    if not remote.sends or cross is None:
        return 0
    moved = 0
    for dtype in sorted({t.dtype for t in adapters.values()}, key=str):
        same = [(n, t.detach().to("cpu")) for n, t in adapters.items() if t.dtype == dtype]
        for bucket in buckets(same, remote.bucket_bytes):
            moved += send_bucket(cross, bucket)
    bcast_json(cross, {"end": True})
    return moved
