"""megagrpo.algo against hand-written float64 loops (independent of the vectorised code)."""
import math

import pytest
import torch

from megagrpo import algo
from megagrpo.config.algo import LOSS_AGGS, AlgoConfig

F64 = torch.float64


def _packed(lengths: list[int], seed: int = 0):
    """A packed chunk: per token loss, mask (first token of each seq is 'prompt'), seq ids."""
    g = torch.Generator().manual_seed(seed)
    seq_ids = torch.tensor([i for i, n in enumerate(lengths) for _ in range(n)])
    loss = torch.randn(len(seq_ids), generator=g, dtype=F64)
    mask = (torch.rand(len(seq_ids), generator=g) > 0.3).to(F64)
    return loss, mask, seq_ids


def _std(xs: list[float]) -> float:
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


@pytest.mark.parametrize("std_mode", ["group", "batch", "none"])
def test_group_advantages(std_mode):
    g = 4
    rewards = torch.tensor([1, 0, 0, 1, 1, 1, 1, 1, 0.5, 0, 2, 0], dtype=F64)
    got = algo.group_advantages(rewards, g, std_mode, eps=1e-6)
    r = rewards.tolist()
    for b in range(3):
        grp = r[b * g:(b + 1) * g]
        mean = sum(grp) / g
        scale = {"group": _std(grp) + 1e-6, "batch": _std(r) + 1e-6, "none": 1.0}[std_mode]
        for j in range(g):
            assert got[b * g + j].item() == pytest.approx((grp[j] - mean) / scale, abs=1e-12)
    with pytest.raises(ValueError, match="groups of 5"):
        algo.group_advantages(rewards, 5)


@pytest.mark.parametrize("std_mode", ["group", "batch", "none"])
def test_group_advantages_without_dropped_samples(std_mode):
    """A dropped sample (`valid` False) is as if its group had been drawn without it: the
    others' advantages use the mean and std of the valid members only (the batch std over the
    valid rewards); its own is 0, and so is a group left with one sample."""
    g = 4
    rewards = torch.tensor([1, 0, 0, 1, 1, 0, 0.25, 1, 0.5, 0, 2, 7], dtype=F64)
    valid = torch.tensor([1, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 1], dtype=torch.bool)
    got = algo.group_advantages(rewards, g, std_mode, eps=1e-6, valid=valid)
    r, v = rewards.tolist(), valid.tolist()
    kept = [x for x, ok in zip(r, v) if ok]
    for b in range(3):
        grp = [r[b * g + j] for j in range(g) if v[b * g + j]]
        for j in range(g):
            i = b * g + j
            if not v[i] or len(grp) < 2:
                assert got[i].item() == 0.0
                continue
            mean = sum(grp) / len(grp)
            scale = {"group": _std(grp) + 1e-6, "batch": _std(kept) + 1e-6,
                     "none": 1.0}[std_mode]
            assert got[i].item() == pytest.approx((r[i] - mean) / scale, abs=1e-12)
    every = torch.ones(12, dtype=torch.bool)  # all valid: the unmasked advantages
    assert torch.allclose(algo.group_advantages(rewards, g, std_mode, valid=every),
                          algo.group_advantages(rewards, g, std_mode), rtol=0, atol=1e-14)


def _reference_loss(mode, loss, mask, seq_ids, n_seqs, n_tok, max_len):
    per_seq_sum, per_seq_cnt = {}, {}
    for t in range(len(loss)):
        i = int(seq_ids[t])
        per_seq_sum[i] = per_seq_sum.get(i, 0.0) + float(loss[t] * mask[t])
        per_seq_cnt[i] = per_seq_cnt.get(i, 0.0) + float(mask[t])
    total = sum(per_seq_sum.values())
    if mode in ("grpo", "gspo"):
        return sum(per_seq_sum[i] / max(per_seq_cnt[i], 1) for i in per_seq_sum) / n_seqs
    if mode in ("dapo", "cispo", "bnpo"):
        return total / n_tok
    return total / (n_seqs * max_len)


@pytest.mark.parametrize("mode", LOSS_AGGS)
def test_aggregation_whole_batch_matches_reference(mode):
    lengths = [3, 7, 1, 5, 4]
    loss, mask, seq_ids = _packed(lengths)
    counts = algo.LossCounts(num_tokens=float(mask.sum()), num_seqs=5, max_len=8)
    got = algo.aggregate_loss(loss, mask, seq_ids, mode=mode, counts=counts)
    want = _reference_loss(mode, loss, mask, seq_ids, 5, float(mask.sum()), 8)
    assert got.item() == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("mode", sorted(set(LOSS_AGGS) - {"bnpo"}))
def test_aggregation_chunked_sums_to_whole_batch(mode):
    """Micro-batches on 2 'DP ranks' x 2 accumulation steps, with global counts, sum (float64)
    to the full-batch loss, values and gradients."""
    lengths = [3, 7, 1, 5, 4, 6, 2, 8]
    loss, mask, seq_ids = _packed(lengths, seed=1)
    loss.requires_grad_(True)
    counts = algo.LossCounts(num_tokens=float(mask.sum()), num_seqs=len(lengths), max_len=8)
    whole = algo.aggregate_loss(loss, mask, seq_ids, mode=mode, counts=counts)
    (g_whole,) = torch.autograd.grad(whole, loss)

    bounds = [0, 2, 3, 6, 8]  # uneven chunks of sequences
    starts = [sum(lengths[:b]) for b in bounds]
    chunks = [(starts[c], starts[c + 1], bounds[c], bounds[c + 1] - bounds[c]) for c in range(4)]
    totals = sum(algo.local_counts(mask[lo:hi], n) for lo, hi, _, n in chunks)  # "all-reduce"
    counts = algo.LossCounts.from_totals(totals, max_len=8)
    assert (counts.num_tokens, counts.num_seqs) == (float(mask.sum()), len(lengths))
    total = 0.0
    for lo, hi, first, n in chunks:
        total = total + algo.aggregate_loss(
            loss[lo:hi], mask[lo:hi], seq_ids[lo:hi] - first, mode=mode, counts=counts,
            num_local_seqs=n,
        )
    (g_chunks,) = torch.autograd.grad(total, loss)
    assert total.item() == pytest.approx(whole.item(), abs=1e-14)
    assert torch.allclose(g_chunks, g_whole, atol=1e-15, rtol=0)


def test_bnpo_normalises_per_chunk():
    loss, mask, seq_ids = _packed([4, 4], seed=2)
    counts = algo.LossCounts(num_tokens=999, num_seqs=999, num_chunks=2)
    got = algo.aggregate_loss(loss, mask, seq_ids, mode="bnpo", counts=counts)
    want = sum(float(loss[t] * mask[t]) for t in range(8)) / float(mask.sum()) / 2
    assert got.item() == pytest.approx(want, abs=1e-12)


def test_registry_matches_config_choices():
    assert set(algo.LOSS_AGGREGATIONS) == set(LOSS_AGGS)
    with pytest.raises(ValueError, match="loss_agg"):
        counts = algo.LossCounts(num_tokens=1, num_seqs=1)
        algo.aggregate_loss(*_packed([2]), mode="nope", counts=counts)


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_estimators(est):
    logp = torch.tensor([-0.1, -2.0, -0.7, -5.0], dtype=F64)
    ref = torch.tensor([-0.3, -1.0, -0.7, -2.5], dtype=F64)
    got = algo.kl_estimate(logp, ref, est)
    for t in range(4):
        r = math.exp(float(ref[t]) - float(logp[t]))
        want = {"k1": -math.log(r), "k2": 0.5 * math.log(r) ** 2, "k3": r - 1 - math.log(r)}[est]
        assert got[t].item() == pytest.approx(want, abs=1e-12)


def test_kl_k3_is_unbiased_for_kl():
    """Monte-Carlo: mean of k1 and k3 over samples of p both approach KL(p||q)."""
    p = torch.tensor([0.5, 0.3, 0.2], dtype=F64)
    q = torch.tensor([0.2, 0.2, 0.6], dtype=F64)
    exact = sum(float(p[i] * math.log(p[i] / q[i])) for i in range(3))
    x = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    for est in ("k1", "k3"):
        mc = algo.kl_estimate(p.log()[x], q.log()[x], est).mean().item()
        assert mc == pytest.approx(exact, abs=5e-3)


def test_kl_penalized_rewards():
    rewards = torch.tensor([1.0, 0.0, 0.5], dtype=F64)
    kl = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], dtype=F64)
    mask = torch.tensor([1, 1, 0, 1, 1, 1], dtype=F64)
    seq_ids = torch.tensor([0, 0, 1, 1, 2, 2])
    got, metrics = algo.kl_penalized_rewards(rewards, kl, mask, seq_ids, beta=0.5)
    want = [1.0 - 0.5 * 0.3, 0.0 - 0.5 * 0.4, 0.5 - 0.5 * 1.1]
    for i in range(3):
        assert got[i].item() == pytest.approx(want[i], abs=1e-12)
    assert metrics["kl_seq_mean"] == pytest.approx((0.3 + 0.4 + 1.1) / 3)


def test_filter_groups():
    rewards = torch.tensor([1, 1, 1, 0, 1, 0, 0.5, 0.5, 0.5, 0, 0, 1], dtype=F64)
    keep, n = algo.filter_groups(rewards, 3)
    want = [len(set(rewards[b * 3:(b + 1) * 3].tolist())) > 1 for b in range(4)]
    assert keep.tolist() == want and n == sum(want) == 2


def test_overlong_penalty():
    lengths = torch.tensor([10, 12, 13, 15, 16, 20, 25])
    got = algo.overlong_penalty(lengths, max_len=20, buffer=8, penalty=0.5, dtype=F64)
    for i, length in enumerate(lengths.tolist()):
        if length <= 12:
            want = 0.0
        elif length <= 20:
            want = (12 - length) / 8 * 0.5
        else:
            want = -0.5
        assert got[i].item() == pytest.approx(want, abs=1e-12)
    assert algo.overlong_penalty(lengths, 20, 0).abs().sum() == 0


def test_mask_truncated():
    mask = torch.tensor([0, 1, 1, 0, 1, 1, 1], dtype=F64)
    seq_ids = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    got, metrics = algo.mask_truncated(mask, seq_ids, torch.tensor([False, True, False]))
    assert got.tolist() == [0, 1, 1, 0, 0, 1, 1]
    assert metrics["truncated_frac"] == pytest.approx(1 / 3)


def _rollout_case():
    seq_ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    mask = torch.tensor([0, 1, 1, 1, 1, 1, 1, 0], dtype=F64)
    old = torch.tensor([-1.0, -0.5, -0.2, -1.0, -3.0, -0.1, -0.2, -9.0], dtype=F64)
    vllm = torch.tensor([-1.0, -0.6, -1.5, -1.1, -2.9, -0.1, -0.25, -1.0], dtype=F64)
    return old, vllm, mask, seq_ids


def test_rollout_is_truncate_and_metrics():
    old, vllm, mask, seq_ids = _rollout_case()
    w, m, metrics = algo.rollout_is_correction(old, vllm, mask, seq_ids, mode="truncate", cap=2.0)
    gaps = []
    for t in range(8):
        r = math.exp(float(old[t]) - float(vllm[t]))
        assert w[t].item() == pytest.approx(min(r, 2.0), abs=1e-12)
        if mask[t]:
            gaps.append(abs(float(old[t]) - float(vllm[t])))
    assert torch.equal(m, mask)
    assert metrics["rollout_logp_gap_mean"] == pytest.approx(sum(gaps) / len(gaps))
    assert metrics["rollout_logp_gap_max"] == pytest.approx(max(gaps))
    assert metrics["rollout_is_masked_frac"] == 0.0
    assert metrics["rollout_is_capped_frac"] == pytest.approx(1 / 6)  # token 2: exp(1.3) > 2


def test_rollout_is_token_and_seq_mask():
    old, vllm, mask, seq_ids = _rollout_case()
    w, m, metrics = algo.rollout_is_correction(
        old, vllm, mask, seq_ids, mode="token_mask", low=0.8, high=1.2)
    for t in range(8):
        r = math.exp(float(old[t]) - float(vllm[t]))
        assert m[t].item() == float(mask[t] and 0.8 <= r <= 1.2)
    assert torch.all(w == 1)
    assert metrics["rollout_is_masked_frac"] == pytest.approx(1 / 6)

    _, m, metrics = algo.rollout_is_correction(
        old, vllm, mask, seq_ids, mode="seq_mask", low=0.8, high=1.2, num_local_seqs=3)
    for s in range(3):
        toks = [t for t in range(8) if seq_ids[t] == s and mask[t]]
        geo = math.exp(sum(float(old[t]) - float(vllm[t]) for t in toks) / len(toks))
        ok = 0.8 <= geo <= 1.2
        for t in range(8):
            if seq_ids[t] == s:
                assert m[t].item() == float(bool(mask[t]) and ok)
    assert metrics["rollout_is_masked_frac"] == pytest.approx(2 / 6)  # sequence 0 out


def test_clip_fractions():
    ratio = torch.tensor([0.5, 0.9, 1.5, 1.1, 4.0, 0.7], dtype=F64)
    adv = torch.tensor([-1.0, -1.0, 1.0, 1.0, -1.0, 1.0], dtype=F64)
    mask = torch.tensor([1, 1, 1, 1, 1, 0], dtype=F64)
    got = algo.clip_fractions(ratio, adv, mask, eps_low=0.2, eps_high=0.28, dual_clip_c=3.0)
    assert got == {"clip_frac_low": 1 / 5, "clip_frac_high": 1 / 5,
                   "clip_frac_dual": 1 / 5, "clip_frac": 2 / 5}


def test_completion_metrics():
    got = algo.completion_metrics(torch.tensor([3, 5, 10]), torch.tensor([False, False, True]))
    assert got == {"length_mean": 6.0, "length_max": 10.0, "length_min": 3.0,
                   "truncated_frac": pytest.approx(1 / 3)}


def test_reward_metrics():
    rewards = torch.tensor([1, 1, 0, 0, 1, 1, 0, 0, 0], dtype=F64)
    got = algo.reward_metrics(rewards, 3)
    assert got["pass_at_g"] == pytest.approx(2 / 3)
    assert got["groups_all_solved"] == 0.0
    assert got["groups_none_solved"] == pytest.approx(1 / 3)
    assert got["groups_zero_std"] == pytest.approx(1 / 3)
    assert got["reward_mean"] == pytest.approx(4 / 9)


def test_reward_metrics_count_the_correctness_verdict_not_the_summed_reward():
    # a bonus term lifts every summed reward to >= 1; only the verdicts say what was solved
    rewards = torch.tensor([2, 1, 1, 1, 1, 1], dtype=F64)
    correct = torch.tensor([True, False, False, False, False, False])
    got = algo.reward_metrics(rewards, 3, correct)
    assert got["pass_at_g"] == pytest.approx(1 / 2)
    assert got["groups_all_solved"] == 0.0 and got["groups_none_solved"] == pytest.approx(1 / 2)
    assert algo.reward_metrics(rewards, 3)["groups_all_solved"] == 1.0  # the summed view


def test_algo_config_validation():
    AlgoConfig().validate()
    bad = [dict(group_size=1), dict(eps_low=1.0), dict(loss_agg="x"), dict(dual_clip_c=0.5),
           dict(kl_estimator="k4"), dict(rollout_is="x"), dict(rollout_is_low=1.5),
           dict(std_mode="x"), dict(mu=0), dict(beta=-1.0)]
    for kw in bad:
        field = next(iter(kw))
        with pytest.raises(ValueError, match=f"algo.{field}"):
            AlgoConfig(**kw).validate()


@pytest.mark.parametrize("module", ["megagrpo/config/algo.py", "megagrpo/config/data.py"])
def test_every_config_field_has_a_docstring(module):
    """docs/config.md's generator reads the string literal after each dataclass field via ast."""
    import ast
    from pathlib import Path
    tree = ast.parse((Path(__file__).parents[1] / module).read_text())
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    assert classes
    for cls in classes:
        body = cls.body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign):
                nxt = body[i + 1] if i + 1 < len(body) else None
                ok = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                assert ok and isinstance(nxt.value.value, str), f"{cls.name}.{node.target.id}"


def test_kl_clamp_only_for_k3():
    """k1/k2 are never clamped (a clamp would zero their gradient); k3 takes the configured
    (input, output) clamp, 0 switching a side off."""
    assert algo.kl_clamp("k1", 20.0, 10.0) is None and algo.kl_clamp("k2", 20.0, 10.0) is None
    assert algo.kl_clamp("k3", 20.0, 10.0) == (20.0, 10.0)
    assert algo.kl_clamp("k3", 0.0, 5.0) == (math.inf, 5.0)
    c = AlgoConfig()
    assert (c.kl_clamp_input, c.kl_clamp_output) == (20.0, 10.0)


def test_bad_rewards():
    r = torch.tensor([1.0, float("nan"), 1e30, -2e6, float("inf"), -5.0])
    assert algo.bad_rewards(r, 1e6).tolist() == [False, True, True, True, True, False]
    assert algo.bad_rewards(r, 0.0).tolist() == [False, True, False, False, True, False]


def test_safety_config_validation():
    for kw in (dict(kl_clamp_input=-1.0), dict(kl_clamp_output=float("nan")),
               dict(max_abs_reward=-1.0)):
        field = next(iter(kw))
        with pytest.raises(ValueError, match=f"algo.{field}"):
            AlgoConfig(**kw).validate()
