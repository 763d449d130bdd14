"""bf16 cases of end-to-end tests (LoRA runs, kill-and-resume): where they run and the
tolerances bf16 rounding sets.

bf16 keeps 8 significant bits: one rounding is off by up to 2^-8 relative (half an ulp,
2^-9, rounding to nearest). The bf16 cases run by default on CPUs with avx512_bf16 or AMX,
where torch's bf16 matmul is fast; elsewhere it falls back to a path ~70x slower than fp32
(docs/performance.md, "bf16 mixed precision on CPU"), so they skip, naming the reason, and
fail under CI (env CI set), whose machine must have it so the bf16 cases stay in CI."""
from __future__ import annotations

import os

import pytest
import torch

BF16_EPS = 2.0 ** -8
"""bf16's relative rounding step (unit roundoff 2^-9)."""

BF16_GAP_MAX = 7e-3
"""Mean |vLLM - trainer| log-prob gap per token that bf16 rounding alone opens on the tiny
models of the tests: measured 5.2e-4 .. 6.8e-4 (tests/test_bf16.py); each log-prob goes
through a few dozen bf16 roundings of ~2^-9 that partly cancel. ~10x the measurement: a sync
or precision defect (a stale or mis-sharded weight, a norm in fp32 on one side only) opens
gaps of 0.1 and more."""

FP32_GAP_MAX = 1e-4
"""The same gap in fp32 (measured ~1e-7): what the fp32 cases assert."""


def fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (avx512_bf16 or AMX tiles)."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def needs_fast_bf16() -> None:
    """Skips (fails under CI) a bf16 case on a CPU without native bf16."""
    if fast_bf16():
        return
    why = (f"this CPU ({torch.backends.cpu.get_cpu_capability()}) has neither avx512_bf16 nor "
           "AMX: torch's bf16 matmul falls back to a path ~70x slower than fp32, so the bf16 "
           "end-to-end cases run on CPUs that have it (CI must)")
    (pytest.fail if os.environ.get("CI") else pytest.skip)(why)


def gap_max(dtype: str) -> float:
    """The vLLM-vs-trainer gap bound of a run in `dtype` ('float32' or 'bfloat16')."""
    return {"float32": FP32_GAP_MAX, "bfloat16": BF16_GAP_MAX}[dtype]
