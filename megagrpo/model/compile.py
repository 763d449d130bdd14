"""`compute.compile_layers`: each megatron-core `TransformerLayer` of the policy and the reference
`torch.compile`d (inductor) as one graph, for the update and the scoring passes.

What stands between a megatron-core layer and one dynamo graph on CPU, and how it is removed:

- The CPU shim (`megagrpo.runtime.cpu_compat`) enters its torch function mode around the backward of
  megatron's tensor-parallel mapping Functions; entering a mode is a side effect dynamo cannot
  put in a traced backward. While dynamo traces, the shim's wrapper now leaves the mode alone
  (tracing runs inside the layer's scope already, and a compiled graph runs no Python modes).
- megatron-core's linear layers call `get_tensor_model_parallel_group_if_none(None)`, which
  warns (`warnings.warn(..., DeprecationWarning)`) on rank 0 at every call: a builtin dynamo
  will not trace. `_quiet_tp_group` answers the same group without the warning while tracing.
- The mappings' collectives (TP > 1: `torch.distributed.all_reduce` / all_gather on gloo) are
  traced by dynamo as functional collectives; nothing to do.

Shapes are dynamic (`dynamic=True`): micro-batches are trimmed to their longest row and packed
micro-batches change length every step, so a graph specialised on sizes would recompile at
every new length. Gradients equal the eager layer's to float rounding (tests/test_compile.py).
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from megagrpo.config.compile import (
    RunWork,
    auto_note,
    auto_reason,
    compile_blocker,
    compile_layers_on,
)
from megagrpo.config.model import ModelConfig

log = logging.getLogger("megagrpo")


def _quiet_tp_group(original: Callable) -> Callable:
    """megatron's `get_tensor_model_parallel_group_if_none` without its deprecation warning
    while dynamo traces (the same group: megatron's default TP group)."""
    @functools.wraps(original)
    def group(tp_group=None, is_expert=False, check_initialized=True):
        if tp_group is None and torch.compiler.is_compiling():
            from megatron.core import parallel_state as ps

            if not (torch.distributed.is_initialized() and ps.is_initialized()):
                return None if not torch.distributed.is_initialized() else tp_group
            if is_expert:
                return ps.get_expert_tensor_parallel_group(check_initialized=check_initialized)
            return ps.get_tensor_model_parallel_group(check_initialized=check_initialized)
        return original(tp_group, is_expert=is_expert, check_initialized=check_initialized)
    group.megagrpo_quiet = True
    return group


def make_traceable() -> None:
    """Installs `_quiet_tp_group` in megatron's tensor-parallel layers (once per process)."""
    from megatron.core.tensor_parallel import layers

    if not getattr(layers.get_tensor_model_parallel_group_if_none, "megagrpo_quiet", False):
        layers.get_tensor_model_parallel_group_if_none = _quiet_tp_group(
            layers.get_tensor_model_parallel_group_if_none)


def graph_count() -> int:
    """Graphs dynamo has compiled in this process so far (every frame, every recompile)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_layers(gpt: torch.nn.Module) -> int:
    """Replaces the forward of every `TransformerLayer` in `gpt` (this rank's stage) by its
    `torch.compile`d self (inductor, dynamic shapes); returns how many layers it compiled.
    Dynamo compiles at a layer's first call (its backward at the first backward)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    make_traceable()
    n = 0
    for module in gpt.modules():
        if (isinstance(module, TransformerLayer)
                and not hasattr(module.forward, "megagrpo_compiled")):
            eager = module.forward
            module.forward = _contiguous_input(torch.compile(eager, dynamic=True))
            module.megagrpo_forwards = (module.forward, eager)
            n += 1
    return n


def use_compiled(model: torch.nn.Module, on: bool) -> int:
    """Switches the layers `compile_layers` compiled in `model` to their compiled (on) or
    eager forward; returns how many it switched. Compiled graphs stay cached, so one process
    can time both paths step by step (benchmarks/grpo_step.py --compile-ab): separate
    processes on these VMs drift by more than the difference."""
    n = 0
    for module in model.modules():
        if hasattr(module, "megagrpo_forwards"):
            module.forward = module.megagrpo_forwards[0 if on else 1]
            n += 1
    return n


def _canonical(x: torch.Tensor) -> torch.Tensor:
    """`x` as a tensor of its own with the row-major strides of its shape (`x` itself when it
    is one already). Dynamo guards on an input's strides and on its base's when it is a view:
    the first layer gets the embedding's [s, b, h] as a transposed view, and torch calls a
    tensor with a size-1 dimension (one micro-batch row) contiguous whatever its stride there,
    so without this every new layout would be a recompile."""
    strides, step = [], 1
    for size in reversed(x.shape):
        strides.append(step)
        step *= size
    if x._base is None and x.stride() == tuple(reversed(strides)):
        return x
    return x.clone(memory_format=torch.contiguous_format)


def _contiguous_input(compiled: Callable) -> Callable:
    """`compiled` called on a contiguous `hidden_states`: the first layer gets the embedding's
    [s, b, h] as a transposed view, the others a contiguous tensor, and dynamo guards on the
    stride pattern (one graph for every layer instead of two)."""
    @functools.wraps(compiled)
    def run(*args, **kwargs):
        if "hidden_states" in kwargs:  # megatron's block passes it by name
            kwargs["hidden_states"] = _canonical(kwargs["hidden_states"])
        elif args:
            args = (_canonical(args[0]), *args[1:])
        return compiled(*args, **kwargs)
    run.megagrpo_compiled = True
    return run


def compiled_layers(model: torch.nn.Module) -> int:
    """Layers of `model` that `compile_layers` compiled (switched to eager or not)."""
    return sum(hasattr(m, "megagrpo_forwards") for m in model.modules())


def summary(layers: int) -> str:
    """One console line: what compiling `layers` layers cost so far in this process (dynamo's
    own accounting: graphs made, frame and backward compile seconds)."""
    from torch._dynamo.utils import calculate_time_spent

    spent = calculate_time_spent()
    graphs = graph_count()
    return (f"compute.compile_layers: {layers} layers compiled into {graphs} graphs "
            f"({graphs / max(1, layers):.1f} a layer, grad and no-grad passes counted apart); "
            f"compile time {spent.get('total_wall_time', 0.0):.1f} s (forward "
            f"{spent.get('entire_frame_compile', 0.0):.1f} s, backward "
            f"{spent.get('entire_backward_compile', 0.0):.1f} s)")


def compile_for_run(cfg, model: ModelConfig, gpt: torch.nn.Module, *, loud: bool,
                    work: RunWork) -> int:
    """compute.compile_layers for a run (`cfg`: its TrainConfig): the policy's layers compiled
    when the config says so (auto weighs the run's `work` against the compile); returns how many.
    `loud`: one console line says whether, and what 'auto' weighed."""
    cuda = torch.cuda.is_available()
    on = compile_layers_on(cfg.compute, model, cfg.parallel, lora=cfg.lora.enabled,
                           cuda=cuda, work=work)
    n = compile_layers(gpt) if on else 0
    if loud and cfg.compute.compile_layers is not False:  # set off: no line
        why = compile_blocker(cfg.compute, model, cfg.parallel, cfg.lora.enabled)
        auto = cfg.compute.compile_layers == "auto"
        log.info("compute.compile_layers=%s: %s", str(cfg.compute.compile_layers).lower(),
                 f"{n} layers torch.compile'd (inductor, dynamic shapes; compiled in the first "
                 "steps" + (f"; {auto_note(model, cfg.parallel, work)})" if auto else ")")
                 if on else "layers run eagerly (" + (
                     f"needs {why}" if why
                     else auto_reason(model, cfg.parallel, work, cuda)) + ")")
    return n


def compile_reference(reference, layers: int) -> None:
    """A reference of its own (`Reference.separate_model`) compiles like the policy when the
    policy's `layers` were; a LoRA reference is the policy itself."""
    if layers and reference is not None and reference.separate_model:
        compile_layers(reference.model)


class FirstStepLine:
    """The console line of what compiling cost, once, after the first step (which paid it)."""

    def __init__(self, layers: int, *, loud: bool):
        self.layers = layers if loud else 0

    def after_step(self) -> None:
        if self.layers:
            log.info("%s", summary(self.layers))
            self.layers = 0
