"""A LoRA run's checkpoint: the adapters in every checkpoint, the frozen base only when it changed.

Between two reference resets only the adapters (and their Adam moments) move: the base changes
only at a merge (`megagrpo.lora.layers.merge_adapters`), so writing it into every checkpoint would
write the same model again and again. The policy is saved as two parts
(`megagrpo.run.checkpoint_states`):
- `Adapters` ("policy/" of every checkpoint): the lora_A / lora_B tensors, the config, the
  tokenizer, and in megagrpo_model.json the folder of the base they go with ("base":
  "../../base_000002", relative to policy/);
- `BaseWeights` (a `megagrpo.checkpoint.Shared` part): every other tensor of the model, in
  checkpoints/base_<merges>/, keyed by `LoRAReference.merges` (reference resets so far, the
  cold start's included), written by the first checkpoint after a merge (or the run's first
  checkpoint) and named by the manifest of every checkpoint that uses it.
Both are megatron dist-checkpoints: they load at any TP x PP like a whole model. The base folder
has a manifest of its own; a checkpoint is intact only when its base is (`run_dir.verify`), and
retention removes a base with the last checkpoint that names it (`run_dir.prune_shared`). Any
reader of a policy folder (`checkpoint.load_model`: `convert --from-megatron`, with or without
`--peft-adapter`) follows "base" to it (`checkpoint.base_folder`, which knows nothing of LoRA).
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import torch

from megagrpo.checkpoint import ModelState
from megagrpo.config.lora import LoRAConfig
from megagrpo.config.model import ModelConfig
from megagrpo.runtime.run_dir import write_manifest

ADAPTER_MARK = ".lora_"
"""What names an adapter tensor in a sharded state dict's keys (`megagrpo.lora.layers`: every
adapter parameter is a module's `lora_*` attribute)."""


def is_adapter_key(key: str) -> bool:
    """Whether a sharded state dict key is an adapter's (else the base's)."""
    return ADAPTER_MARK in key


def _is_base_key(key: str) -> bool:
    return not is_adapter_key(key)


class BaseWeights(ModelState):
    """The frozen base of a LoRA policy as a shared part: saved in checkpoints/base_<version>/
    when `version()` (the merges so far) moved since the manager last wrote or loaded it."""

    shared: ClassVar[bool] = True
    inside = "policy"
    """LoRA checkpoints written before the base was shared held it in their policy/."""

    def __init__(self, model: torch.nn.Module | list, config: ModelConfig,
                 version: Callable[[], int]):
        super().__init__(model, config, select=_is_base_key)
        self._version = version
        self.written: str | None = None

    def version(self) -> int:
        return self._version()

    def write_beside(self, folder: Path) -> None:
        """The config, and a manifest of its own: checkpoints that name this folder are
        intact only when it is."""
        super().write_beside(folder)
        write_manifest(folder)


class Adapters(ModelState):
    """A LoRA policy's adapters (every checkpoint's policy/), naming the base they go with."""

    def __init__(self, model: torch.nn.Module | list, config: ModelConfig, base: BaseWeights,
                 *, tokenizer=None, extra: dict | None = None):
        super().__init__(model, config, tokenizer=tokenizer, extra=extra, select=is_adapter_key)
        self.base = base

    def meta(self) -> dict:
        """megagrpo_model.json: the config, `extra`, "base": the folder of the base, relative
        to this policy folder (saved after the base, so `written` is current), and "holds":
        what names the keys this folder holds (`megagrpo.checkpoint.base_folder`)."""
        return {**super().meta(), "base": f"../../{self.base.written}", "holds": ADAPTER_MARK}


def lora_parts(model: torch.nn.Module | list, config: ModelConfig, merges: Callable[[], int],
               *, tokenizer=None, extra: dict | None = None) -> dict[str, ModelState]:
    """{"base": ..., "policy": ...}: a LoRA policy's two parts, the base first (the policy's
    metadata names the base folder the save wrote or reused)."""
    base = BaseWeights(model, config, merges)
    return {"base": base,
            "policy": Adapters(model, config, base, tokenizer=tokenizer, extra=extra)}


def refuse_lora_init(init: str, model_json: Path) -> None:
    """run.init (`init`) must not be a LoRA run's checkpoint (its `model_json` says so): a new
    run does not load base + adapters."""
    if model_json.is_file() and json.loads(model_json.read_text()).get("lora"):
        raise ValueError(
            f"run.init={init!r} is a LoRA run's checkpoint (base + adapters), which a new run "
            "does not load; export it merged (megagrpo convert --from-megatron "
            f"{init} --to-hf DIR) and set run.init=DIR, or resume that run (run.resume)")


def checkpoint_lora(ckpt: str) -> LoRAConfig | None:
    """The LoRA settings a megagrpo checkpoint was saved with, or None (a full-parameter run's)."""
    from megagrpo.checkpoint import read_model_config

    meta = read_model_config(ckpt)[1].get("lora")
    return LoRAConfig(**meta) if meta else None


def check_peft_adapter(adapter_dir: str | None, ckpt: str | None, hf_dir: str | None) -> None:
    """`convert --peft-adapter DIR` needs a LoRA checkpoint (`--from-megatron`) and a folder of
    its own beside `--to-hf` (checked before any rank starts)."""
    if not adapter_dir:
        return
    if not ckpt:
        raise SystemExit("convert: --peft-adapter DIR exports a LoRA checkpoint's adapters; "
                         "it needs --from-megatron CKPT --to-hf DIR")
    if checkpoint_lora(ckpt) is None:
        raise SystemExit(f"convert: --peft-adapter: {ckpt} holds no LoRA "
                         "adapters (trained with lora.rank=0); drop --peft-adapter")
    if os.path.realpath(adapter_dir) == os.path.realpath(hf_dir):
        raise SystemExit("convert: --peft-adapter DIR must differ from --to-hf DIR (the base "
                         "goes to --to-hf, the adapter beside it)")
