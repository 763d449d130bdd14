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
from megagrpo.rollout.placement import WIRE_DTYPES, RemoteEngine, bcast_json
from megagrpo.sync.source import Feed
from megagrpo.sync.transports import SyncContext, Transport, register


@register("collective")
class Collective(Transport):
    def __init__(self, remote: RemoteEngine) -> None:
        self.remote = remote
        """The rollout ranks' stand-in: the placement, its sync count, the trainer's loader."""

    @classmethod
    def build(cls, ctx: SyncContext) -> Collective:
        return cls(RemoteEngine.of(ctx.engine, "collective"))

    def deliver(self, feed: Feed, version: int) -> dict:
        return feed.metrics(self.send(feed.pairs))

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> WeightSyncStats:
        """Collective over the training ranks of DP replica 0 (the stream's TP/PP gathers) and
        the cross group: every full tensor reaches every rollout rank. Returns what moved."""
        r = self.remote
        t0 = time.perf_counter()
        r.begin_sync("collective")
        if not r.sends:
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
        """One bucket: a header (names, shapes, dtype), then the tensors as one flat buffer."""
        cross = self.remote.place.cross
        dtype = str(bucket[0][1].dtype).removeprefix("torch.")
        bcast_json(cross, {"names": [n for n, _ in bucket], "dtype": dtype,
                           "shapes": [list(t.shape) for _, t in bucket]})
        flat = torch.cat([t.to(WIRE_DTYPES[dtype]).reshape(-1) for _, t in bucket])
        cross.broadcast(flat, 0).wait()
        return flat.numel() * flat.element_size()
