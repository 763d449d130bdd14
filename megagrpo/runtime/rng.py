"""Every random stream of a rank, in one module: seeding, checkpointing, and keeping streams apart.

A rank's streams: python's `random`, numpy's global generator, torch's default CPU (and CUDA)
generators, megatron-core's model-parallel RNG tracker (named CUDA generator states; without CUDA
the shim redirects them to the CPU generator, `megagrpo.runtime.cpu_compat`), and the vLLM engine's
sampler (`EngineRng`).

- Seeding: `seed_process` (the run's start), `seed_tracker` (megatron's tracker, when
  parallel_state starts), `seed_model_init` (a model's random init: the same weights at any
  layout), `seed_rank` (after vLLM started, which seeds the global streams itself).
- Checkpoints: `capture_rng` / `restore_rng` (every stream of this rank), `RankRng` (the same as
  a Stateful part), `kept` (a block that leaves every stream as it found it).
- Apart: `preserve_global_rng` (python, numpy and torch put back after the block: vLLM's start
  seeds them), `EngineRng.sampling` (vLLM's sampler draws from the engine's own streams, never the
  trainer's) and `ThreadGenerator` (the async rollout thread's random ops get the engine's thread
  generators: the trainer swaps the process-global generator meanwhile, in megatron's tracker
  forks, so drawing from it there would depend on timing).
"""
from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Iterator, Mapping
from typing import Protocol

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from megagrpo.runtime import cpu_compat


# ---------------------------------------------------------------------- seeding
def seed_process(seed: int) -> None:
    """Python's and torch's global streams, before anything of the run draws."""
    torch.manual_seed(seed)
    random.seed(seed)


def seed_tracker(seed: int) -> None:
    """megatron-core's model-parallel RNG tracker (and the CUDA generator) from `seed`: the
    tracker's streams differ per TP rank, the default one per DP. Needs parallel_state."""
    from megatron.core import tensor_parallel

    with cpu_compat.megatron_scope():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def seed_model_init(seed: int) -> None:
    """The streams a model's random init draws from: the same weights for the same seed."""
    seed_tracker(seed)
    torch.manual_seed(seed)


def seed_rank(seed: int, rank: int) -> None:
    """After vLLM started (it reseeds the global streams): megatron's tracker back on the run's
    seed, torch and numpy on this rank's (megagrpo draws nothing from numpy; seeded so that every
    stream of a run reproduces)."""
    seed_tracker(seed)
    torch.manual_seed(seed + rank)
    np.random.seed(seed + rank)


# ---------------------------------------------------------------------- checkpoints
class SamplerStreams(Protocol):
    """An engine whose sampler streams are part of the rank's (`VLLMEngine`)."""

    def rng_state(self) -> dict[str, torch.Tensor]: ...

    def set_rng_state(self, state: Mapping[str, torch.Tensor]) -> None: ...


def capture_rng(engine: SamplerStreams | None = None) -> dict:
    """Every random stream of this rank: python, numpy, torch (CPU and CUDA), megatron's
    model-parallel tracker, and the vLLM engine's sampler (`engine.rng_state()`)."""
    from megatron.core import tensor_parallel

    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": (version, torch.tensor(mt, dtype=torch.int64), gauss),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": dict(tensor_parallel.get_cuda_rng_tracker().get_states()),
        "engine": engine.rng_state() if engine is not None else None,
    }


def restore_rng(state: dict, engine: SamplerStreams | None = None) -> None:
    """Puts every stream `capture_rng` recorded back."""
    from megatron.core import tensor_parallel

    version, mt, gauss = state["python"]
    random.setstate((version, tuple(int(x) for x in mt.tolist()), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(dict(state["tracker"]))
    if engine is not None and state["engine"] is not None:
        engine.set_rng_state(state["engine"])


class RankRng:
    """This rank's random streams as a Stateful object (`capture_rng` / `restore_rng`)."""

    def __init__(self, engine: SamplerStreams | None = None) -> None:
        self.engine = engine

    def state_dict(self) -> dict:
        return capture_rng(self.engine)

    def load_state_dict(self, state: dict) -> None:
        restore_rng(state, self.engine)


@contextlib.contextmanager
def kept(engine: SamplerStreams | None = None) -> Iterator[None]:
    """Every stream of this rank (`capture_rng`) as it was before the block, after it: for work
    that must not move them (a resumed run's weight sync and evaluation, which the run it
    continues never did)."""
    state = capture_rng(engine)
    try:
        yield
    finally:
        restore_rng(state, engine)


# ---------------------------------------------------------------------- keeping streams apart
@contextlib.contextmanager
def preserve_global_rng() -> Iterator[None]:
    """Python's, numpy's and torch's global streams put back after the block."""
    state = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
             torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    try:
        yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.set_rng_state(state[2])
        if state[3] is not None:
            torch.cuda.set_rng_state_all(state[3])


class ThreadGenerator(TorchFunctionMode):
    """Torch-function mode (thread-local, like every mode) that gives the random ops called
    without a generator this thread's own, one per device type: vLLM's sampler on the async
    rollout thread draws from it instead of the process-global generator."""

    RANDOM_OPS = frozenset({
        torch.rand, torch.randn, torch.randint, torch.randperm, torch.multinomial,
        torch.bernoulli, torch.normal, torch.Tensor.exponential_, torch.Tensor.uniform_,
        torch.Tensor.normal_, torch.Tensor.random_, torch.Tensor.bernoulli_,
        torch.Tensor.geometric_, torch.Tensor.log_normal_, torch.Tensor.cauchy_})

    def __init__(self, generators: Mapping[str, torch.Generator]) -> None:
        super().__init__()
        self.generators = generators

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in self.RANDOM_OPS and kwargs.get("generator") is None:
            on = args[0] if args and isinstance(args[0], torch.Tensor) else None
            device = on.device if on is not None else torch.device(kwargs.get("device") or "cpu")
            kwargs["generator"] = self.generators[device.type]
        return func(*args, **kwargs)


class EngineRng:
    """The vLLM engine's sampler streams, apart from the trainer's. `sampling()` runs the sampler
    on them: on the main thread the engine's torch state (the same on every rank of a vLLM TP
    group: seeded from rollout.seed) is swapped into torch's default generators for the block
    and the caller's streams are put back after it; on another thread (async rollout) swapping
    process-global state would race with the trainer, so there `ThreadGenerator` hands every
    random op the engine's thread generators (seeded from rollout.seed + 1)."""

    def __init__(self, seed: int) -> None:
        with preserve_global_rng():
            torch.manual_seed(seed)
            cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
            # the main thread's sampler state: (CPU ByteTensor, CUDA ByteTensor or None)
            self.main: tuple[torch.Tensor, torch.Tensor | None] = (torch.get_rng_state(), cuda)
        # the side thread's generators, by device type
        self.threads: dict[str, torch.Generator] = {"cpu": torch.Generator().manual_seed(seed + 1)}
        if torch.cuda.is_available():
            self.threads["cuda"] = torch.Generator("cuda").manual_seed(seed + 1)

    @contextlib.contextmanager
    def sampling(self) -> Iterator[None]:
        """The block's random ops draw from the engine's streams (see the class docstring)."""
        if threading.current_thread() is not threading.main_thread():
            with ThreadGenerator(self.threads):
                yield
            return
        with preserve_global_rng():
            torch.set_rng_state(self.main[0])
            if self.main[1] is not None:
                torch.cuda.set_rng_state(self.main[1])
            yield
            cuda = torch.cuda.get_rng_state() if self.main[1] is not None else None
            self.main = (torch.get_rng_state(), cuda)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """{"cpu": ByteTensor, "cuda": ByteTensor when on GPU, "thread_<device>": ...}."""
        state = {"cpu": self.main[0].clone()}
        if self.main[1] is not None:
            state["cuda"] = self.main[1].clone()
        state.update({f"thread_{d}": g.get_state() for d, g in self.threads.items()})
        return state

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Continue from a state `state_dict` returned (same device kind)."""
        if ("cuda" in state) != (self.main[1] is not None):
            raise ValueError("VLLMEngine.set_rng_state: the saved sampler state is for "
                             f"{'GPU' if 'cuda' in state else 'CPU'}, this engine runs on "
                             f"{'GPU' if self.main[1] is not None else 'CPU'}")
        self.main = (state["cpu"].clone(), state["cuda"].clone() if "cuda" in state else None)
        for d, g in self.threads.items():
            if f"thread_{d}" in state:  # absent in checkpoints of older megagrpo
                g.set_state(state[f"thread_{d}"])
