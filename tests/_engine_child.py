"""A stand-in engine for tests/test_engine_process.py, started in the child process
`megagrpo.engine.process.EngineProcess` makes (importable there by name): it keeps the tensors
it is fed and answers from them."""
import os
import time

import torch

from megagrpo.engine import WeightSyncStats


class SumEngine:
    image_token_id, max_lora_rank, on_cpu = None, 0, True

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}

    def update_weights(self, named_tensors, partial: bool = False) -> WeightSyncStats:
        n = size = 0
        for item in named_tensors:
            for name, t in item if isinstance(item, list) else [item]:
                self.weights[name] = t.clone()
                n, size = n + 1, size + t.numel() * t.element_size()
        return WeightSyncStats(tensors=n, bytes=size, seconds=0.0, source_seconds=0.0,
                               load_seconds=0.0)

    def generate(self, prompts, sampling=None):
        """Per prompt: the float64 sum of every weight it holds, plus the prompt's last id."""
        total = sum(float(t.double().sum()) for t in self.weights.values())
        return [total + p[-1] for p in prompts]

    def fail(self) -> None:
        raise ValueError("bad argument, raised in the engine")

    def hang(self) -> None:
        time.sleep(3600)

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        pass
