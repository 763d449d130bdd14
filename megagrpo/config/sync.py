"""How the policy's weights reach the rollout engines (`megagrpo.sync`): the transport and the
dtype cast. The bucket size stays rollout.sync_bucket_mb."""
from __future__ import annotations

from dataclasses import dataclass

from megagrpo.config.model import ParallelConfig
from megagrpo.config.rollout import DTYPES, RolloutConfig
from megagrpo.config.section import Section

BUILT_IN = ("reload", "inflight", "collective", "shards", "disk")
"""The transports in megagrpo/sync/transports/ (a new module there adds one)."""


@dataclass(kw_only=True)
class SyncConfig(Section):
    """The weight sync after each update: policy shards -> (transforms) -> a transport."""

    transport: str = "auto"
    """auto (reload; inflight with rollout.inflight_updates; under separate placement shards,
    or collective with parallel.ep > 1), reload (the engine's in-process update), inflight
    (posted, loaded between decode steps), collective (full tensors from training rank 0 to
    the rollout ranks), shards (every training rank's own shards to the rollout ranks,
    reassembled there), disk (an HF folder the engine loads), or a transport registered in
    megagrpo/sync/transports/."""
    dtype: str = "auto"
    """auto (the model's dtype, no cast), float32, bfloat16 or float16: the weights are cast to
    it on their way to the engine."""

    def resolved(self, rollout: RolloutConfig, parallel: ParallelConfig) -> str:
        """The transport this run uses: sync.transport, or for auto the placement's choice
        (separate: shards, collective with expert parallelism)."""
        if self.transport != "auto":
            return self.transport
        if rollout.placement == "separate":
            return "collective" if parallel.ep > 1 else "shards"
        return "inflight" if rollout.inflight_updates else "reload"

    def validate(self, rollout: RolloutConfig) -> None:
        """The transport fits the placement and rollout.inflight_updates (a transport outside
        the built-in ones is checked when the run is set up, against the registry)."""
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"sync.dtype={self.dtype!r} must be auto or one of {DTYPES}")
        t = self.transport
        if not t.isidentifier():
            raise ValueError(f"sync.transport={t!r} must be auto or a transport's module name "
                             f"(built in: {BUILT_IN})")
        if t == "auto" or t not in BUILT_IN:
            return
        separate = rollout.placement == "separate"
        if separate != (t in ("collective", "shards")):
            raise ValueError(
                f"sync.transport={t} with rollout.placement={rollout.placement}: the weights go "
                "to rollout ranks of their own (collective or shards) exactly when placement "
                "is separate; set sync.transport=auto" + ("" if separate else " (or reload)"))
        if not separate and rollout.inflight_updates != (t == "inflight"):
            raise ValueError(
                f"sync.transport={t} with rollout.inflight_updates="
                f"{str(rollout.inflight_updates).lower()}: in-flight updates are posted to the "
                "engine's slot by the inflight transport, and only it posts; set "
                "sync.transport=auto, or rollout.inflight_updates="
                f"{str(not rollout.inflight_updates).lower()}")

    def check_delta(self, rollout: RolloutConfig, parallel: ParallelConfig) -> None:
        """rollout.sync_delta: where a delta can reach the engines whole (the `shards`
        transport of separate placement; the in-flight slot keeps only the newest post, which
        would drop an earlier delta)."""
        if not rollout.sync_delta:
            return
        name = self.resolved(rollout, parallel)
        if name != "shards":
            why = ("its engines are colocated" if rollout.placement != "separate" else
                   f"parallel.ep={parallel.ep}: full tensors from rank 0" if parallel.ep > 1
                   else f"sync.transport={self.transport}")
            raise ValueError(f"rollout.sync_delta=true sends changed shards only, over the "
                             f"shards transport of rollout.placement=separate; this run's sync "
                             f"is {name} ({why}); set rollout.sync_delta=false")
        if rollout.inflight_updates:
            raise ValueError("rollout.sync_delta=true with rollout.inflight_updates=true: the "
                             "in-flight slot keeps only the newest posted sync, and a delta it "
                             "replaced would be lost; set rollout.sync_delta=false or "
                             "rollout.inflight_updates=false")
