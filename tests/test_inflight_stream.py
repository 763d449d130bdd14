"""In-flight updates on the trainer's side (no vLLM, no ranks): the refusals before compute,
per-token versions through the stream's stamp, `Trainer.prepare`'s per-sample decision by the
oldest token, the token-lag metrics, a queued batch with token versions through a checkpoint,
and the step's post -> join -> load order against a fake engine slot. The real engine:
tests/test_inflight.py."""
from __future__ import annotations

import pytest
import torch

from megagrpo.checkpoint import load_tree, save_tree
from megagrpo.config.train import TrainConfig, load_config
from megagrpo.engine import Completion
from megagrpo.engine.inflight import InflightUpdates, token_versions
from megagrpo.rollout.collect import Drawn
from megagrpo.rollout.stream import Rollout, stamp
from megagrpo.sync.source import Feed
from megagrpo.sync.transports.inflight import Inflight
from megagrpo.train.offpolicy import token_lag_metrics
from megagrpo.train.trainer import Trainer

G = 2


def test_refused_without_async_and_with_adapter_refit():
    with pytest.raises(ValueError, match=r"rollout\.inflight_updates=true .* set "
                                         r"rollout\.max_staleness >= 1"):
        load_config(None, ["rollout.inflight_updates=true"]).validate()
    load_config(None, ["rollout.inflight_updates=true", "run.async_rollout=true"]).validate()
    cfg = load_config(None, ["rollout.inflight_updates=true", "rollout.max_staleness=2",
                             "lora.rank=4", "lora.refit=adapter"])
    with pytest.raises(ValueError, match=r"lora\.refit=adapter.*set lora\.refit=merged"):
        cfg._validate_staleness()


def test_stamp_takes_the_oldest_token_version():
    comps = [Completion(prompt_index=0, sample_index=0, token_ids=[5, 6, 7], logprobs=[0.0] * 3,
                        finish_reason="length", token_versions=[2, 2, 3]),
             Completion(prompt_index=0, sample_index=1, token_ids=[5], logprobs=[0.0],
                        finish_reason="stop")]
    stamp(comps, 4)
    assert [c.version for c in comps] == [2, 4]


def test_token_versions_from_vllm_spans():
    class Span:
        def __init__(self, version, start, end):
            self.version, self.start, self.end = version, start, end

    class Out:
        weight_versions = [Span("default", 0, 1), Span("3", 1, 3), Span("4", 3, 6)]

    assert token_versions(Out()) == [-1, 3, 3, 4, 4, 4]
    Out.weight_versions = None
    assert token_versions(Out()) == []


def _mixed_trainer(k: int, policy: str = "drop") -> tuple[Trainer, Rollout]:
    """A trainer at version 3; three groups whose tokens were sampled by versions (1, 2),
    (2, 3) and (3, 3): oldest-token lags 2, 1, 0. The scoring pass returns vLLM's log-probs
    + 0.5 on loss tokens."""
    cfg = TrainConfig()
    cfg.algo.group_size, cfg.algo.beta = G, 0.0
    cfg.rollout.max_staleness, cfg.rollout.stale_policy = k, policy
    cfg.rollout.inflight_updates = True
    tr = Trainer(cfg)
    tr.version = 3
    tr.passes.logprobs = lambda model, batch, rows=None: torch.where(
        batch.mask, batch.rollout_logp + 0.5, 0.0)
    spans = [[1, 2], [2, 3], [3, 3]]
    comps = [Completion(prompt_index=i, sample_index=j, token_ids=[5, 6], logprobs=[-1.0, -2.0],
                        finish_reason="length", token_versions=list(spans[i]))
             for i in range(3) for j in range(G)]
    stamp(comps, -1)
    return tr, Rollout(prompts=[[1, 2]] * 3, answers=["x"] * 3, completions=comps,
                       rewards=torch.tensor([0.0, 1.0] * 3), version=1)


def _row_weights(batch) -> list[float]:
    valid = batch.seq_valid
    return [float(batch.is_weight[valid][i][batch.mask[valid][i]].unique())
            for i in range(3 * G) if bool(batch.mask[valid][i].any())]


def test_prepare_decides_per_sample_by_the_oldest_token():
    """k = 1: the group whose oldest token lags 2 is dropped whole; the mixed group (2, 3)
    is stale and weighted on every token (its fresh token's weight is the same
    min(exp(old - vLLM), cap)); the group sampled wholly by the trainer's version keeps 1."""
    tr, ro = _mixed_trainer(1)
    batch, prep = tr.prepare(ro)
    m = prep.metrics
    assert m["stale_dropped"] == G and m["staleness_max"] == 2
    assert m["token_lag_mean"] == pytest.approx((1.5 + 0.5 + 0.0) / 3)
    assert m["inflight_mixed_samples"] == 2 * G
    decoupled = float(torch.tensor(0.5).exp())
    assert _row_weights(batch) == pytest.approx([decoupled] * G + [1.0] * G)
    tr, ro = _mixed_trainer(2)  # within k = 2 nothing is dropped
    batch, prep = tr.prepare(ro)
    assert prep.metrics["stale_dropped"] == 0
    assert _row_weights(batch) == pytest.approx([decoupled] * 2 * G + [1.0] * G)


def test_token_lag_metrics_without_token_versions():
    ro = Rollout(prompts=[[1]], answers=["x"], completions=[
        Completion(prompt_index=0, sample_index=0, token_ids=[5], logprobs=[0.0],
                   finish_reason="stop", version=2)])
    assert token_lag_metrics(ro, 3) == {"token_lag_mean": 0.0, "inflight_mixed_samples": 0.0}


def test_queued_batch_keeps_token_versions_through_a_checkpoint(tmp_path):
    comp = Completion(prompt_index=0, sample_index=0, token_ids=[5, 6, 7], logprobs=[-1.0] * 3,
                      finish_reason="length", token_versions=[4, 5, 5], version=4)
    drawn = Drawn(prompts=[[1, 2]], answers=["x"], epoch=0, version=4, completions=[comp],
                  rewards=[1.0], metrics={}, loader_state={"index": 3})
    save_tree(tmp_path / "q", {"queue": [drawn.state_dict()]})
    back = Drawn.from_state(load_tree(tmp_path / "q")["queue"][0])
    assert back.completions[0].token_versions == [4, 5, 5]
    assert back.completions[0] == comp


class _Engine:
    """Records what the slot loads (a stand-in for VLLMEngine.update_weights)."""

    class _Core:
        def set_weight_version(self, v: str) -> None:
            self.label = v

    def __init__(self):
        self.loads = []
        self.inflight = InflightUpdates()
        self.llm = type("LLM", (), {"llm_engine": self._Core()})()

    def update_weights(self, pairs, *, reset_prefix_cache=True):
        from megagrpo.engine.types import WeightSyncStats

        self.loads.append((len(pairs), reset_prefix_cache))
        return WeightSyncStats(tensors=len(pairs), bytes=0, seconds=0.01, source_seconds=0.0,
                               load_seconds=0.01)


def test_posted_weights_load_midway_or_after_the_join():
    """A post that a running draw took (midway) is not loaded again after the join; one that
    no draw took is loaded by the inflight transport's `deliver` on the main thread; both
    label the engine."""
    eng = _Engine()
    slot = eng.inflight
    transport = Inflight(eng, slot)
    feed = Feed(iter([("w", torch.zeros(1))]))
    feed.stats.bytes = 4
    transport.post(feed, 1)
    assert slot.apply_pending(eng, midway=True) is not None  # the draw, between decode steps
    out = transport.deliver(Feed(iter(())), 1)
    assert eng.loads == [(1, False)] and out["inflight_midway"] == 1.0
    assert out["sync_bytes"] == 4 and eng.llm.llm_engine.label == "1"
    transport.post(Feed(iter([("w", torch.zeros(1))])), 2)  # no draw ran: loaded after the join
    out = transport.deliver(Feed(iter(())), 2)
    assert eng.loads[-1] == (1, True) and out["inflight_midway"] == 0.0
    assert slot.version == 2 and slot.pending_version is None


# ---------------------------------------------------------------------- partial rollouts
@pytest.mark.parametrize("overrides, message", [
    (["rollout.partial_rollouts=true"],
     r"rollout\.partial_rollouts=true .* needs async rollouts; set rollout\.max_staleness >= 1"),
    (["rollout.partial_rollouts=true", "rollout.max_staleness=1",
      "rollout.partial_max_updates=2"],
     r"rollout\.partial_max_updates=2 is above rollout\.max_staleness=1.*<= 1"),
    (["rollout.partial_max_updates=1"],
     r"rollout\.partial_max_updates=1 caps partial rollouts, which are off"),
    (["rollout.partial_rollouts=true", "rollout.max_staleness=1",
      "rollout.partial_max_updates=-1"], r"rollout\.partial_max_updates=-1 must be >= 0"),
    (["rollout.partial_rollouts=true", "rollout.max_staleness=1",
      "rollout.inflight_updates=true"], r"with rollout\.inflight_updates=true: not supported"),
    (["rollout.partial_rollouts=true", "rollout.max_staleness=1",
      "rollout.tensor_parallel_size=2"], r"rollout\.tensor_parallel_size=2: not supported"),
    (["rollout.partial_rollouts=true", "rollout.max_staleness=1", "reward.score_chunks=2"],
     r"reward\.score_chunks=2: not supported"),
    (["rollout.partial_rollouts=true", "rollout.max_staleness=1", "rollout.stop=['\\n']"],
     r"rollout\.stop \(stop strings\): not supported"),
])
def test_partial_rollouts_refused_before_compute(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, overrides).validate()


def test_partial_rollouts_accepted_within_the_bound():
    for over in (["rollout.max_staleness=2", "rollout.partial_max_updates=2"],
                 ["run.async_rollout=true"], ["rollout.max_staleness=3"],
                 # the rollout ranks pause at each announced sync (tests/test_placement.py)
                 ["rollout.max_staleness=1", "rollout.placement=separate",
                  "rollout.rollout_ranks=1"],
                 # multi-turn, colocated: paused mid-turn or between turns
                 ["rollout.max_staleness=1", "agent.environment=tests._agent_env:Digits"],
                 # multi-turn on the rollout ranks (tests/test_placement.py)
                 ["rollout.max_staleness=1", "agent.environment=tests._agent_env:Digits",
                  "rollout.placement=separate", "rollout.rollout_ranks=1"]):
        load_config(None, ["rollout.partial_rollouts=true", *over]).validate()


def test_token_lag_shares_by_hand():
    """Tokens sampled by versions [1, 2, 3] and [3]: at trainer version 3 the lags are
    2, 1, 0, 0 (shares at k = 2: 0.5, 0.25, 0.25)."""
    ro = Rollout(prompts=[[1]], answers=["x"], completions=[
        Completion(prompt_index=0, sample_index=0, token_ids=[5, 6, 7], logprobs=[0.0] * 3,
                   finish_reason="stop", token_versions=[1, 2, 3]),
        Completion(prompt_index=0, sample_index=1, token_ids=[5], logprobs=[0.0],
                   finish_reason="stop", token_versions=[3])])
    m = token_lag_metrics(ro, 3, k=2)
    assert m == {"token_lag_mean": 0.75, "inflight_mixed_samples": 1.0,
                 "token_lag_share_0": 0.5, "token_lag_share_1": 0.25, "token_lag_share_2": 0.25}


def test_paused_trajectories_survive_a_checkpoint(tmp_path):
    """A queued batch with paused trajectories (tokens, log-probs, versions so far) is saved
    and restored as it was, its prompts' records and texts with it."""
    paused = Completion(prompt_index=1, sample_index=0, token_ids=[5, 6], logprobs=[-1.0, -2.0],
                        finish_reason="", token_versions=[4, 4])
    done = Completion(prompt_index=0, sample_index=0, token_ids=[7], logprobs=[-0.5],
                      finish_reason="stop", token_versions=[4])
    drawn = Drawn(prompts=[[1, 2], [3]], answers=["x", "y"], epoch=0, version=4,
                  completions=[done], rewards=[], metrics={"partial_recomputed_tokens": 0.0},
                  loader_state={"index": 3}, unfinished=[paused], records=[{}, {"a": 1}],
                  texts=["p", "q"])
    save_tree(tmp_path / "q", {"queue": [drawn.state_dict()]})
    back = Drawn.from_state(load_tree(tmp_path / "q")["queue"][0])
    assert back.unfinished == [paused] and back.completions == [done]
    assert back.records == [{}, {"a": 1}] and back.texts == ["p", "q"]
