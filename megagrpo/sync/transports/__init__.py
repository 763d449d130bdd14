"""The weight sync's transports: how a refit's (HF name, tensor) pairs reach the engine(s).

One module per transport in this folder, each registering its class with `@register(name)`
(the name is `sync.transport`'s value and the module's name): `reload` (the engine's in-process
update), `inflight` (posted to the engine's in-flight slot, loaded between decode steps),
`collective` (separate placement: full tensors from training rank 0 to the rollout ranks over
the cross group), `shards` (separate placement: every training rank of replica 0 sends its own
shards to the rollout ranks, which reassemble them), `disk` (an HF folder the engine loads).
A new transport is a new module here (found by its name when a config asks for it) or a class
registered from anywhere: neither run.py nor trainer.py changes.
"""
from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from megagrpo.config.model import ModelConfig, ParallelConfig

if TYPE_CHECKING:
    import torch

    from megagrpo.sync.source import Feed


@dataclass(frozen=True)
class SyncContext:
    """What a transport may be built from (`Transport.build`)."""

    engine: object
    """This rank's engine: a `megagrpo.engine.VLLMEngine` colocated, the
    `megagrpo.rollout.placement.RemoteEngine` stand-in under separate placement."""
    model: ModelConfig
    """The policy's architecture (what an HF folder's config.json describes)."""
    folder: Path
    """This rank's engine folder (the disk transport writes under it)."""
    parallel: ParallelConfig | None = None
    """The training layout (the shards transport cuts its buckets by it)."""
    delta: bool = False
    """rollout.sync_delta: send only what changed since the engines' last sync (`shards`)."""


class Transport:
    """Delivers one refit to the engine(s). `post` may hand the weights over ahead of
    `deliver` (the in-flight slot); every other transport moves them in `deliver`."""

    name: ClassVar[str] = ""
    own_shards: ClassVar[bool] = False
    """True: it takes this rank's own megatron shards by local name (`sync.source.OwnShards`,
    nothing gathered); False: (HF name, tensor) pairs from the gathered or sliced stream."""
    adapters: ClassVar[bool] = False
    """True: it delivers a LoRA policy's adapter-only refit (`deliver_adapter`)."""

    @classmethod
    def build(cls, ctx: SyncContext) -> Transport:
        raise NotImplementedError

    def post(self, feed: Feed, version: int) -> None:
        """After the update, before the rollout is joined: nothing by default."""

    def deliver(self, feed: Feed, version: int) -> dict:
        """Moves the refit of policy `version` (or finishes a posted one); the step's sync
        metrics (sync_bytes, sync_received_bytes, sync_gather_s, sync_load_s, ...)."""
        raise NotImplementedError

    def deliver_adapter(self, base: Feed | None, adapters: dict[str, torch.Tensor],
                        load: Callable[[dict[str, torch.Tensor]], None]) -> dict:
        """A LoRA adapter-only refit (transports with `adapters`): the base's stream when it
        changed (None: unchanged, nothing of it moves), then the adapter tensors (peft names,
        gathered on every rank), which reach the engine(s) as their next LoRA adapter (`load`:
        how this rank's own engine takes them). Returns the base's sync metrics
        (`NO_BASE` when none moved)."""
        raise NotImplementedError


NO_BASE = {"sync_bytes": 0, "sync_received_bytes": 0, "sync_gather_s": 0.0, "sync_load_s": 0.0}
"""The sync metrics of an adapter refit that moved no base."""

_REGISTRY: dict[str, type[Transport]] = {}


def register(name: str) -> Callable[[type[Transport]], type[Transport]]:
    """Class decorator: the transport `sync.transport=name` selects."""
    def add(cls: type[Transport]) -> type[Transport]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return add


def available() -> list[str]:
    """Every transport a config may name: the modules of this folder and the registered."""
    here = [m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")]
    return sorted(set(here) | set(_REGISTRY))


def check(name: str) -> None:
    """A ValueError naming sync.transport and the choices unless `name` is one (nothing is
    imported: the launcher's preflight asks)."""
    if name not in available():
        raise ValueError(f"sync.transport={name!r} names no transport; choose auto or one of "
                         f"{available()} (a new one: a module in megagrpo/sync/transports/)")


def transport_class(name: str) -> type[Transport]:
    """The transport registered as `name`, importing this folder's module of that name first."""
    check(name)
    if name not in _REGISTRY:
        importlib.import_module(f"{__name__}.{name}")
    return _REGISTRY[name]


__all__ = ["NO_BASE", "SyncContext", "Transport", "available", "check", "register",
           "transport_class"]
