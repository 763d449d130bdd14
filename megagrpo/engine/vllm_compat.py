"""Workarounds for vLLM 0.32 (and its CPU build) that the engine applies around start-up, weight
updates and sampling; each says what vLLM does and why megagrpo cannot leave it:
- `_packed_modules_mapping`, `_refresh_tied_modules`, `_refresh_moe_layers`: run on the vLLM
  worker (collective_rpc); after an in-place reload, modules whose weights vLLM repacks on the
  first load only (a tied lm_head, the CPU MoE experts, a fused shared-expert gate) are
  re-processed.
- `_set_omp_binding`: one core list per local rank for vLLM CPU's OpenMP threads.
- `_remove_stale_shm`: shared-memory files a crashed TP>1 CPU run left behind.
- `_run_compiled_helpers_eagerly`: two helpers vLLM torch.compiles even with enforce_eager run
  eagerly (Dynamo's process-global is-compiling flag changed torch Adam's rounding on the trainer
  thread while the async rollout thread traced them).
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def _packed_modules_mapping(worker) -> dict[str, list[str]]:
    """Runs on the vLLM worker: which HF tensors vLLM fuses into one layer (q/k/v -> qkv)."""
    model = worker.model_runner.get_model()
    return {k: list(v) for k, v in (getattr(model, "packed_modules_mapping", None) or {}).items()}


def _refresh_tied_modules(worker) -> int:
    """Runs on the vLLM worker after a reload: re-process modules that share a parameter.

    With tied embeddings vLLM loads `embed_tokens` only; `lm_head` gets no weights, so the
    in-place reload never re-runs its process_weights_after_loading, and on CPU that is where
    the GEMM weight is packed: the head would keep computing logits from the start-up (dummy)
    weights. Returns how many modules were re-processed."""
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in worker.model_runner.get_model().modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(module)
    count = 0
    for modules in owners.values():
        for module in modules if len(modules) > 1 else ():
            method = getattr(module, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(module)
                count += 1
    return count + _refresh_moe_layers(worker.model_runner.get_model())


def _refresh_moe_layers(model: torch.nn.Module) -> int:
    """vLLM 0.32's in-place reload leaves two MoE caches stale (its first load fills them, a
    weight update does not):
    - the CPU experts (`CPUUnquantizedExperts`) prepack w13/w2 into their grouped-GEMM layout
      when the kernel is built, i.e. on the first load only; an update copies the new weights
      into that storage unpacked, and the kernel reads them as packed (measured: a 0.017 mean
      log-prob gap to transformers on a tiny Qwen3-MoE, 5e-7 after re-packing). The prepack is
      re-run here;
    - a router fused with a shared-expert gate (Qwen2-MoE) is concatenated once, on the first
      forward (`MoERunner._combined_gate_weight`): cleared, so the next forward rebuilds it.
    Returns how many modules were refreshed."""
    count = 0
    for module in model.modules():
        if getattr(module, "_combined_gate_weight", None) is not None:
            module._combined_gate_weight = None
            count += 1
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and type(experts).__name__.endswith("CPUUnquantizedExperts"):
            experts.process_weights_after_loading(module)
            count += 1
    return count


def _set_omp_binding(tp: int) -> None:
    """Give each local rank its own cores for vLLM's OpenMP threads (unless the user set
    VLLM_CPU_OMP_THREADS_BIND). TP>1 needs one core list per rank of the engine ('0|1' on 2
    cores); TP=1 engines on several local ranks would otherwise all bind the same cores."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ or (tp == 1 and local_world == 1):
        return
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // local_world)
    chunks = [cores[i * per:(i + 1) * per] or cores[-1:] for i in range(local_world)]
    masks = [",".join(map(str, c)) for c in chunks]
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(masks) if tp > 1 else masks[local_rank]


def _remove_stale_shm(engine_ranks: list[int], engine_rank: int) -> None:
    """external_launcher on CPU names its shared-memory segments after a fixed identifier and
    the engine's global ranks (/dev/shm/-tp:0-[2-3]-cpushm_<rank in the engine>), and they
    outlive a crashed (or os._exit-ed) run, so the next start fails with "create shm in
    SHMManager failed. errno: 17". Remove this rank's leftovers first (only its own: another
    engine's rank of the same engine index is creating its file at the same time). Two TP>1
    CPU jobs on one machine at once would collide either way (vLLM's fixed identifier)."""
    shm = Path("/dev/shm")
    ranks = "-".join(map(str, engine_ranks))
    for f in shm.glob(f"*-[[]{ranks}[]]-cpushm_{engine_rank}") if shm.is_dir() else ():
        with contextlib.suppress(OSError):
            f.unlink()
            log.warning("removed stale vLLM shared-memory file %s", f)


# vLLM helpers wrapped in torch.compile even with enforce_eager (module, name). They compile on
# first use per shape, and while Dynamo traces, torch.compiler.is_compiling() is true in the
# whole process: on another thread torch's Adam then takes its traced-graph path (the step as a
# float32 tensor) and rounds the update differently, so an async run (sampling on the side
# thread while the trainer steps) would not reproduce. They are tiny pointwise ops: run eagerly.
_COMPILED_HELPERS = (("vllm.v1.sample.ops.logprobs", "batched_count_greater_than"),
                     ("vllm.model_executor.layers.vocab_parallel_embedding",
                      "get_masked_input_and_mask"))


def _run_compiled_helpers_eagerly() -> None:
    """Rebinds each helper of `_COMPILED_HELPERS`, wherever vLLM imported it, to its
    uncompiled function."""
    for module, name in _COMPILED_HELPERS:
        compiled = getattr(importlib.import_module(module), name)
        eager = getattr(compiled, "_torchdynamo_orig_callable", None)
        if eager is None:  # not (or no longer) compiled in this vLLM
            continue
        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("vllm") and \
                    getattr(mod, name, None) is compiled:
                setattr(mod, name, eager)
