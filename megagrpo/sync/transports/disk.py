"""`sync.transport=disk`: each rank writes its refit as an HF folder (safetensors shards,
index, config.json) under its engine folder, and its engine loads that folder through the same
checked update as `reload`. Slower than `reload`; what an engine that reads weights only from
files (or a debugging session that wants to look at them) needs."""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from megagrpo.config.model import ModelConfig
from megagrpo.hf import save_hf_dir
from megagrpo.sync.source import Feed
from megagrpo.sync.transports import SyncContext, Transport, register


@register("disk")
class Disk(Transport):
    def __init__(self, engine, folder: Path, model: ModelConfig) -> None:
        self.engine, self.folder, self.model = engine, Path(folder), model

    @classmethod
    def build(cls, ctx: SyncContext) -> Disk:
        return cls(ctx.engine, ctx.folder / "synced", ctx.model)

    def deliver(self, feed: Feed, version: int) -> dict:
        t0 = time.perf_counter()
        save_hf_dir(self.folder, self.model, feed.pairs)  # this rank's own folder
        t1 = time.perf_counter()
        self.engine.update_weights(read_hf_folder(self.folder), dtypes=feed.dtypes)
        return dict(feed.gather_metrics(), sync_load_s=time.perf_counter() - t1,
                    sync_write_s=t1 - t0 - feed.stats.gather_s - feed.stats.convert_s)


def read_hf_folder(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of an HF folder `save_hf_dir` wrote, file by file."""
    from safetensors import safe_open

    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    for fname in sorted(set(weight_map.values())):
        with safe_open(folder / fname, "pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
