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
by every TP rank (a few KiB a layer).

rollout.sync_delta: a sync sends only the shards whose bytes changed since the engines last
received them (`megagrpo.engine.shard_feed.SentDigests`), and the rollout ranks update just
those (a partial update; the header says `delta`). sync_bytes is then what was sent."""
from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from megagrpo.config.params import param_specs
from megagrpo.engine import WeightSyncStats
from megagrpo.engine.shard_feed import (
    SentDigests,
    buckets,
    engine_dsts,
    lined_up,
    send_bucket,
    send_end,
)
from megagrpo.rollout.placement import RemoteEngine
from megagrpo.sync.source import Feed
from megagrpo.sync.transports import SyncContext, Transport, register
from megagrpo.sync.transports.collective import deliver_remote_adapter


@register("shards")
class Shards(Transport):
    own_shards = True
    adapters = True

    def __init__(self, remote: RemoteEngine, stage: int, digests: SentDigests | None = None,
                 tp_group=None, tp_rank: int = 0) -> None:
        self.remote = remote
        """The rollout ranks' stand-in: the placement (its `weights` group), the sync count."""
        self.stage = stage
        """This rank's pipeline stage."""
        self.digests = digests
        """rollout.sync_delta: what the engines last received (None: every sync sends all)."""
        self.tp_group = tp_group
        """The stage's TP group (its ranks agree on what changed); None at TP 1."""
        self.tp_rank = tp_rank
        """This rank's training TP rank (lined up with TP > 1 engines: the engine ranks it
        feeds)."""

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
        tp_group = ps.get_tensor_model_parallel_group() if ctx.parallel.tp > 1 else None
        return cls(remote, stage, SentDigests() if ctx.delta else None, tp_group,
                   ps.get_tensor_model_parallel_rank())

    def deliver(self, feed: Feed, version: int) -> dict:
        stats = self.send(feed.pairs)
        return dict(feed.metrics(stats), sync_bytes=stats.bytes)

    def deliver_adapter(self, base: Feed | None, adapters: dict, load) -> dict:
        """The base's own shards when it changed (after a merge), then the adapters from
        training rank 0 over the cross group."""
        return deliver_remote_adapter(self, base, adapters)

    def send(self, shards: Iterable[tuple[str, torch.Tensor]], head: dict | None = None
             ) -> WeightSyncStats:
        """This rank's shards to every rollout rank (replica 0 only; the others count the
        sync; `head`: more of the sync's header, an adapter sync with an unchanged base sends
        no shard). Returns what it sent."""
        r = self.remote
        t0 = time.perf_counter()
        delta = {"delta": True} if self.digests is not None else {}
        r.begin_sync("shards", **(head or {}), **delta)
        if not r.sends or (head and not head["base"]):
            return WeightSyncStats(tensors=0, bytes=0, seconds=0.0, source_seconds=0.0,
                                   load_seconds=0.0)
        pairs = list(shards)  # the stage's parameters (references): the layer spec from names
        impl = "transformer_engine" if any("layer_norm_weight" in n for n, _ in pairs) \
            else "local"
        if self.digests is not None:  # the same parameters on every TP rank of the stage
            pairs = self.digests.changed(pairs, self.tp_group)
        place = r.place
        dsts = [place.train_world + j for j in range(place.rollout_ranks)]
        if lined_up(place.parallel, place.engine_tp):
            # this rank's shards to the engine ranks of its TP rank only, then the vocab
            # tensors (vLLM splits the padded vocab its own way) to every rollout rank
            specs = {sp.local: sp for sp in param_specs(place.model, place.parallel, self.stage,
                                                        impl)}
            own = [(n, t) for n, t in pairs if specs[n].kind != "vocab"]
            self._send_all(own, impl, engine_dsts(place.train_world, place.rollout_ranks,
                                                   place.engine_tp, self.tp_rank))
            pairs_to_all = [(n, t) for n, t in pairs if specs[n].kind == "vocab"]
        else:
            pairs_to_all = pairs
        self._send_all(pairs_to_all, impl, dsts)
        s = time.perf_counter() - t0
        return WeightSyncStats(tensors=len(pairs), bytes=sum(t.numel() * t.element_size()
                                                             for _, t in pairs),
                               seconds=s, source_seconds=0.0, load_seconds=s)

    def _send_all(self, pairs: list[tuple[str, torch.Tensor]], impl: str, dsts: list[int]
                  ) -> None:
        """`pairs` in buckets to every rank of `dsts`, then their `end`."""
        r = self.remote
        for bucket in buckets(pairs, r.bucket_bytes):
            send_bucket(r.place.weights, bucket, self.stage, impl, dsts)
        send_end(r.place.weights, dsts)
