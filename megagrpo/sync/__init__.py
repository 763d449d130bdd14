"""The weight sync: the policy's weights -> the rollout engines after each update.

- `source`: the sharded policy as (HF name, tensor) pairs in bounded buckets (full tensors or
  this rank's vLLM slices; also the HF export), `Feed`, `FullWeights`, `ShardSlices`;
- `transforms`: between source and transport (a dtype cast; each declares what it emits);
- `adapters`: a LoRA policy's side (adapter-only refits, the merge as a transform);
- `transports/`: one module per way to the engine (reload, inflight, collective, disk);
- `weight_sync`: `WeightSync` and `build_weight_sync`, what `megagrpo.run.setup` builds once.

Names are re-exported here and imported on first use (PEP 562): the HF export needs the
source without the LoRA side.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "source": ("Feed", "FullWeights", "ReshardStats", "ShardSlices", "export_hf",
               "iter_hf_weights", "iter_vllm_slices"),
    "transforms": ("CastDtype", "TensorMeta", "Transform", "expected_feed"),
    "weight_sync": ("WeightSync", "build_weight_sync"),
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)


def __dir__() -> list[str]:
    return __all__
