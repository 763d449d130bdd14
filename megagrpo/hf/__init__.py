"""Hugging Face interop, in two modules, over the parameter layout:
- `config`: HF config.json <-> ModelConfig (reading with refusals, writing, RoPE);
- `io`: checkpoint files <-> megatron shards (reading slices, loading, writing, checking);
- the model's parameter layout, written once (HF tensor names <-> megatron parameters, shapes,
  TP/EP splits, the pipeline split) and what derives from it, is `megagrpo.config.params`
  (pure arithmetic on the config, which LoRA's and the planner's counts read too); its names
  are re-exported here.

The names below are re-exported here and imported on first use (PEP 562), so that `config` and
`params`, which need no torch, stay cheap for the launcher and the planner; `io` loads torch and
safetensors only where tensors move.
"""
from __future__ import annotations

import importlib

_EXPORTS = {  # module -> the names it lends this package
    "megagrpo.hf.config": (
        "HF_ARCHITECTURES", "MODEL_TYPES", "hf_config_dict", "model_config_from_hf",
        "model_config_from_hf_dict"),
    "megagrpo.config.params": (
        "ParamSpec", "embedding_specs", "head_specs", "hf_shapes", "layer_specs", "param_specs",
        "qkv_rows", "rank_numel", "split_numels", "stage_layers", "vllm_feed_shapes"),
    "megagrpo.hf.io": (
        "HFCheckpoint", "check_hf_checkpoint", "expert_parallel_rank", "fuse_qkv",
        "load_hf_weights", "read_shard", "save_hf_dir", "slice_pairs", "split_qkv",
        "unfuse_shards"),
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name]), name)


def __dir__() -> list[str]:
    return __all__
