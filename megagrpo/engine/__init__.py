"""The rollout engine: samples G completions per prompt and takes in-place weight updates.

- `types`: what callers exchange with an engine (`SamplingSettings`, `Completion`,
  `WeightSyncStats`) and the `RolloutEngine` protocol the trainer needs.
- `feed`: the HF names and shapes a weight update accepts (`expected_hf_params`) and the checked
  feed into vLLM's in-place reload.
- `vllm_compat`: the vLLM 0.32 workarounds (stale caches after a reload, OpenMP binding, stale
  shared memory, compiled helpers run eagerly).
- `vllm_engine`: `VLLMEngine`, vLLM inside the torchrun process that trains.
The engine's sampler streams live in `megagrpo.runtime.rng` (`EngineRng`).
"""
from megagrpo.engine.feed import expected_hf_params
from megagrpo.engine.types import Completion, RolloutEngine, SamplingSettings, WeightSyncStats
from megagrpo.engine.vllm_engine import VLLMEngine

__all__ = ["Completion", "RolloutEngine", "SamplingSettings", "VLLMEngine", "WeightSyncStats",
           "expected_hf_params"]
