"""`sync.transport=reload`: the refit streamed straight into this rank's colocated engine's
in-process update (`VLLMEngine.update_weights`, bucket by bucket, checked before vLLM sees a
tensor)."""
from __future__ import annotations

from megagrpo.sync.source import Feed
from megagrpo.sync.transports import NO_BASE, SyncContext, Transport, register


@register("reload")
class Reload(Transport):
    adapters = True

    def __init__(self, engine) -> None:
        self.engine = engine

    @classmethod
    def build(cls, ctx: SyncContext) -> Reload:
        return cls(ctx.engine)

    def deliver(self, feed: Feed, version: int) -> dict:
        return feed.metrics(self.engine.update_weights(feed.pairs, dtypes=feed.dtypes))

    def deliver_adapter(self, base: Feed | None, adapters: dict, load) -> dict:
        out = self.deliver(base, -1) if base is not None else dict(NO_BASE)
        load(adapters)  # a peft folder in this rank's engine folder
        return out
