"""megagrpo.runtime.rng: every stream put back as captured, the engine's sampler streams apart from
the trainer's (main thread and async thread), and the CPU shim's mode entered only inside its scope.

The references are plain generators seeded as each stream is documented to be (torch's default
generator for the engine's main-thread stream, a fresh Generator at seed + 1 for its thread
stream) and the draws made before a restore. The shim checks run in a child process: installing
the shim patches torch.cuda and megatron-core for the whole process."""
from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
import torch

from megagrpo.runtime.rng import EngineRng, capture_rng, kept, restore_rng

SEED = 13


class _Engine:
    """The part of VLLMEngine that checkpoints hold: its sampler streams."""

    def __init__(self, seed: int) -> None:
        self.rng = EngineRng(seed)

    def rng_state(self) -> dict[str, torch.Tensor]:
        return self.rng.state_dict()

    def set_rng_state(self, state: Mapping[str, torch.Tensor]) -> None:
        self.rng.load_state_dict(state)


def _draw_all(engine: _Engine) -> list:
    """One draw from every stream: python, numpy, torch, the engine's main and thread streams."""
    out = [random.random(), float(np.random.rand()), torch.rand(4)]
    with engine.rng.sampling():
        out.append(torch.rand(4))
    side: list = []
    t = threading.Thread(target=_side_draw, args=(engine, side))
    t.start()
    t.join()
    return out + side


def _side_draw(engine: _Engine, out: list) -> None:
    with engine.rng.sampling():
        out.append(torch.rand(4))
        out.append(torch.empty(6).exponential_())


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


def test_capture_draw_restore_draw_is_equal():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    engine = _Engine(SEED)
    state = capture_rng(engine)
    first = _draw_all(engine)
    moved = _draw_all(engine)
    assert not _same(first, moved)  # every stream moves on: the restore below has work to do
    restore_rng(state, engine)
    assert _same(_draw_all(engine), first)


def test_kept_leaves_every_stream_where_it_was():
    engine = _Engine(SEED)
    state = capture_rng(engine)
    expected = _draw_all(engine)
    restore_rng(state, engine)
    with kept(engine):
        _draw_all(engine)
        _draw_all(engine)
    assert _same(_draw_all(engine), expected)


def test_engine_main_stream_is_its_own_and_leaves_the_callers():
    engine = _Engine(SEED)
    ref = torch.Generator().manual_seed(SEED)  # the engine's stream: torch's default at SEED
    torch.manual_seed(7)
    caller = torch.rand(5)
    torch.manual_seed(7)
    for _ in range(2):  # two calls: the second continues where the first stopped
        with engine.rng.sampling():
            got = torch.rand(3)
        assert torch.equal(got, torch.rand(3, generator=ref))
    assert torch.equal(torch.rand(5), caller)  # the caller's stream did not move


def test_async_thread_draws_from_its_own_generator_and_leaves_the_main_stream():
    """The side thread's sampler draws from the engine's thread generator (seed + 1) even while
    the main thread draws from and reseeds the process-global generator (as megatron's tracker
    forks do), and the main thread's stream is exactly as if no thread ran."""
    engine = _Engine(SEED)
    ref = torch.Generator().manual_seed(SEED + 1)
    expected = [torch.rand(4, generator=ref), torch.empty(6).exponential_(generator=ref)]
    torch.manual_seed(21)
    alone = [torch.rand(8) for _ in range(50)]
    torch.manual_seed(21)
    side: list = []
    t = threading.Thread(target=_side_draw, args=(engine, side))
    t.start()
    main = [torch.rand(8) for _ in range(50)]
    t.join()
    assert _same(side, expected)
    assert _same(main, alone)


def test_engine_state_for_another_device_kind_is_refused():
    engine = _Engine(SEED)
    state = dict(engine.rng.state_dict(), cuda=torch.zeros(16, dtype=torch.uint8))
    if torch.cuda.is_available():
        state.pop("cuda")
    with pytest.raises(ValueError, match="saved sampler state"):
        engine.rng.load_state_dict(state)


# ---------------------------------------------------------------------- the CPU shim's scope
def _shim_checks() -> None:
    """Run in a child process (installs the shim): prints one line per check, 'ok' last."""
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megagrpo.runtime import cpu_compat

    assert cpu_compat.apply() and cpu_compat.active()

    def cuda_alloc() -> torch.Tensor:
        return torch.empty(2, device="cuda")

    def refused() -> bool:
        try:
            cuda_alloc()
        except (AssertionError, RuntimeError):
            return True
        return False

    assert refused(), "the mode leaked out of a scope: device='cuda' gave a tensor"
    with cpu_compat.megatron_scope():
        inside = cuda_alloc()
        assert inside.device.type == "cpu" and inside.shape == (2,)
        assert cpu_compat.unscoped(refused), "unscoped code still ran under the mode"
        with cpu_compat.megatron_scope():  # nested: one mode, still on after the inner exits
            pass
        assert cuda_alloc().device.type == "cpu"
        other: list = []
        t = threading.Thread(target=lambda: other.append(refused()))
        t.start()
        t.join()
        assert other == [True], "another thread ran under this thread's scope"
    assert refused(), "the mode stayed on after its scope"

    class Probe(MegatronModule):  # a megatron-core module allocates on "cuda" in its forward
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.ones(2, device=torch.cuda.current_device())

    probe = Probe(config=TransformerConfig(num_layers=1, hidden_size=8,
                                           num_attention_heads=1))
    assert torch.equal(probe(torch.zeros(2)), torch.ones(2))  # its call is scoped
    assert refused(), "a megatron module's call left the mode on"
    print("ok")


def test_cpu_shim_mode_is_scoped():
    if torch.cuda.is_available():
        pytest.skip("the CPU shim is installed only without CUDA")
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, __file__, "shim"], capture_output=True, text=True,
                          timeout=180, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


if __name__ == "__main__" and sys.argv[1:] == ["shim"]:
    _shim_checks()
