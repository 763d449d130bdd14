"""`sync.transport=shards` (separate placement, `megagrpo.rollout.placement`; what `auto` picks
there when the training layout has no expert parallelism): shard to shard. Every training rank of DP
replica 0 sends its own megatron shards (`megagrpo.sync.source.OwnShards`: no TP gather, no PP
broadcast, no full model on any training rank), in buckets of at most rollout.sync_bucket_mb,
point to point to every rollout rank, which reassembles them into its engine's layout
(`megagrpo.engine.shard_feed`). Training rank 0 still announces each sync and broadcasts its
small header over the cross group first, as `collective` does.

Each rollout rank receives T_0 = tp x pp streams (the ranks of replica 0) instead of one, and
no training rank holds more than a bucket beyond its own shards: the training side's sync
cost no longer grows with the model on rank 0. Parameters replicated over TP (norms) are sent
by every TP rank (a few KiB a layer)."""
from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from megagrpo.engine import WeightSyncStats
from megagrpo.engine.shard_feed import buckets, send_bucket, send_end
from megagrpo.rollout.placement import RemoteEngine
from megagrpo.sync.source import Feed
from megagrpo.sync.transports import SyncContext, Transport, register


@register("shards")
class Shards(Transport):
    own_shards = True

    def __init__(self, remote: RemoteEngine, stage: int) -> None:
        self.remote = remote
        """The rollout ranks' stand-in: the placement (its `weights` group), the sync count."""
        self.stage = stage
        """This rank's pipeline stage."""

    @classmethod
    def build(cls, ctx: SyncContext) -> Shards:
        from megatron.core import parallel_state as ps

        remote = RemoteEngine.of(ctx.engine, "shards")
        if ctx.parallel is not None and ctx.parallel.ep > 1:
            raise ValueError(f"sync.transport=shards with parallel.ep={ctx.parallel.ep}: the "
                             "experts' shards are not sent shard to shard yet; set "
                             "sync.transport=auto (collective) or collective")
        place = remote.place
        if place.weights is None:
            raise ValueError("sync.transport=shards needs the placement's weights group "
                             "(split_world builds it when the transport is shards)")
        stage = ps.get_pipeline_model_parallel_rank()
        if remote.sends:  # replica 0: the rollout ranks look their senders up here
            place.store.set(f"shards/{stage}/{ps.get_tensor_model_parallel_rank()}",
                            str(place.rank))
        return cls(remote, stage)

    def deliver(self, feed: Feed, version: int) -> dict:
        return feed.metrics(self.send(feed.pairs))

    def send(self, shards: Iterable[tuple[str, torch.Tensor]]) -> WeightSyncStats:
        """This rank's shards to every rollout rank (replica 0 only; the others count the
        sync). Returns what it sent."""
        r = self.remote
        t0 = time.perf_counter()
        r.begin_sync("shards")
        if not r.sends:
            return WeightSyncStats(tensors=0, bytes=0, seconds=0.0, source_seconds=0.0,
                                   load_seconds=0.0)
        pairs = list(shards)  # the stage's parameters (references): the layer spec from names
        impl = "transformer_engine" if any("layer_norm_weight" in n for n, _ in pairs) \
            else "local"
        place = r.place
        dsts = [place.train_world + j for j in range(place.rollout_ranks)]
        moved = 0
        for bucket in buckets(pairs, r.bucket_bytes):
            moved += send_bucket(place.weights, bucket, self.stage, impl, dsts)
        send_end(place.weights, dsts)
        s = time.perf_counter() - t0
        return WeightSyncStats(tensors=len(pairs), bytes=moved, seconds=s, source_seconds=0.0,
                               load_seconds=s)
