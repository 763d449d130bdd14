"""Rollout-IS with nucleus / top-k sampling and vLLM's processed log-probs is refused before
the run (issue 28 defect; the check is `TrainConfig._validate_sampling`, run by the preflight).

Why: vLLM's processed log-probs are those of the truncated, renormalised distribution it sampled
from, while the trainer scores the full softmax. For every kept token the two differ by exactly
log(kept mass), so the rollout-IS ratio exp(old - vLLM) equals the kept mass (< 1) on every
token: a uniform down-weighting, not a correction. The float64 check below shows that on a
random distribution; the preflight tests show the run refuses it, naming the fields and the fix,
and that the combinations that are sound (no IS correction, raw log-probs, no truncation) pass.
"""
from pathlib import Path

import pytest
import torch

from megagrpo.config.train import load_config
from megagrpo.preflight import preflight

DEMO = str(Path(__file__).resolve().parents[1] / "examples" / "demo.yaml")


def test_processed_logprobs_of_a_nucleus_differ_by_the_kept_mass():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=g, dtype=torch.float64) * 2
    full = torch.log_softmax(logits, 0)
    p, order = full.exp().sort(descending=True)
    keep = order[: int((p.cumsum(0) < 0.9).sum()) + 1]  # top_p = 0.9: the nucleus
    mass = full[keep].exp().sum()
    processed = torch.log_softmax(logits[keep], 0)  # what vLLM reports for a sampled token
    ratio = torch.exp(full[keep] - processed)  # the IS weight at equal weights
    assert float(mass) < 0.95
    assert torch.allclose(ratio, mass.expand_as(ratio), rtol=0, atol=1e-12)


@pytest.mark.parametrize("overrides, match", [
    (["rollout.top_p=0.9", "algo.rollout_is=truncate"],
     r"rollout\.top_p=0\.9 / rollout\.top_k=-1 with algo\.rollout_is='truncate'.*"
     r"sample with top_p=1 and top_k=-1 \(or 0\), or set algo\.rollout_is=none"),
    (["rollout.top_k=8", "algo.rollout_is=seq_mask"],
     r"rollout\.top_k=8 with algo\.rollout_is='seq_mask'"),
])
def test_preflight_refuses_truncated_sampling_with_rollout_is(overrides, match):
    with pytest.raises(ValueError, match=match):
        preflight(load_config(DEMO, overrides), 2)


@pytest.mark.parametrize("overrides", [
    ["rollout.top_p=0.9"],  # no IS correction
    ["rollout.top_k=0", "algo.rollout_is=truncate"],  # 0 and -1 are "off"
    ["rollout.top_k=-1", "rollout.top_p=1.0", "algo.rollout_is=token_mask"],
    ["rollout.top_p=0.9", "algo.rollout_is=truncate", "rollout.logprobs_mode=raw_logprobs"],
])
def test_preflight_accepts_the_sound_combinations(overrides):
    preflight(load_config(DEMO, overrides), 2)
