"""Model checkpoints in megatron-core's `dist_checkpointing` format (resharding on load: save at
one TP/PP, load at another), plus the model config beside them.

Writes are atomic: everything goes to `DIR.tmp-<step>` and is renamed into place only when every
rank has finished, so a crash mid-save never damages the last good checkpoint.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from megagrpo.config.model import ModelConfig
from megagrpo.model import unwrap

MODEL_JSON = "megagrpo_model.json"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_model(gpt: torch.nn.Module, ckpt_dir: str | os.PathLike, model: ModelConfig,
               *, extra: dict | None = None) -> None:
    """Collective: every rank saves its shards of `gpt` into `ckpt_dir` (atomically)."""
    from megatron.core import dist_checkpointing

    final = Path(ckpt_dir)
    tmp = final.with_name(final.name + ".tmp")
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    dist_checkpointing.save(unwrap(gpt).sharded_state_dict(), str(tmp))
    _barrier()
    if _rank() == 0:
        meta = {"model": dataclasses.asdict(model), **(extra or {})}
        (tmp / MODEL_JSON).write_text(json.dumps(meta, indent=1))
        old = final.with_name(final.name + ".old")
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()


def read_model_config(ckpt_dir: str | os.PathLike) -> tuple[ModelConfig, dict]:
    path = Path(ckpt_dir) / MODEL_JSON
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: not a megagrpo model checkpoint")
    meta = json.loads(path.read_text())
    return ModelConfig(**meta.pop("model")), meta


def load_model(gpt: torch.nn.Module, ckpt_dir: str | os.PathLike) -> None:
    """Collective: loads a checkpoint saved at any TP/PP into this rank's shards of `gpt`."""
    from megatron.core import dist_checkpointing

    inner = unwrap(gpt)
    state = dist_checkpointing.load(inner.sharded_state_dict(), str(ckpt_dir))
    inner.load_state_dict(state, strict=False)
