"""`WeightSync`: the policy's weights -> the rollout engine(s) after each update, built once at
set-up (`build_weight_sync`) and called without asking which kind it is.

    source (`megagrpo.sync.source`: full HF tensors | this rank's vLLM slices;
            `megagrpo.sync.adapters.AdapterSource`: a LoRA policy's adapters, the base after
            a merge)
      -> transforms (`megagrpo.sync.transforms`: the LoRA merge, a dtype cast; each declares
            what it emits: `expects`)
      -> transport (`megagrpo.sync.transports`: reload | inflight | collective | disk | any
            registered)
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Protocol

import torch

from megagrpo.config.lora import LoRAConfig
from megagrpo.config.model import ModelConfig, ParallelConfig
from megagrpo.config.rollout import RolloutConfig
from megagrpo.config.sync import SyncConfig
from megagrpo.model.gpt import DTYPE
from megagrpo.sync.adapters import AdapterSource, MergeAdapters
from megagrpo.sync.source import Feed, FullWeights, OwnShards, ShardSlices
from megagrpo.sync.transforms import CastDtype, TensorMeta, Transform, expected_feed
from megagrpo.sync.transports import SyncContext, Transport, transport_class


class Source(Protocol):
    """Where a refit's pairs come from (`FullWeights`, `ShardSlices`, `AdapterSource`)."""

    def feed(self, policy: torch.nn.Module, params: Mapping[str, torch.Tensor] | None
             ) -> Feed: ...

    def refit(self, policy: torch.nn.Module, feed: Callable[[], Feed],
              deliver: Callable[[Feed], dict]) -> dict: ...

    def base_changed(self) -> None: ...

    def checkpoint_parts(self) -> dict: ...


class WeightSync:
    """One run's weight sync: `post` after the update (the in-flight transport hands the refit
    to the running draw), `sync` after the rollout is joined (the engine then holds `version`)."""

    source: Source
    transforms: tuple[Transform, ...]
    transport: Transport
    version: int
    """The policy version the engine holds (-1: none yet)."""

    def __init__(self, source: Source, transport: Transport,
                 transforms: Sequence[Transform] = (), *,
                 declared: Mapping[str, TensorMeta] | None = None) -> None:
        self.source, self.transport, self.transforms = source, transport, tuple(transforms)
        self.version = -1
        self.dtypes = None if declared is None else {n: m.dtype for n, m in declared.items()}
        """Each name's declared dtype (`expects`), carried by every feed to the engine."""

    def feed(self, policy: torch.nn.Module) -> Feed:
        """One refit's stream (lazy: nothing moves until its pairs are pulled): the source over
        the parameters the transforms give it, its pairs through the transforms."""
        params: Mapping[str, torch.Tensor] | None = None
        for t in self.transforms:
            params = t.parameters(policy, params)
        out = self.source.feed(policy, params)
        for t in self.transforms:
            out.pairs = t.pairs(out.pairs)
        out.dtypes = self.dtypes
        return out

    def post(self, policy: torch.nn.Module, version: int) -> None:
        """After the update: the transport may hand the refit of `version` over now (only the
        in-flight one does); nothing when the engine holds `version` already."""
        if version != self.version:
            self.transport.post(self.feed(policy), version)

    def sync(self, policy: torch.nn.Module, version: int) -> dict:
        """The engine gets policy `version` (or finishes taking what `post` handed over);
        returns the sync metrics. Collective over the model-parallel group."""
        out = self.source.refit(policy, partial(self.feed, policy),
                                partial(self.transport.deliver, version=version))
        self.version = version
        return out

    def base_changed(self) -> None:
        """A merge edited the policy's frozen base (an adapter refit sends it next time)."""
        self.source.base_changed()

    def checkpoint_parts(self) -> dict:
        """The checkpoint's replicated parts of the sync, by name (an adapter refit's)."""
        return self.source.checkpoint_parts()

    def expects(self, model: ModelConfig) -> dict[str, TensorMeta]:
        """HF name -> shape and dtype of what the transport delivers (`config.params` plus the
        transforms' declarations)."""
        return expected_feed(model, self.transforms)


def build_weight_sync(cfg: SyncConfig, rollout: RolloutConfig, lora: LoRAConfig, *,
                      model: ModelConfig, parallel: ParallelConfig, engine,
                      shard_to_shard: bool, folder: Path) -> WeightSync:
    """The run's weight sync: shard slices when the engines line up with training TP, else full
    tensors; a LoRA policy's adapters alone when the engine serves them (`engine.max_lora_rank`),
    else merged; the cast of sync.dtype; the transport sync.transport names (auto: reload,
    inflight with rollout.inflight_updates, collective under separate placement)."""
    name = cfg.resolved(rollout, parallel)
    kind = transport_class(name)
    base = (OwnShards if kind.own_shards else ShardSlices if shard_to_shard else FullWeights)(
        model, parallel, rollout.sync_bucket_mb << 20)
    transport = kind.build(SyncContext(engine=engine, model=model, folder=folder,
                                       parallel=parallel, delta=rollout.sync_delta))
    transforms: list[Transform] = []
    source: Source = base
    if lora.enabled and engine.max_lora_rank:
        if not kind.adapters:
            raise ValueError(f"sync.transport={name} with an adapter-only LoRA refit: it moves "
                             "no adapters (reload, shards and collective do); set "
                             "sync.transport=auto or lora.refit=merged")
        source = AdapterSource(lora, folder / "adapters", engine, base, transport)
    elif lora.enabled:
        transforms.append(MergeAdapters())
    if cfg.dtype not in ("auto", model.dtype):
        transforms.append(CastDtype(DTYPE[cfg.dtype]))
    return WeightSync(source, transport, transforms,
                      declared=expected_feed(model, transforms))


__all__ = ["Source", "WeightSync", "build_weight_sync"]
