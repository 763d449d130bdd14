"""Runs megatron-core on machines without CUDA. Installed by `megagrpo.runtime.distributed` only
when `torch.cuda.is_available()` is False; the megagrpo functions that call megatron-core enter its
scope (`megatron_scope`), which does nothing where CUDA is present.

megatron-core hard-codes CUDA in places that are device-agnostic in spirit (see
../shared/FINDINGS.md). This module neutralises exactly these, and no more:

1. Factory calls with ``device="cuda"`` / ``torch.cuda.current_device()`` (an int) /
   ``torch.device("cuda", i)``, and ``Tensor.cuda()`` / ``Tensor.to("cuda")``: a
   `TorchFunctionMode` maps them to CPU (tensor_parallel layers, mappings, rotary embedding,
   p2p communication, schedules, clip_grads, ``get_default_causal_mask``). The autograd engine
   runs backward without Python modes: the backward of every autograd Function of megatron's
   ``tensor_parallel.mappings``, ``tensor_parallel.random`` (activation recomputation) and MoE
   modules runs under the mode explicitly, and that of its linear layers
   (``tensor_parallel.layers``) under sequence parallelism (its reduce-scatter buffer).
2. ``torch.cuda.current_device`` returns 0; ``torch.cuda.synchronize`` and
   ``torch.cuda.empty_cache`` are no-ops.
3. The model-parallel RNG tracker (``tensor_parallel/random.py``) reads and writes the CUDA RNG:
   ``torch.cuda.{get_rng_state, set_rng_state, manual_seed}`` and megatron's
   ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` are redirected to the CPU generator.
4. CUDA streams (the MoE alltoall token dispatcher copies its split sizes to the host on a side
   stream, ``token_dispatcher.py``): ``torch.cuda.Stream`` / ``current_stream`` / ``stream``
   become one do-nothing stream (CPU ops are synchronous) and ``Tensor.record_stream`` a no-op;
   its ``maybe_move_tensor_to_cpu`` converts split sizes to numpy only for CUDA tensors, so on
   CPU they reached ``all_to_all_single`` as tensors (a TypeError): converted here too.
6. Uneven first-dim all-gather / reduce-scatter over TP (``tensor_parallel.mappings`` with
   split sizes; the MoE alltoall dispatcher's token exchange under sequence parallelism): gloo
   has no uneven all_gather or list reduce_scatter, so the chunks are padded to the largest
   (all-gather) or summed with one all_reduce of the padded chunks (reduce-scatter).
5. ``Tensor.type()`` of a CPU float tensor reports the CUDA type string
   (``clip_grads.py`` asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``, the
   float16/distributed optimizers check similar strings).

The mode of 1. is scoped: `megatron_scope()` (a context manager and decorator) enters it on the
calling thread around the megagrpo functions that call megatron-core (parallel_state start-up,
the model build, DDP, the optimizer, the forward/backward schedule, dist-checkpointing) and
around every call of a megatron-core module (`MegatronModule.__call__`), and `unscoped` leaves
it for megagrpo's own code that megatron calls back (the loss kernels). vLLM, the kernels, the
weight feed and the async rollout thread run on plain torch: no Python call per op there, and
a ``device="cuda"`` outside megatron fails on a CPU machine as it would without the shim. The
patches of 2.-5. are plain function replacements and stay process-wide.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def _is_cuda(device: object) -> bool:
    if isinstance(device, int):
        return True  # only torch.cuda.current_device() hands out bare ints here
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpu(TorchFunctionMode):
    """Maps CUDA device arguments to CPU and reports CUDA type strings for CPU tensors."""


    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.record_stream:
            return None
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            if name.startswith("torch.cuda."):
                return name
            return name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def _in_mode(fn):
    """`fn` (an autograd Function's static backward) run under the mode: the autograd engine
    does not carry Python function modes into backward, and megatron's communication
    Functions allocate with device=torch.cuda.current_device() there (the MoE all-to-all, the
    gather of the reduce-scatter's backward)."""
    def wrapped(*args, **kwargs):
        # traced by dynamo (a compiled layer's backward): the graph runs no Python modes, and
        # tracing happens inside the layer's scope already (entering one is a side effect
        # dynamo cannot put in the backward's graph)
        if torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        with _CudaToCpu():
            return fn(*args, **kwargs)
    return wrapped


def _sequence_parallel_backward_in_mode(cls) -> None:
    """`cls.backward` (megatron's linear autograd Function) under the mode only where its
    context says sequence parallelism (the reduce-scatter buffer is allocated on
    torch.cuda.current_device()); every other linear backward stays on plain torch."""
    backward = cls.backward

    def wrapped(ctx, *args):
        if getattr(ctx, "sequence_parallel", False):
            with _CudaToCpu():
                return backward(ctx, *args)
        return backward(ctx, *args)
    cls.backward = staticmethod(wrapped)


def _backward_in_mode(module) -> None:
    """Wraps the backward of every autograd Function defined in `module`."""
    for obj in list(vars(module).values()):
        if (isinstance(obj, type) and issubclass(obj, torch.autograd.Function)
                and obj.__module__ == module.__name__ and "backward" in vars(obj)):
            obj.backward = staticmethod(_in_mode(obj.backward))


class _CpuStream:
    """Stands in for torch.cuda.Stream / Event on CPU, where every op is synchronous."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> _CpuStream:
        return self

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_STREAM = _CpuStream()


class _NoStreamContext:
    def __init__(self, stream=None):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


def _host_tensor(tensor, as_numpy: bool = False, record_stream: bool = False):
    """moe_utils.maybe_move_tensor_to_cpu for tensors that already are on the host."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _uneven_gather(original: Callable) -> Callable:
    """mappings._gather_along_first_dim with uneven `output_split_sizes` on gloo (6.)."""
    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        most = max(output_split_sizes)
        padded = input_.new_zeros((most, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in output_split_sizes]
        torch.distributed.all_gather(parts, padded, group=group)
        return torch.cat([p[:n] for p, n in zip(parts, output_split_sizes)])
    return gather


def _uneven_reduce_scatter(original: Callable) -> Callable:
    """mappings._reduce_scatter_along_first_dim with `input_split_sizes` on gloo (6.)."""
    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return original(input_, group, input_split_sizes, use_global_buffer)
        most = max(input_split_sizes)
        stacked = input_.new_zeros((len(input_split_sizes), most, *input_.shape[1:]))
        for i, chunk in enumerate(torch.split(input_, input_split_sizes, dim=0)):
            stacked[i, : chunk.shape[0]] = chunk
        torch.distributed.all_reduce(stacked, group=group)
        rank = group.rank()
        return stacked[rank, : input_split_sizes[rank]].clone()
    return reduce_scatter


def _get_rng_state(*args, **kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _set_rng_state(new_state: torch.Tensor, *args, **kwargs) -> None:
    torch.set_rng_state(new_state)


def _manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def _empty_cache() -> None:
    """torch.cuda.empty_cache: nothing is cached on the host."""


def active() -> bool:
    """Whether the shim is installed in this process (`apply` ran on a machine without CUDA)."""
    return torch.cuda.empty_cache is _empty_cache


def _entered() -> bool:
    """Whether this thread runs inside a `megatron_scope` already."""
    stack = torch.overrides._get_current_function_mode_stack()
    return any(isinstance(mode, _CudaToCpu) for mode in stack)


@contextlib.contextmanager
def megatron_scope() -> Iterator[None]:
    """The block (or, as a decorator, the function) runs megatron-core code: with the shim
    installed, the device mapping of 1. is on for it on this thread; otherwise (a CUDA machine,
    or already inside a scope) this does nothing."""
    if not active() or _entered():
        yield
        return
    with _CudaToCpu():
        yield


def unscoped(fn: Callable[..., Any], *args, **kwargs) -> Any:
    """`fn(*args, **kwargs)` with the scope's mode left while it runs: megagrpo code that
    megatron-core calls back (the loss and its kernels, called by the schedule) runs on plain
    torch. Only the innermost mode is left, and only when it is the shim's."""
    if not isinstance(torch.overrides._get_current_function_mode(), _CudaToCpu):
        return fn(*args, **kwargs)
    with torch.overrides._pop_mode_temporarily():
        return fn(*args, **kwargs)


def _scoped_module_call(self, *args, **kwargs):
    """`MegatronModule.__call__`: every megatron-core module (the model, its layers, DDP, a
    DotProductAttention called on its own) runs its forward inside `megatron_scope`."""
    with megatron_scope():
        return torch.nn.Module.__call__(self, *args, **kwargs)


def apply() -> bool:
    """Installs the shim once per process (the mode itself is entered by `megatron_scope`).
    Returns True if it was (or already is) installed."""
    if torch.cuda.is_available():
        return False
    if active():
        return True
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.get_rng_state = _get_rng_state
    torch.cuda.set_rng_state = _set_rng_state
    torch.cuda.manual_seed = _manual_seed
    torch.cuda.random.get_rng_state = _get_rng_state
    torch.cuda.random.set_rng_state = _set_rng_state
    torch.cuda.Stream = _CpuStream
    torch.cuda.current_stream = lambda *a, **k: _STREAM
    torch.cuda.stream = _NoStreamContext

    from megatron.core.tensor_parallel import random as mp_random

    mp_random._get_cuda_rng_state = _get_rng_state
    mp_random._set_cuda_rng_state = _set_rng_state
    from megatron.core.tensor_parallel import layers as tp_layers
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    for module in (mappings, mp_random, moe_utils, token_dispatcher):
        _backward_in_mode(module)
    _sequence_parallel_backward_in_mode(tp_layers.LinearWithGradAccumulationAndAsyncCommunication)
    mappings._gather_along_first_dim = _uneven_gather(mappings._gather_along_first_dim)
    mappings._reduce_scatter_along_first_dim = _uneven_reduce_scatter(
        mappings._reduce_scatter_along_first_dim)
    moe_utils.maybe_move_tensor_to_cpu = _host_tensor
    token_dispatcher.maybe_move_tensor_to_cpu = _host_tensor
    MegatronModule.__call__ = _scoped_module_call
    torch.cuda.empty_cache = _empty_cache  # last: `active()` reads it
    return True
