"""`sync.transport=inflight` (rollout.inflight_updates, colocated; the engine's side and the
semantics: `megagrpo.engine.inflight`).

After its optimizer step the trainer gathers the refit on the main thread (the TP gathers and
PP broadcasts are collectives; they never run on the generating thread) and posts it to the
engine's slot (`post`); the draw running on the async thread loads it between two decode
steps. The step then joins the draw as before; if it had already ended (or none ran: k batches
were queued), `deliver` loads the posted weights on the main thread, so the engine always holds
the trainer's version once a step ends. Without a post (no update applied) `deliver` reloads as
`reload` does and labels the engine's weights with the version vLLM stamps on its tokens.
"""
from __future__ import annotations

from megagrpo.engine.inflight import InflightUpdates
from megagrpo.sync.source import Feed
from megagrpo.sync.transports import SyncContext, register
from megagrpo.sync.transports.reload import Reload


@register("inflight")
class Inflight(Reload):
    def __init__(self, engine, slot: InflightUpdates) -> None:
        super().__init__(engine)
        self.slot = slot
        self.posted: dict | None = None
        """The gather metrics of a refit posted and not yet accounted for by `deliver`."""

    @classmethod
    def build(cls, ctx: SyncContext) -> Inflight:
        if ctx.engine.inflight is None:
            raise ValueError("sync.transport=inflight needs an engine started with "
                             "rollout.inflight_updates=true")
        return cls(ctx.engine, ctx.engine.inflight)

    def post(self, feed: Feed, version: int) -> None:
        """Gathers the whole refit (the tensors may be live parameters at PP = 1: nothing edits
        them before the draw is joined and `deliver` ran) and posts it for `version`."""
        self.slot.post(list(feed.pairs), version)
        self.posted = feed.gather_metrics()

    def deliver(self, feed: Feed, version: int) -> dict:
        """After the join: a posted refit loaded if the draw did not take it (it had ended),
        else a reload; plus inflight_midway (1: the weights entered a running generation)."""
        if self.posted is None:
            out = super().deliver(feed, version)
            self.slot.label(self.engine, version)
            return dict(out, inflight_midway=float(self.slot.take_midway()))
        posted, self.posted = self.posted, None
        stats = self.slot.apply_pending(self.engine) or self.slot.last_stats
        return dict(posted, sync_load_s=stats.seconds if stats is not None else 0.0,
                    inflight_midway=float(self.slot.take_midway()))
