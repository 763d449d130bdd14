"""compute.compile_layers: where a compiled layer runs, and what 'auto' picks (pure config
rules; `megagrpo.compile` does the compiling)."""
from __future__ import annotations

from megagrpo.config.model import ModelConfig, ParallelConfig

AUTO_MAX_HIDDEN = 256
"""'auto' compiles dense models up to this width: whole GRPO steps with the layers compiled and
eager, alternated in one process (`benchmarks/grpo_step.py --compile-ab`,
benchmarks/results/compile_ab_cpu.jsonl, a 2-core AMD EPYC), spent 0.70-0.84x the eager
scoring + update at hidden 64-256 (per-op overhead and element-wise work are much of a small
layer's pass, and fusing them is what compiling buys), 0.97x at 512 and 1.05-1.52x (slower) on
SmolLM2's 30 layers of 576, where the GEMMs set the time."""

AUTO_MIN_STEPS = 200
"""... in runs of at least this many optimizer steps (run.steps + cold_start.steps): the first
steps pay 10-15 s of compile on 2 cores, repaid after 20-173 steps at those widths (the
table's "steps to repay")."""


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
                      cuda: bool, steps: int) -> bool:
    """Whether the layers are compiled: compute.compile_layers, 'auto' resolved (CPU, fp32,
    no blocker, hidden_size <= AUTO_MAX_HIDDEN, `steps` >= AUTO_MIN_STEPS)."""
    if compute.compile_layers == "auto":
        return (compile_blocker(compute, model, parallel, lora) is None
                and auto_reason(model, steps, cuda) is None)
    return bool(compute.compile_layers)


def auto_reason(model: ModelConfig, steps: int, cuda: bool) -> str | None:
    """Why 'auto' leaves the layers of a config without a blocker eager (console), None where
    it compiles them: the rule itself."""
    if cuda:
        return "auto compiles on CPU only (not measured on GPUs)"
    if model.dtype != "float32":
        return f"auto compiles float32 models only (measured there; this one is {model.dtype})"
    if model.hidden_size > AUTO_MAX_HIDDEN:
        return (f"auto compiles up to hidden_size {AUTO_MAX_HIDDEN}: measured no faster at "
                "512-576, benchmarks/results/compile_ab_cpu.jsonl")
    if steps < AUTO_MIN_STEPS:
        return (f"auto compiles runs of {AUTO_MIN_STEPS} steps or more (run.steps + "
                f"cold_start.steps = {steps}): a shorter one does not repay the first step's "
                "compile")
    return None


def check_compile(compute, model: ModelConfig, parallel: ParallelConfig, lora: bool) -> None:
    """compute.compile_layers=true where it cannot run: a ValueError naming the fix."""
    if compute.compile_layers is not True:
        return
    why = compile_blocker(compute, model, parallel, lora)
    if why:
        raise ValueError(f"compute.compile_layers=true needs {why}; set "
                         "compute.compile_layers=false (or auto)")
