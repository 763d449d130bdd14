"""One spawned gloo world of 4 ranks for every TP case, shared by test_logprob.py,
test_grpo_loss.py and test_loss_spec.py: the TP=2 cases run on two groups of 2 ranks side by
side (each group half of them), then the TP=4 cases on the whole world.

The ranks run every case with both paths and return the results to the parent, which compares
them with the float64 oracles (process start-up dominates the cost: one spawn, not one a size).
"""
from __future__ import annotations

import pytest
import torch

from tests.kernels.kernels_oracle import (
    GRPO_OPTIONS,
    K3_IS,
    SAPO_STEEP,
    grpo_case,
    logprob_case,
    tp_sizes_worker,
)
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
    if tp == 2:  # test_loss_spec.py's, checked there against the papers' formulas
        for i, (name, options) in enumerate((("sapo", SAPO_STEEP), ("k3_is", K3_IS))):
            cases["spec_" + name] = dict(grpo_case(18, v, tp, torch.float32, 21 + i, options),
                                         kind="spec")
    return cases


WORLD = 4


def spawn_tp(tmp_path) -> dict[int, tuple[dict, list[dict]]]:
    """{tp: (cases, per-rank results {(case, impl): outputs}, one dict per TP rank)} for TP=2
    and TP=4 from one spawn; a TP=2 rank's dict holds what that rank of either group ran."""
    cases = {tp: tp_cases(tp) for tp in (2, WORLD)}
    names = list(cases[2])
    per_group = {2: [{n: cases[2][n] for n in names[g::2]} for g in range(WORLD // 2)],
                 WORLD: [cases[WORLD]]}
    ranks = spawn_ranks(tp_sizes_worker, WORLD, per_group, tmp_path)
    out = {}
    for tp in (2, WORLD):
        out[tp] = cases[tp], [
            {key[1:]: v for r in ranks[i::tp] for key, v in r.items() if key[0] == tp}
            for i in range(tp)]
    return out


@pytest.fixture(scope="session")
def tp_spawn(tmp_path_factory) -> dict[int, tuple[dict, list[dict]]]:
    return spawn_tp(tmp_path_factory.mktemp("tp"))


@pytest.fixture(params=[2, 4], ids=["tp2", "tp4"])
def tp_run(request, tp_spawn):
    """(tp, cases, per-rank results {(case, impl): outputs})."""
    return request.param, *tp_spawn[request.param]
