"""The rollout stream with bounded staleness (issue 30, items 2, 5-7), no vLLM and no ranks.

A fake engine stands in for vLLM inside the real `RolloutCollector` (the colocated
`RolloutSource`), so every check here runs in a second: rollout.max_staleness k and its alias
run.async_rollout; the per-sample versions a k = 2 stream stamps (lag never above k, exactly k
once the queue is full); epochs counted by the prompts the trainer consumes, not those the
stream drew; the prompt accounting of a resume (each prompt trained once, in the uninterrupted
order, whether the batches drawn ahead are restored, partly restored or returned to the
stream), checked against the loader's own sequence; `Trainer.prepare` on an over-stale batch
(drop and weight) and on a batch mixing versions; the refusals before compute; the console.
The real-process checks: tests/test_trainer.py (k = 2 steps on vLLM), tests/test_microbatch.py
(the epoch reference reset at k = 2) and, `-m heavy`, tests/test_resume.py's kill -9 of a k = 2
run.
"""
from __future__ import annotations

import pytest
import torch

from megagrpo.checkpoint import load_tree, save_tree
from megagrpo.config.layout import RolloutLayout
from megagrpo.config.train import ReferenceConfig, TrainConfig, load_config
from megagrpo.data import Example, PromptLoader
from megagrpo.engine import Completion
from megagrpo.model.reference import ReferenceSchedule, ReferenceState
from megagrpo.reward import Rewards, Scores
from megagrpo.rollout.collect import RolloutCollector
from megagrpo.rollout.stream import Rollout, RolloutSource, stale_weights
from megagrpo.runtime.console import Progress
from megagrpo.train.trainer import Trainer

G = 2


class Engine:
    """Two-token completions that echo the prompt's id (no randomness: runs are comparable)."""

    def generate(self, prompts, sampling):
        return [Completion(prompt_index=i, sample_index=j, token_ids=[p[-1], 3 + j],
                           logprobs=[-0.5, -0.25], finish_reason="stop", text=f"{p[-1]}")
                for i, p in enumerate(prompts) for j in range(sampling.n)]


class Tok:
    bos_id = None

    def encode(self, text):
        return [1, int(text)]

    def decode(self, ids):
        return " ".join(map(str, ids))


class Reward:
    """A reward source: 1 where the completion is the answer."""

    def score(self, samples):
        r = torch.tensor([float(s.completion == s.answer) for s in samples])
        return Scores(rewards=r, per_term={"r": r}, correct=r >= 1)

    def close(self):
        pass


def _config(k: int | None = None, **rollout) -> TrainConfig:
    cfg = TrainConfig()
    cfg.algo.group_size, cfg.algo.beta = G, 0.0
    cfg.rollout.max_staleness = k
    for key, v in rollout.items():
        setattr(cfg.rollout, key, v)
    return cfg


def _collector(k: int, n_prompts: int = 12, batch: int = 2) -> RolloutCollector:
    data = [Example(prompt=str(100 + i), answer=str(100 + i)) for i in range(n_prompts)]
    return RolloutCollector(cfg=_config(k), engine=Engine(), tokenizer=Tok(),
                            rewards=Rewards(Reward()),
                            loader=PromptLoader(data, batch, seed=3),
                            layout=RolloutLayout(rank=0, world_size=1, engine_tp=1, train_tp=1,
                                                 train_pp=1))


def _steps(c: RolloutCollector, first_version: int, n: int) -> list[Rollout]:
    """n trainer steps: take the batch at the engine's version, train (version + 1), join."""
    out = []
    for v in range(first_version, first_version + n):
        out.append(c.next(v))
        c.join()
    return out


def _prompts(rollouts: list[Rollout]) -> list[int]:
    return [p[-1] for ro in rollouts for p in ro.prompts]


def test_staleness_knob_and_its_alias():
    assert _config().staleness == 0 and _config(2).staleness == 2
    cfg = _config()
    cfg.run.async_rollout = True
    assert cfg.staleness == 1 and cfg.pipelined_by()[1] == "run.async_rollout=true"
    assert _config(3).pipelined_by() == ("rollout.max_staleness=3",) * 2 + (
        "rollout.max_staleness=0",)
    assert _config(0).pipelined_by() is None and _config().pipelined_by() is None
    assert isinstance(_collector(2), RolloutSource)  # the protocol's shape (runtime check)


def test_bad_staleness_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"rollout\.max_staleness=-1 must be >= 0"):
        load_config(None, ["rollout.max_staleness=-1"]).validate()
    with pytest.raises(ValueError, match=r"rollout\.stale_policy='keep' must be one of"):
        load_config(None, ["rollout.stale_policy=keep"]).validate()
    with pytest.raises(ValueError, match=r"run\.async_rollout=true .* contradicts "
                                         r"rollout\.max_staleness=0"):
        load_config(None, ["run.async_rollout=true", "rollout.max_staleness=0"]).validate()
    # what cannot pipeline, named by the setting that asked for it
    with pytest.raises(ValueError, match=r"rollout\.max_staleness=2 needs "
                                         r"rollout\.tensor_parallel_size=1.*set "
                                         r"rollout\.max_staleness=0"):
        load_config(None, ["rollout.max_staleness=2", "rollout.tensor_parallel_size=2",
                           "parallel.tp=2"]).validate(2)
    with pytest.raises(ValueError, match=r"rollout\.top_p=0\.9 .* with "
                                         r"rollout\.max_staleness=2.*or set "
                                         r"rollout\.max_staleness=0"):
        load_config(None, ["rollout.max_staleness=2", "rollout.top_p=0.9"]).validate()
    load_config(None, ["rollout.max_staleness=2", "run.async_rollout=true"]).validate()


def test_routing_replay_with_a_stream_is_refused():
    from megagrpo.config.model import ModelConfig
    from megagrpo.preflight import check_model

    moe = ModelConfig(architecture="qwen3_moe", num_experts=4, moe_topk=2,
                      moe_ffn_hidden_size=64, vocab_size=32, hidden_size=64,
                      num_attention_heads=2, num_query_groups=1, head_dim=32)

    class Vocab:
        vocab_size = 16

    cfg = load_config(None, ["rollout.max_staleness=2", "algo.routing_replay=true"])
    with pytest.raises(ValueError, match=r"algo\.routing_replay=true with "
                                         r"rollout\.max_staleness=2.*set rollout\.max_staleness=0"):
        check_model(cfg, moe, Vocab())
    check_model(load_config(None, ["algo.routing_replay=true"]), moe, Vocab())


def test_k2_stream_versions_and_queue():
    """k = 2: the first step draws its batch on demand and the side thread queues two more;
    from then on the step takes a batch two versions old and one is drawn per step. Every
    sample's recorded version is within k of the trainer's, exactly k once the queue is full."""
    c = _collector(2)
    depths, lags = [], []
    for v in range(6):  # the engine holds version v when step v + 1 asks
        ro = c.next(v)
        depths.append(c.stats.queue_depth)
        c.join()
        assert c.stats.draw_s > 0
        lags.append(sorted({v - x.version for x in ro.completions}))
    assert depths == [0, 2, 2, 2, 2, 2]
    assert lags == [[0], [1], [2], [2], [2], [2]]
    assert len(c.queue) == 2 and [d.version for d in c.queue] == [4, 5]
    # k = 1 (today's async) and k = 0: one batch ahead, none
    c1 = _collector(1)
    assert [sorted({v - x.version for x in ro.completions})
            for v, ro in enumerate(_steps(c1, 0, 4))] == [[0], [1], [1], [1]]
    c0 = _collector(0)
    assert {v - x.version for v, ro in enumerate(_steps(c0, 0, 3)) for x in ro.completions} == {0}
    assert not c0.queue


def test_epochs_are_the_consumed_prompts():
    """3 batches per epoch, k = 2: by step 2 the stream has drawn epoch 1's first batch, but a
    rollout's epoch is that of its own prompts, so the trainer sees epoch 1 (and the reference
    schedule resets) at step 4, as a synchronous run does; each epoch trains every prompt once."""
    sync, k2 = _collector(0, n_prompts=6), _collector(2, n_prompts=6)
    got, drawn = [], []
    for v in range(7):
        got.append(k2.next(v))
        k2.join()
        drawn.append(k2.loader.epoch)  # the epoch of the newest batch the stream drew
    assert [ro.epoch for ro in got] == [ro.epoch for ro in _steps(sync, 0, 7)] == \
        [0, 0, 0, 1, 1, 1, 2]
    assert drawn == [0, 1, 1, 1, 2, 2, 2]  # two batches ahead of the trainer
    for e in (0, 1):
        assert sorted(_prompts(got[3 * e:3 * e + 3])) == list(range(100, 106))
    sched = ReferenceSchedule()  # the schedule the trainer consults with each batch's epoch
    sched.cfg = ReferenceConfig(sync_every_epoch=True)
    sched.state, resets = ReferenceState(), []
    for step, ro in enumerate(got, 1):
        if sched.due_before(ro.epoch):
            sched.state.last_epoch = ro.epoch
            resets.append(step)
    assert resets == [4, 7]


def _checkpoint(c: RolloutCollector, tmp_path) -> tuple[dict, dict]:
    """What a checkpoint holds of the stream: the per-rank part (through the state file) and
    the trainer state."""
    save_tree(tmp_path / "rollout.safetensors", c.state_dict())
    return load_tree(tmp_path / "rollout.safetensors"), Trainer(c.cfg, rollouts=c).state_dict()


@pytest.mark.parametrize("k_after", [2, 1, 0])
def test_resume_of_a_k2_stream_loses_and_repeats_no_prompt(tmp_path, k_after):
    """A k = 2 run stopped after step 4 (two batches drawn ahead, the loader past them) and
    resumed: at k = 2 both batches come back from the checkpoint (the samples themselves), at
    k = 1 one does and the other's prompts return to the stream, at k = 0 both return. Every
    way, the prompts trained over steps 1..8 are exactly the loader's first 8 batches, in
    order (the reference: the loader iterated on its own), each once."""
    loader = PromptLoader([Example(prompt=str(100 + i), answer="") for i in range(12)], 2,
                          seed=3)
    want = [int(e.prompt) for _ in range(8) for e in next(loader)]
    c = _collector(2)
    before = _steps(c, 0, 4)
    part, state = _checkpoint(c, tmp_path)
    assert len(state["ahead_loaders"]) == 2 and state["pending_loader"] == \
        state["ahead_loaders"][0]
    resumed = _collector(k_after)
    resumed.load_state_dict(part)  # a per-rank part is restored only when k >= 1 (run.py)
    if k_after == 0:
        resumed.queue.clear()
    tr = Trainer(resumed.cfg, rollouts=resumed)
    tr.load_state_dict(state)
    assert len(resumed.queue) == k_after and len(resumed.returned) == 2 - k_after
    after = _steps(resumed, 4, 4)
    assert _prompts(before + after) == want
    if k_after == 2:  # the restored batches are the very samples drawn before the stop
        assert [x.version for x in after[0].completions] == [2] * 2 * G
    # a checkpoint taken while returned prompts wait keeps them (k = 0 draws one per step)
    if k_after == 0:
        again = _collector(0)
        tr0 = Trainer(again.cfg, rollouts=again)
        tr0.load_state_dict(state)
        first = _steps(again, 4, 1)
        _, mid = _checkpoint(again, tmp_path)
        assert len(mid["ahead_loaders"]) == 1
        last = _collector(0)
        Trainer(last.cfg, rollouts=last).load_state_dict(mid)
        assert _prompts(before + first + _steps(last, 5, 3)) == want


def _stale_batch_trainer(policy: str, k: int = 1) -> tuple[Trainer, Rollout]:
    """A trainer at version 3 and a rollout whose groups were sampled by versions 1, 2 and 3
    (lags 2, 1, 0); the scoring pass returns vLLM's log-probs + 0.5 on loss tokens."""
    cfg = _config(k, stale_policy=policy)
    tr = Trainer(cfg)
    tr.version = 3
    tr.passes.logprobs = lambda model, batch, rows=None: torch.where(
        batch.mask, batch.rollout_logp + 0.5, 0.0)
    comps = [Completion(prompt_index=i, sample_index=j, token_ids=[5, 6], logprobs=[-1.0, -2.0],
                        finish_reason="stop", version=1 + i) for i in range(3) for j in range(G)]
    return tr, Rollout(prompts=[[1, 2]] * 3, answers=["x"] * 3, completions=comps,
                       rewards=torch.tensor([0.0, 1.0] * 3), version=1)


def test_over_stale_samples_are_dropped():
    """k = 1, lags 2 / 1 / 0 per group: the lag-2 group leaves the loss (stale_dropped 2), the
    lag-1 group trains with the decoupled weight min(exp(0.5), cap), the fresh group with 1."""
    tr, ro = _stale_batch_trainer("drop")
    batch, prep = tr.prepare(ro)
    m = prep.metrics
    assert m["stale_dropped"] == 2 and m["stale_weighted"] == 0 and prep.stale
    assert m["staleness_max"] == 2 and m["staleness_mean"] == pytest.approx(1.0)
    assert m["policy_lag"] == 2 and m["offpolicy_corrected"] == 1
    rows = batch.mask.any(dim=1)[batch.seq_valid].tolist()
    assert rows == [False] * G + [True] * 2 * G
    w = batch.is_weight[batch.seq_valid]
    loss_w = [float(w[i][batch.mask[batch.seq_valid][i]].unique()) for i in range(G, 3 * G)]
    assert loss_w == pytest.approx([float(torch.tensor(0.5).exp())] * G + [1.0] * G)


def test_over_stale_samples_are_down_weighted():
    tr, ro = _stale_batch_trainer("weight")
    batch, prep = tr.prepare(ro)
    assert prep.metrics["stale_dropped"] == 0 and prep.metrics["stale_weighted"] == G
    valid = batch.seq_valid
    assert bool(batch.mask[valid].any(dim=1).all())  # nothing dropped
    w = [float(batch.is_weight[valid][i][batch.mask[valid][i]].unique()) for i in range(3 * G)]
    decoupled = float(torch.tensor(0.5).exp())
    assert w == pytest.approx([decoupled * 2 / 3] * G + [decoupled] * G + [1.0] * G)
    assert stale_weights(torch.tensor([0, 1, 2, 3, 5]), 1).tolist() == \
        pytest.approx([1, 1, 2 / 3, 2 / 4, 2 / 6])


def test_within_the_bound_nothing_is_dropped():
    tr, ro = _stale_batch_trainer("drop", k=2)
    batch, prep = tr.prepare(ro)
    assert prep.metrics["stale_dropped"] == 0
    assert bool(batch.mask[batch.seq_valid].any(dim=1).all())


def test_console_shows_the_stream():
    rec = {"reward_mean": 0.5, "rollout_queue_depth": 2.0, "staleness_mean": 1.5,
           "staleness_max": 2.0, "stale_dropped": 3.0, "stale_weighted": 0.0,
           "trainer_idle_s": 0.25, "rollout_idle_s": 1.5}
    line = Progress(4, enabled=False).figures(rec)
    assert line.endswith("queue=2 lag=1.5/2 stale=3 idle=0.25/1.50s"), line
    sync = dict(rec, rollout_queue_depth=0.0, staleness_max=0.0, stale_dropped=0.0)
    assert "queue=" not in Progress(4, enabled=False).figures(sync)


def test_staleness_policy_alone():
    """The staleness rules as a component (`megagrpo.train.offpolicy.StalenessPolicy`), without a
    Trainer: lags 2 / 1 / 0 against k = 1, hand-computed metrics, the drop mask, the weight
    scale (k + 1) / (lag + 1), the decoupled weights' fresh rows; and a Trainer built with a
    policy of its own uses it (nothing read from the trainer's config)."""
    from types import SimpleNamespace

    from megagrpo.train.offpolicy import StalenessPolicy

    _, ro = _stale_batch_trainer("drop")
    for c, v in zip(ro.completions, [1, 1, 2, 2, 3, 3]):
        c.version = v
    st = StalenessPolicy.from_config(_config(1, stale_policy="drop"))
    lags = st.lags(ro, 3)
    assert lags.tolist() == [2, 2, 1, 1, 0, 0] and st.k == 1 and st.mode(True) == "truncate"
    m = st.metrics(ro, 3, lags, st.mode(True))
    assert m == {"policy_lag": 2.0, "offpolicy_corrected": 1.0, "staleness_mean": 1.0,
                 "stale_dropped": 2.0, "stale_weighted": 0.0}
    batch = SimpleNamespace(mask=torch.ones(6, 3, dtype=torch.bool), lags=lags)
    st.bound(batch, lags, step=1, say=False)
    assert batch.mask.all(dim=1).tolist() == [False, False, True, True, True, True]
    assert st.row_scale(lags) is None  # 'drop' scales nothing
    weigh = StalenessPolicy.from_config(_config(1, stale_policy="weight"))
    assert weigh.row_scale(lags).tolist() == pytest.approx([2 / 3, 2 / 3, 1, 1, 1, 1])
    w = weigh.weights(torch.full((6, 3), 1.5), lags, torch.ones(6, dtype=torch.bool),
                      weigh.row_scale(lags), "truncate", width=3)
    assert w[:, 0].tolist() == pytest.approx([1.0, 1.0, 1.5, 1.5, 1.0, 1.0])  # 1.5 * 2/3; fresh 1
    tr = Trainer(_config(1, stale_policy="drop"), staleness=weigh)  # the policy handed in rules
    tr.version = 3
    tr.passes.logprobs = lambda model, batch, rows=None: torch.where(
        batch.mask, batch.rollout_logp + 0.5, 0.0)
    assert tr.prepare(ro)[1].metrics["stale_weighted"] == 2
