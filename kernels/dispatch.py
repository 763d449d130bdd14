"""Choose between the Triton kernels and the chunked pure-torch path, and say which one runs.

Rule: Triton on CUDA tensors, or on any tensor when the Triton interpreter is on
(``TRITON_INTERPRET=1`` set before triton was imported); the torch path otherwise. An explicit
``impl="triton" | "torch"`` overrides the rule (tests, benchmarks) and fails loudly when Triton
cannot run the tensor. Each (op, path) pair is logged once at INFO level, so a run's log always
says which path it took: there is no silent fallback.
"""
from __future__ import annotations

import logging
import os
from typing import NamedTuple

import torch

try:  # triton is optional on CPU machines; the torch path needs nothing else.
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the environment
    HAS_TRITON = False

# Triton reads TRITON_INTERPRET when @triton.jit decorates, i.e. when the kernel modules are
# imported; reading it once here keeps the dispatch consistent with how the kernels were built.
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

IMPLS = ("auto", "triton", "torch")
_log = logging.getLogger("megagrpo.kernels")
_logged: set[tuple[str, str]] = set()


def triton_can_run(tensor: torch.Tensor) -> bool:
    """True when a Triton kernel can be launched on ``tensor``'s device."""
    return HAS_TRITON and (tensor.is_cuda or TRITON_INTERPRET)


def active_path(tensor: torch.Tensor) -> str:
    """The path ``impl="auto"`` takes for ``tensor``: ``"triton"`` or ``"torch"``."""
    return "triton" if triton_can_run(tensor) else "torch"


def resolve_impl(impl: str, tensor: torch.Tensor, op: str) -> str:
    """Turn ``impl`` ("auto" | "triton" | "torch") into the path to run; log it once per op."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    path = active_path(tensor) if impl == "auto" else impl
    if path == "triton" and not triton_can_run(tensor):
        raise RuntimeError(
            f"{op}: impl='triton' needs a CUDA tensor or TRITON_INTERPRET=1 set before triton is "
            f"imported (tensor on {tensor.device}, triton importable: {HAS_TRITON})"
        )
    if (op, path) not in _logged:
        _logged.add((op, path))
        how = "interpreter" if path == "triton" and not tensor.is_cuda else str(tensor.device)
        # A CUDA tensor on the torch path means triton is missing: a real fallback, so warn.
        level = logging.WARNING if path == "torch" and tensor.is_cuda else logging.INFO
        _log.log(level, "%s runs the %s path (%s, impl=%r)", op, path, how, impl)
    return path


class VocabPass(NamedTuple):
    """How an op's pass over the vocabulary runs (not what it computes): its process group,
    path and memory knobs. The defaults suit TP=1 and automatic choices."""

    group: object = None
    """Tensor-parallel process group of the vocab shards (None = TP 1)."""
    impl: str = "auto"
    """"auto" | "triton" | "torch" (``resolve_impl``)."""
    valid_vocab: int | None = None
    """Hidden-state form: rows of the weight shard that are real tokens (None = all)."""
    inplace_backward: bool = False
    """Logits form: the backward may overwrite the logits with their gradient."""
    chunk_tokens: int | None = None
    """Hidden-state form: tokens per chunk (None = automatic)."""
    chunk_vocab: int | None = None
    """Hidden-state form, recomputing path (with or without token weights): vocab rows per
    chunk (None = automatic)."""
    grad_in_forward: bool | None = None
    """Hidden-state form with token weights: force (True / False) or choose (None) the path
    that computes the gradient in the forward."""
