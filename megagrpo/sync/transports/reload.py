"""`sync.transport=reload`: the refit streamed straight into this rank's colocated engine's
in-process update (`VLLMEngine.update_weights`, bucket by bucket, checked before vLLM sees a
tensor)."""
from __future__ import annotations

from megagrpo.sync.source import Feed
from megagrpo.sync.transports import SyncContext, Transport, register


@register("reload")
class Reload(Transport):
    def __init__(self, engine) -> None:
        self.engine = engine

    @classmethod
    def build(cls, ctx: SyncContext) -> Reload:
        return cls(ctx.engine)

    def deliver(self, feed: Feed, version: int) -> dict:
        return feed.metrics(self.engine.update_weights(feed.pairs, dtypes=feed.dtypes))
