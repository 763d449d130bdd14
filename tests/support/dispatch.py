"""TorchDispatchModes that watch the aten ops a call runs: the tensors they produce (memory
bounds without a profiler) and how many matmuls they are."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

MATMULS = (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_)


class OpOutputs(TorchDispatchMode):
    """Records the shape and dtype of every tensor an op produces inside the `with` block."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[tuple[torch.Size, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.outputs.append((t.shape, t.dtype))
        return out

    def largest(self, keep: Callable[[torch.Size, torch.dtype], bool] | None = None) -> int:
        """Elements of the largest output that `keep(shape, dtype)` accepts (all: floating)."""
        sizes = [s.numel() for s, d in self.outputs
                 if (keep(s, d) if keep else d.is_floating_point)]
        return max(sizes, default=0)


class CountOps(TorchDispatchMode):
    """Counts the calls of the given ops (overload packets; default: the matmuls)."""

    def __init__(self, ops: tuple = MATMULS) -> None:
        super().__init__()
        self.ops = ops
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in self.ops:
            self.n += 1
        return func(*args, **(kwargs or {}))
