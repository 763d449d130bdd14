"""The trainer's step arithmetic in one process, against float64 loops: KL-in-reward shapes the
rewards before the group advantages, and its KL is the loss's KL (same estimator and clamp).
The multi-rank wiring of the same code runs in tests/_trainer_worker.py."""
import math

import pytest
import torch

from megagrpo import algo
from megagrpo.config.train import TrainConfig
from megagrpo.parallel.batch import pack
from megagrpo.reward import Rewards, Scores
from megagrpo.train.advantage import advantages, kl_penalized_rewards
from megagrpo.train.losses import LossContext, grpo_loss
from megagrpo.train.trainer import Trainer

G, BETA = 4, 0.04


def _trainer(estimator: str = "k3", std_mode: str = "group") -> Trainer:
    cfg = TrainConfig()
    for k, v in dict(group_size=G, beta=BETA, kl_in_reward=True, kl_estimator=estimator,
                     std_mode=std_mode).items():
        setattr(cfg.algo, k, v)
    # no processes: dp=1 and a reference that only needs to exist
    return Trainer(cfg, reference=object())


def _kl_advantages(tr: Trainer, batch) -> dict:
    """The step's KL-in-reward stage: penalised rewards, then their group advantages."""
    rewards, metrics = kl_penalized_rewards(batch, tr.cfg.algo)
    batch.set_advantages(advantages(rewards, tr.cfg.algo))
    return metrics


def _batch(lengths: list[int], rewards: list[float]):
    n = len(lengths)
    prompts = [[1, 2, 3][: 1 + i % 3] for i in range(n)]
    comps = [[4 + (i + j) % 5 for j in range(L)] for i, L in enumerate(lengths)]
    lps = [[-1.0] * L for L in lengths]
    # 2 minibatches with padding spread between them: rows hold sequences out of order
    return pack(prompts, comps, lps, torch.zeros(n), pad_id=0, multiple=6, blocks=2,
                seq_rewards=torch.tensor(rewards))


def _est(d: float, estimator: str) -> float:
    if estimator == "k3":
        d = max(-20.0, min(20.0, d))
        return min(10.0, math.exp(-d) + d - 1.0)
    return d if estimator == "k1" else 0.5 * d * d


def _reference_advantages(batch, rewards, estimator):
    """float64 loops: r_i - beta * sum_t kl_t over sequence i's loss tokens, then the GRPO
    group baseline and (Bessel) std."""
    rows = [r for r in range(batch.num_seqs) if batch.seq_valid[r]]
    shaped = []
    for i, r in enumerate(rows):
        kl = sum(_est(float(batch.old_logp[r, t]) - float(batch.ref_logp[r, t]), estimator)
                 for t in range(batch.mask.shape[1]) if batch.mask[r, t])
        shaped.append(rewards[i] - BETA * kl)
    return rows, _group_advantages(shaped)


def _group_advantages(rewards: list[float]) -> list[float]:
    """Written out (not algo.group_advantages): per group of G, (r - mean) / (std + 1e-6), std
    with Bessel's correction as the library documents."""
    adv = []
    for b in range(0, len(rewards), G):
        grp = rewards[b:b + G]
        mean = sum(grp) / G
        std = math.sqrt(sum((x - mean) ** 2 for x in grp) / (G - 1))
        adv += [(x - mean) / (std + 1e-6) for x in grp]
    return adv


def _set_logps(batch, old_fn, ref_fn):
    batch.old_logp = torch.zeros(batch.mask.shape)
    batch.ref_logp = torch.zeros(batch.mask.shape)
    for r, t in batch.mask.nonzero().tolist():
        batch.old_logp[r, t], batch.ref_logp[r, t] = old_fn(r, t), ref_fn(r, t)


def _token_advantages(batch, rows):
    return [float(batch.advantages[r][batch.mask[r]][0]) for r in rows]


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_equal_kl_within_a_group_cancels(estimator):
    """The issue's case: [1, 0, 1, 0] has advantages +-0.866; with a KL of 1.5 on every
    sequence of the group they must stay +-0.866 (before the fix they all shifted by beta*1.5)."""
    rewards = [1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 1.0, 0.25]
    batch = _batch([3] * 8, rewards)
    d = {"k1": 0.5, "k2": 1.0, "k3": 1.0}[estimator]  # summed over 3 tokens: 1.5 for k1, k2
    _set_logps(batch, lambda r, t: -1.0, lambda r, t: -1.0 - d)
    tr = _trainer(estimator)
    metrics = _kl_advantages(tr, batch)
    rows = batch.seq_valid.nonzero().squeeze(1).tolist()
    want = _group_advantages(rewards)  # the unpenalised rewards'
    assert want[:4] == pytest.approx([0.866025, -0.866025] * 2, abs=1e-5)  # the numbers
    assert _token_advantages(batch, rows) == pytest.approx(want, abs=1e-5)
    assert metrics["kl_seq_mean"] == pytest.approx(3 * _est(d, estimator), rel=1e-5)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_in_reward_matches_float64_and_kl_penalized_rewards(estimator):
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.0, 1.0]
    batch = _batch([2, 5, 3, 4, 1, 3, 5, 2], rewards)
    batch.mask[batch.seq_valid.nonzero()[2, 0], :] = False  # a sequence dropped from the loss
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(batch.mask.shape, generator=g)
    _set_logps(batch, lambda r, t: -0.5 - 0.1 * t, lambda r, t: -0.5 - 0.1 * t + 2 * noise[r, t])
    _kl_advantages(_trainer(estimator), batch)
    rows, want = _reference_advantages(batch, rewards, estimator)
    got = [float(batch.advantages[r][batch.mask[r]][0]) if batch.mask[r].any() else 0.0
           for r in rows]
    for i, r in enumerate(rows):
        if batch.mask[r].any():
            assert got[i] == pytest.approx(want[i], abs=1e-5), (i, got, want)
    # and the same as the library function (rewards before advantages) in float64
    kl = torch.where(batch.mask, algo.kl_estimate(batch.old_logp.double(),
                                                  batch.ref_logp.double(), estimator), 0.0)
    if estimator != "k3":  # kl_estimate is unclamped; the noise keeps k3 inside its clamp
        S = batch.mask.shape[1]
        pen, _ = algo.kl_penalized_rewards(
            torch.tensor(rewards, dtype=torch.float64), kl[batch.seq_valid].reshape(-1),
            batch.mask[batch.seq_valid].reshape(-1), torch.arange(8).repeat_interleave(S), BETA)
        lib = algo.group_advantages(pen, G).tolist()
        assert [w for i, w in enumerate(lib) if batch.mask[rows[i]].any()] == pytest.approx(
            [w for i, w in enumerate(want) if batch.mask[rows[i]].any()], abs=1e-9)


@pytest.mark.parametrize("estimator, gap", [("k1", 15.0), ("k2", 6.0), ("k3", 30.0)])
def test_kl_in_reward_uses_the_loss_kl(estimator, gap):
    """Far from the reference (where the old shared clamp cut k1/k2 in the loss only), the
    summed KL the reward path subtracts equals the KL the loss path reports."""
    tr = _trainer(estimator)
    batch = _batch([3, 2, 4, 1, 3, 2, 2, 4], [0.0] * 8)
    V = 11
    logits = torch.randn(*batch.ids.shape, V, generator=torch.Generator().manual_seed(1))
    counts = algo.LossCounts(num_tokens=float(batch.mask.sum()), num_seqs=8.0)
    ctx = LossContext(tp_group=None, valid_local_vocab=V, temperature=1.0, impl="torch",
                      counts=counts, algo=tr.cfg.algo)
    logp = torch.log_softmax(logits.double(), -1).gather(2, batch.target[..., None])[..., 0]
    sign = torch.where(torch.arange(batch.mask.shape[1]) % 2 == 0, 1.0, -1.0)
    batch.old_logp = torch.where(batch.mask, logp.float(), 0.0)
    batch.ref_logp = torch.where(batch.mask, logp.float() + sign * gap, 0.0)
    _, report = grpo_loss(ctx, batch, logits.clone())
    metrics = _kl_advantages(tr, batch)
    assert metrics["kl_seq_mean"] * 8 == pytest.approx(float(report["kl_sum"]), rel=1e-5)
    unclamped = sum(_est(-float(sign[t]) * gap, estimator) if estimator != "k3" else 10.0
                    for r, t in batch.mask.nonzero().tolist())
    assert float(report["kl_sum"]) == pytest.approx(unclamped, rel=1e-5)


def test_trainer_state_round_trips_through_json():
    """What a checkpoint's trainer_state.json holds: counters, the consecutive bad-step count
    (it restarted at 0 on every resume before), the loader position and the reference schedule;
    a fresh trainer that loads it continues with the same next batch."""
    import json

    from megagrpo.data import Example, PromptLoader
    from megagrpo.model.reference import Reference, ReferenceState
    from megagrpo.rollout.collect import RolloutCollector

    def make():
        cfg = TrainConfig()
        data = [Example(prompt=f"p{i}", answer=str(i)) for i in range(12)]
        loader = PromptLoader(data, 4, seed=3)
        rollouts = RolloutCollector(cfg=cfg, engine=None, loader=loader, tokenizer=None,
                                    rewards=None, layout=None)
        ref = Reference.__new__(Reference)  # the schedule's state only: no model needed here
        ref.state = ReferenceState()
        return Trainer(cfg, reference=ref, rollouts=rollouts)

    a = make()
    for _ in range(4):  # into the second epoch
        next(a.rollouts.loader)
    a.step_idx, a.version, a.opt_steps, a.bad_steps = 4, 3, 12, 2
    a.reference.state = ReferenceState(syncs=2, last_sync_step=4, last_epoch=1)
    b = make()
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert (b.step_idx, b.version, b.opt_steps, b.bad_steps) == (4, 3, 12, 2)
    assert b.reference.state == a.reference.state
    nxt = [e.prompt for e in next(a.rollouts.loader)]
    assert [e.prompt for e in next(b.rollouts.loader)] == nxt


def test_async_rollout_thread_failure_stops_the_step():
    """An exception on the async rollout thread is re-raised on the main thread at the join,
    with the thread's exception as the cause (before, the next step quietly sampled on-policy)."""
    from megagrpo.config.layout import RolloutLayout
    from megagrpo.data import Example, PromptLoader
    from megagrpo.engine import Completion
    from megagrpo.rollout.collect import RolloutCollector

    class Engine:
        calls = 0

        def generate(self, prompts, sampling):
            Engine.calls += 1
            if Engine.calls > 1:
                raise ValueError("reward server unreachable")
            return [Completion(prompt_index=i, sample_index=j, token_ids=[5], logprobs=[-1.0],
                               finish_reason="stop", text="x")
                    for i in range(len(prompts)) for j in range(sampling.n)]

    class Tok:
        bos_id = None

        def encode(self, text):
            return [1, 2]

    class Reward:
        def score(self, samples):
            return Scores(rewards=torch.zeros(len(samples)), correct=torch.ones(len(samples)))

        def close(self):
            pass

    cfg = TrainConfig()
    cfg.run.async_rollout, cfg.algo.group_size = True, 2
    loader = PromptLoader([Example(prompt=f"p{i}", answer="a") for i in range(8)], 4)
    c = RolloutCollector(cfg=cfg, engine=Engine(), loader=loader, tokenizer=Tok(),
                         rewards=Rewards(Reward()), layout=RolloutLayout(rank=0, world_size=1,
                                                                  engine_tp=1, train_tp=1,
                                                                  train_pp=1))
    ro = c.next(version=0)  # this step's batch; the next one is drawn on the thread
    assert len(ro.completions) == 8
    with pytest.raises(RuntimeError, match="async rollout thread failed") as e:
        c.join()
    assert isinstance(e.value.__cause__, ValueError) and c.failure is None
    c.join()  # reported once; nothing pending
