"""One spawned gloo group per TP size, shared by test_logprob.py and test_grpo_loss.py.

Each spawn runs every TP case with both paths inside the ranks and returns the results to the
parent, which compares them with the float64 oracles (process start-up dominates the cost).
"""
from __future__ import annotations

import pytest
import torch

from tests.kernels.kernels_oracle import GRPO_OPTIONS, grpo_case, logprob_case, tp_worker
from tests.support.launch import spawn_ranks


def tp_cases(tp: int) -> dict:
    """Logprob and GRPO cases for one spawned group (V_local deliberately not a block multiple)."""
    v = 500 * tp
    cases = {
        "fp32": logprob_case(20, v, tp, torch.float32, seed=11, temperature=0.8),
        "bf16": logprob_case(20, v, tp, torch.bfloat16, seed=12),
        "extreme": logprob_case(10, v, tp, torch.float32, seed=13, extreme=True),
    }
    names = list(GRPO_OPTIONS) if tp == 2 else ["ppo_dual_clip", "gspo_sequence", "kl_k3_clamped"]
    for i, name in enumerate(names):
        dtype = torch.bfloat16 if i % 3 == 2 else torch.float32
        cases["grpo_" + name] = grpo_case(18, v, tp, dtype, seed=20 + i, options=GRPO_OPTIONS[name])
    return cases


def spawn_tp(tp: int, tmp_path) -> tuple[dict, list[dict]]:
    cases = tp_cases(tp)
    return cases, spawn_ranks(tp_worker, tp, cases, tmp_path)


@pytest.fixture(scope="session", params=[2, 4], ids=["tp2", "tp4"])
def tp_run(request, tmp_path_factory):
    """(tp, cases, per-rank results {(case, impl): outputs})."""
    return request.param, *spawn_tp(request.param, tmp_path_factory.mktemp(f"tp{request.param}"))
