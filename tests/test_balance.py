"""Token-balanced DP (compute.balance_tokens, megagrpo.train.balance): the LPT partition against
brute-force optimum and the list-scheduling bound, the rebalanced replicas' batches against
the rows they came from, and the config rules. The DP=2 check that loss and gradients with
balancing equal those without runs in tests/_microbatch_worker.py (tests/test_microbatch.py)."""
import itertools
import random

import pytest
import torch

from megagrpo.config.train import TrainConfig
from megagrpo.parallel.batch import pack
from megagrpo.train.balance import (
    _rows_of,
    balance_enabled,
    imbalance,
    lpt_partition,
    real_rows,
    rebalance,
)


def _optimum(weights: list[int], k: int) -> int:
    """Smallest max load over every assignment of the items to k bins (brute force)."""
    best = sum(weights)
    for a in itertools.product(range(k), repeat=len(weights)):
        loads = [0] * k
        for w, b in zip(weights, a):
            loads[b] += w
        best = min(best, max(loads))
    return best


@pytest.mark.parametrize("k", [2, 3])
def test_lpt_within_graham_bound_of_brute_force_optimum(k):
    rng = random.Random(k)
    for _ in range(40):
        w = [int(rng.lognormvariate(5, 1)) + 1 for _ in range(rng.randint(1, 8))]
        bins = lpt_partition(w, k)
        assert sorted(i for b in bins for i in b) == list(range(len(w)))
        worst = max(sum(w[i] for i in b) for b in bins)
        assert worst <= (4 / 3 - 1 / (3 * k)) * _optimum(w, k) + 1e-9


def test_lpt_list_scheduling_bound_on_long_tail():
    """Many lognormal lengths: every item exactly once, max load <= mean + (1 - 1/k) * max
    (any list schedule's bound), and far below the rollout's own contiguous split."""
    rng = random.Random(0)
    for k in (2, 4, 8):
        w = [int(rng.lognormvariate(7, 1.2)) + 1 for _ in range(512)]
        bins = lpt_partition(w, k)
        assert sorted(i for b in bins for i in b) == list(range(len(w)))
        loads = [sum(w[i] for i in b) for b in bins]
        assert max(loads) <= sum(w) / k + (1 - 1 / k) * max(w)
        contiguous = [sum(w[d * len(w) // k:(d + 1) * len(w) // k]) for d in range(k)]
        assert imbalance(loads) < 1.01 < imbalance(contiguous)
    assert lpt_partition([5, 5, 5], 2) == lpt_partition([5, 5, 5], 2)  # deterministic
    with pytest.raises(ValueError):
        lpt_partition([1], 0)


def _replica(seed: int, n: int, multiple: int, blocks: int, sigma: float = 0.9):
    g = torch.Generator().manual_seed(seed)
    lens = ((torch.randn(n, generator=g) * sigma + 1.5).exp().long() + 1).tolist()
    prompts = [[1 + seed, 2 + i % 5] for i in range(n)]
    comps = [[10 + (i + j) % 7 + seed for j in range(c)] for i, c in enumerate(lens)]
    lps = [[-0.01 * (j + 1 + i) for j in range(len(c))] for i, c in enumerate(comps)]
    adv = torch.randn(n, generator=g)
    return pack(prompts, comps, lps, adv, pad_id=0, multiple=multiple, blocks=blocks,
                seq_rewards=adv + 1)


def _keyed(batch, rows):
    """row -> (ids up to its length, mask, advantages, rollout_logp, reward) as a hashable key."""
    out = []
    for r in rows:
        n = int(batch.lengths[r])
        out.append((tuple(batch.ids[r, :n].tolist()), tuple(batch.mask[r].nonzero().flatten()
                                                             .tolist()),
                    tuple(batch.advantages[r, :n].tolist()),
                    tuple(batch.rollout_logp[r, :n].tolist()), float(batch.rewards[r])))
    return out


@pytest.mark.parametrize("n_mini", [1, 2])
def test_rebalance_moves_rows_whole_within_their_minibatch(n_mini):
    """Two replicas: the union of the rebalanced batches holds every real row exactly once,
    bit for bit, in the same global minibatch; padding rows are inert; loads even out."""
    reps = [_replica(s, n, 4, n_mini, sigma) for s, n, sigma in ((1, 13, 0.9), (2, 15, 1.2))]
    parts = [[_rows_of(b, block) for block in real_rows(b, n_mini)] for b in reps]
    out = [rebalance(parts, dp_rank=d, batch=reps[d], pad_id=0, per_micro=3)
           for d in range(2)]
    assert not any(b is r for (b, _), r in zip(out, reps))  # rows did move
    for k in range(n_mini):
        want = sorted(x for b in reps for x in _keyed(b, real_rows(b, n_mini)[k]))
        got = sorted(x for b, _ in out for x in _keyed(b, real_rows(b, n_mini)[k]))
        assert got == want
    for b, metrics in out:
        rows = b.num_seqs // n_mini
        assert b.num_seqs % n_mini == 0 and rows % min(3, rows) == 0
        pad = ~b.seq_valid
        assert not b.mask[pad].any() and (b.ids[pad] == 0).all() and (b.lengths[pad] == 0).all()
        assert torch.equal(b.target[:, :-1], b.ids[:, 1:])  # targets stay the shifted ids
        assert metrics == out[0][1]
    m = out[0][1]
    loads = [float(b.lengths.sum()) for b, _ in out]
    assert m["token_imbalance"] == pytest.approx(imbalance(loads))
    assert m["token_imbalance_before"] == pytest.approx(
        imbalance([float(b.lengths.sum()) for b in reps]))
    assert m["token_imbalance"] < m["token_imbalance_before"]
    # each block's list-scheduling bound: its mean + its longest row
    blocks = [[int(r["lengths"]) for d in range(2) for r in parts[d][k]] for k in range(n_mini)]
    assert max(loads) <= sum(sum(b) / 2 + max(b) for b in blocks)


def test_rebalance_keeps_a_split_it_cannot_improve():
    """Both replicas already hold equal tokens: nothing moves, the metrics say 1.0."""
    reps = [_replica(3, 6, 2, 1), _replica(3, 6, 2, 1)]
    parts = [[_rows_of(b, block) for block in real_rows(b, 1)] for b in reps]
    for d in range(2):
        b, m = rebalance(parts, dp_rank=d, batch=reps[d], pad_id=0, per_micro=2)
        assert b is reps[d] and m == {"token_imbalance": 1.0, "token_imbalance_before": 1.0}


def test_balance_config_rules():
    assert balance_enabled(None, loss_agg="grpo", kl_in_reward=False, dp=2)
    assert not balance_enabled(None, loss_agg="bnpo", kl_in_reward=False, dp=2)
    assert not balance_enabled(None, loss_agg="grpo", kl_in_reward=True, dp=2)
    assert not balance_enabled(True, loss_agg="grpo", kl_in_reward=False, dp=1)
    assert not balance_enabled(False, loss_agg="grpo", kl_in_reward=False, dp=4)
    cfg = TrainConfig()
    cfg.compute.balance_tokens, cfg.algo.loss_agg = True, "bnpo"
    with pytest.raises(ValueError, match="compute.balance_tokens=true with algo.loss_agg=bnpo"):
        cfg.validate()
    cfg.algo.loss_agg, cfg.algo.kl_in_reward, cfg.algo.beta = "grpo", True, 0.1
    with pytest.raises(ValueError, match="compute.balance_tokens=true with algo.kl_in_reward"):
        cfg.validate()


def test_token_balance_benchmark_smallest(capsys):
    """benchmarks/token_balance.py at its smallest size: LPT never leaves a replica with more
    tokens than the rollout's own split did."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "token_balance.py"
    spec = importlib.util.spec_from_file_location("token_balance", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    argv, sys.argv = sys.argv, ["token_balance.py", "--seqs", "32", "--dp", "2,4", "--seeds", "2"]
    try:
        mod.main()
    finally:
        sys.argv = argv
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["dp"] for r in rows] == [2, 4]
    assert all(1.0 <= r["imbalance_after_max"] <= r["imbalance_before_max"] for r in rows), rows


def test_balance_note_says_why_it_stays_off():
    from megagrpo.train.balance import balance_note

    assert balance_note(None, loss_agg="grpo", kl_in_reward=False, dp=2) is None
    assert balance_note(None, loss_agg="bnpo", kl_in_reward=False, dp=1) is None
    assert balance_note(False, loss_agg="bnpo", kl_in_reward=False, dp=2) is None
    assert "algo.loss_agg=bnpo" in balance_note(None, loss_agg="bnpo", kl_in_reward=False, dp=2)
    assert "algo.kl_in_reward" in balance_note(None, loss_agg="grpo", kl_in_reward=True, dp=4)


@pytest.mark.parametrize("n_mini", [1, 2])
def test_packed_exchange_rebuilds_the_rows_bit_for_bit(n_mini):
    """What balance_batch sends (`_pack_rows`: one tensor a field, rows laid end to end)
    unpacks to `_rows_of`'s row dicts exactly: the same fields, shapes, dtypes and values, so
    the rebalanced batch is the one the row-by-row exchange built; `_improves` takes
    `rebalance`'s keep-or-move decision from the lengths alone."""
    from megagrpo.train.balance import _improves, _pack_rows, _unpack_rows

    reps = [_replica(s, n, 4, n_mini, sigma) for s, n, sigma in ((1, 13, 0.9), (2, 15, 1.2))]
    for b in reps:
        mine = real_rows(b, n_mini)
        want = [_rows_of(b, block) for block in mine]
        got = _unpack_rows(_pack_rows(b, mine), [[int(b.lengths[r]) for r in bl] for bl in mine])
        assert [len(x) for x in got] == [len(x) for x in want]
        for rg, rw in zip((r for x in got for r in x), (r for x in want for r in x)):
            assert rg.keys() == rw.keys()
            for name in rw:
                assert rg[name].dtype == rw[name].dtype and torch.equal(rg[name], rw[name]), name
    lens = [[[int(b.lengths[r]) for r in bl] for bl in real_rows(b, n_mini)] for b in reps]
    assert _improves(lens)  # the lopsided pair above: rows move
    same = [_replica(3, 6, 2, 1), _replica(3, 6, 2, 1)]
    assert not _improves([[[int(b.lengths[r]) for r in real_rows(b, 1)[0]]] for b in same])


def test_moe_router_losses_follow_the_micro_batches():
    """What balancing does change (module docstring): megatron's MoE router losses, computed
    per micro-batch and averaged over the M micro-batches. The z-loss (a token mean of
    logsumexp^2 per micro-batch) weighs each token 1 / (M T_mb): unchanged by moving tokens
    between micro-batches of equal token counts, changed where the counts differ; the
    load-balancing loss E sum_i f_i P_i is a product of two micro-batch means and changes with
    which tokens share a micro-batch even at equal counts. Through megatron's own functions,
    float64."""
    from megatron.core.transformer.moe.moe_utils import (
        switch_load_balancing_loss_func,
        z_loss_func,
    )

    g = torch.Generator().manual_seed(0)
    E, k, T = 4, 2, 12
    logits = torch.randn(T, E, generator=g, dtype=torch.float64)
    routing = torch.zeros(T, E, dtype=torch.bool).scatter(1, logits.topk(k, -1).indices, True)

    def losses(layout: list[list[int]]) -> tuple[float, float, torch.Tensor, torch.Tensor]:
        """(aux, z, d aux / d logits, d z / d logits) of the step over micro-batches `layout`."""
        x = logits.clone().requires_grad_()
        m = len(layout)
        aux = sum(switch_load_balancing_loss_func(
            torch.softmax(x[i], -1), routing[i].sum(0), len(i), k, E, 1.0) for i in layout) / m
        z = sum(z_loss_func(x[i], 1.0) for i in layout) / m
        (ga,) = torch.autograd.grad(aux, x, retain_graph=True)
        (gz,) = torch.autograd.grad(z, x)
        return float(aux), float(z), ga, gz

    halves = losses([list(range(6)), list(range(6, 12))])
    mixed = losses([[0, 1, 2, 9, 10, 11], [3, 4, 5, 6, 7, 8]])  # equal token counts
    uneven = losses([list(range(4)), list(range(4, 12))])
    assert mixed[1] == pytest.approx(halves[1], rel=1e-12)
    torch.testing.assert_close(mixed[3], halves[3], rtol=1e-12, atol=0)
    lse2 = torch.logsumexp(logits, -1) ** 2
    assert uneven[1] == pytest.approx(float(lse2[:4].mean() + lse2[4:].mean()) / 2, rel=1e-12)
    assert abs(uneven[1] / halves[1] - 1) > 1e-3
    change = float((mixed[2] - halves[2]).norm() / halves[2].norm())
    print(f"\nload-balancing loss's router gradient, another grouping of equal counts: "
          f"{100 * change:.0f}% change")
    assert change > 0.05
