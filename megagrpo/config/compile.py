"""compute.compile_layers: where a compiled layer runs, and what 'auto' picks (pure config
rules; `megagrpo.compile` does the compiling)."""
from __future__ import annotations

from megagrpo.config.model import ModelConfig, ParallelConfig

AUTO_MIN_HIDDEN = 512
"""'auto' compiles dense models from this width up: measured faster there on the 2-core AVX-512
EPYC (benchmarks/layer_split.py --compile, midsize and SmolLM2 shapes); below it the layers'
GEMMs are small and the first step's compile is most of a short run."""


def compile_blocker(compute, model: ModelConfig, parallel: ParallelConfig,
                    lora: bool = False) -> str | None:
    """What keeps compute.compile_layers from running on this config (None: nothing)."""
    if model.is_moe:
        return ("a dense model (MoE layers route a data-dependent number of tokens to each "
                "expert: dynamo breaks the graph there)")
    if parallel.tp > 1:
        return ("parallel.tp=1 (dynamo traces megatron's tensor-parallel collectives as "
                "functional collectives on gloo; not checked against eager yet)")
    if compute.recompute == "full":
        return ("compute.recompute none or selective (megatron's full recomputation reruns "
                "the layers inside its own autograd Function; not checked under compile)")
    if lora:
        return "lora.enabled=false (the adapters are not checked against eager under compile)"
    if parallel.transformer_impl == "transformer_engine":
        return "parallel.transformer_impl local or auto (Transformer Engine's layers)"
    return None


def compile_layers_on(compute, model: ModelConfig, parallel: ParallelConfig, *, lora: bool,
                      cuda: bool) -> bool:
    """Whether the layers are compiled: compute.compile_layers, 'auto' resolved (CPU, no
    blocker, hidden_size >= AUTO_MIN_HIDDEN)."""
    if compute.compile_layers == "auto":
        return (not cuda and compile_blocker(compute, model, parallel, lora) is None
                and model.hidden_size >= AUTO_MIN_HIDDEN)
    return bool(compute.compile_layers)


def check_compile(compute, model: ModelConfig, parallel: ParallelConfig, lora: bool) -> None:
    """compute.compile_layers=true where it cannot run: a ValueError naming the fix."""
    if compute.compile_layers is not True:
        return
    why = compile_blocker(compute, model, parallel, lora)
    if why:
        raise ValueError(f"compute.compile_layers=true needs {why}; set "
                         "compute.compile_layers=false (or auto)")
