"""Micro-batching levers of the update and scoring passes (issue 11): length-sorted,
trimmed micro-batches, token-budget micro-batches, sequences packed end to end (thd) and logits
only at loss positions change no result beyond float summation order. Unit checks of the
plan, then one rank launch (tests/_microbatch_worker.py, DP=2) comparing each lever
against the plain layout on the same batch: scored log-probs, reference log-probs, DP-reduced
gradients and loss reports, for the token-level (grpo) and sequence-level (gspo) ratio; the
reference pass reused while the reference equals the policy."""
import os

import pytest
import torch

from megagrpo.parallel.batch import pack, plan_micro_batches, unplan
from megagrpo.parallel.positions import loss_positions, put, take
from tests.support.launch import run_ranks_results

WORKER = os.path.join(os.path.dirname(__file__), "_microbatch_worker.py")


def _batch(n=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 9, (n, 2), generator=g).tolist()
    prompts = [[1 + (i + j) % 7 for j in range(p)] for i, (p, _) in enumerate(lens)]
    comps = [[10 + (i + j) % 5 for j in range(c)] for i, (_, c) in enumerate(lens)]
    lps = [[-0.1 * (j + 1) for j in range(len(c))] for c in comps]
    return pack(prompts, comps, lps, torch.linspace(-1, 1, n), pad_id=0, multiple=4), lens


def test_plan_sorts_trims_and_covers_every_row_once():
    b, lens = _batch()
    plan = plan_micro_batches(b, 3)
    rows = torch.cat([mb.index for mb in plan])
    assert sorted(rows.tolist()) == list(range(b.num_seqs))
    true_len = b.lengths.tolist()
    assert true_len[:11] == [p + c for p, c in lens] and true_len[11:] == [0]
    order = [true_len[r] for r in rows.tolist()]
    assert order == sorted(order, reverse=True)  # longest first
    for mb in plan:
        width = max(max(true_len[r] for r in mb.index.tolist()), 1)
        assert mb.batch.ids.shape == (len(mb.index), width)
        assert torch.equal(mb.batch.ids, b.ids[mb.index, :width])
        assert torch.equal(mb.batch.mask, b.mask[mb.index, :width])
        assert not b.mask[mb.index, width:].any()  # nothing with a loss was cut
    # scattering per-micro-batch tensors back restores the parent's layout exactly
    back = unplan([mb.batch.rollout_logp for mb in plan], plan, tuple(b.ids.shape))
    assert torch.equal(back, b.rollout_logp)


def test_token_budget_bounds_every_micro_batch():
    b, _ = _batch(n=23, seed=1)
    for budget in (1, 10, 16, 40):
        plan = plan_micro_batches(b, 3, token_budget=budget)
        assert sorted(torch.cat([mb.index for mb in plan]).tolist()) == list(range(b.num_seqs))
        for mb in plan:  # one row may exceed a budget below its own length, never two
            assert mb.batch.ids.numel() <= budget or len(mb.index) == 1
    plain = plan_micro_batches(b, 3, trim=False)
    assert [mb.index.tolist() for mb in plain] == [list(range(i, min(i + 3, 24)))
                                                    for i in range(0, 24, 3)]
    assert all(mb.batch.ids.shape[1] == b.ids.shape[1] for mb in plain)


def test_positions_take_and_put_round_trip():
    b, _ = _batch()
    flat = loss_positions(b.mask)
    assert flat.numel() == int(b.mask.sum())
    assert torch.equal(put(take(b.rollout_logp, flat), flat, tuple(b.ids.shape)), b.rollout_logp)
    none = loss_positions(torch.zeros(2, 3, dtype=torch.bool))
    assert none.tolist() == [0]  # one (masked) position keeps the output non-empty


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    work = tmp_path_factory.mktemp("microbatch")
    return run_ranks_results(WORKER, 2, work, timeout=900)


@pytest.mark.parametrize("agg", ["grpo", "gspo"])
def test_levers_equal_the_plain_layout(results, agg):
    for rank in results:
        for name, r in rank[agg].items():
            assert r["logp_diff"] < 1e-5 and r["ref_diff"] < 1e-5, (agg, name, r)
            assert r["logp_offmask_zero"], (agg, name)
            assert r["grad_rel"] < 1e-5, (agg, name, r)
            assert all(v < 1e-5 for v in r["report_rel"].values()), (agg, name, r)


def test_trimming_and_budget_process_fewer_tokens(results):
    for rank in results:
        r = rank["grpo"]
        full = sum(r["baseline"]["tokens"])
        assert sum(r["trim"]["tokens"]) < full  # lengths vary, so sorting trims padding
        assert all(t <= r["budget"]["budget"] or t <= max(rank["lengths"])
                   for t in r["budget"]["tokens"])
        # DP replicas may cut different numbers of micro-batches; both still sum the same loss
        assert r["budget"]["micro_batches"] >= 1


def test_packed_micro_batches_hold_no_padding(results):
    """Packed end to end, the model processes exactly the real tokens (the plain layout pads
    every row to the batch's longest), and each micro-batch stays within the token budget
    unless one sequence alone exceeds it."""
    for rank in results:
        r = rank["grpo"]["packed"]
        assert sum(r["tokens"]) == r["real_tokens"] < sum(rank["grpo"]["baseline"]["tokens"]), r
        assert all(t <= r["budget"] or t <= max(rank["lengths"]) for t in r["tokens"]), r
        assert r["micro_batches"] < rank["grpo"]["budget"]["micro_batches"], r


def test_reference_pass_reused_only_while_it_equals_the_policy(results):
    """While the reference is bitwise the policy (reset with alpha 1, no update since), its
    log-probs come from the policy's scoring pass and equal its own pass bitwise; once an
    optimizer step moves the policy, the reference pass runs again."""
    for rank in results:
        r = rank["reuse"]
        assert r["equal_before"] and r["bitwise"] and r["reused"] == [0.0, 1.0], r
        assert not r["equal_after"] and r["reused_after"] == [0.0, 0.0], r
        assert r["bitwise_after"] and r["moved"] == 0.0, r  # the reference itself did not move


def test_packed_rows_index_maps():
    """PackedRows against a direct construction: tokens row after row, positions restart,
    unpad_index puts each token at its row and position of the padded grid, and unpacked flat
    positions map to the same tokens."""
    b, _ = _batch(n=7, seed=3)
    plan = plan_micro_batches(b, 3, token_budget=20, packed=True)
    assert sorted(torch.cat([mb.index for mb in plan]).tolist()) == list(range(b.num_seqs))
    for mb in plan:
        p, sub = mb.packed, mb.batch
        lens = b.lengths[mb.index].clamp(min=1).tolist()
        assert sum(lens) <= 20 or len(lens) == 1
        want_ids = torch.cat([sub.ids[i, :n] for i, n in enumerate(lens)])
        want_pos = torch.cat([torch.arange(n) for n in lens])
        assert torch.equal(p.ids[0], want_ids) and torch.equal(p.position_ids[0], want_pos)
        assert p.cu_seqlens.tolist() == [sum(lens[:i]) for i in range(len(lens) + 1)]
        row = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        assert p.grid == (len(lens), max(lens))
        assert torch.equal(p.unpad_index, row * max(lens) + want_pos)
        flat = loss_positions(sub.mask)
        W = sub.ids.shape[1]
        assert torch.equal(p.ids[0, p.positions(flat, W)], sub.ids.reshape(-1)[flat])
    with pytest.raises(ValueError, match="token budget"):
        plan_micro_batches(b, 3, packed=True)


def test_zero_advantage_rows_are_skipped_without_changing_the_gradient(results):
    """beta = 0, half the rows with advantage 0: skipping their forward/backward leaves the
    DP-reduced gradient and the loss as they were, and processes about half the tokens."""
    for rank in results:
        r = rank["skip"]
        assert r["grad_norm"] > 0 and r["grad_rel"] < 1e-5 and r["loss_diff"] < 1e-6, r
        n_all, n_kept = r["rows"]
        assert n_kept < n_all and r["tokens"][1] < r["tokens"][0], r
        # scoring (truncated rollout IS) skips those rows too and changes nothing else
        assert r["score_skipped_zero"] and r["score_mask_equal"], r
        assert r["score_old_diff"] < 1e-5 and r["score_is_diff"] < 1e-5, r


@pytest.mark.parametrize("mode", ["sync", "async", "k2"])
def test_epoch_reset_lands_before_the_first_batch_of_each_epoch(results, mode):
    """DeepSeekMath Alg. 1 resets the reference before an iteration's first batch: with 3
    batches per epoch, steps 4 and 7 open epochs 1 and 2, are reset before scoring (reason
    'epoch') and so score against a reference bitwise the policy (its pass reused); no other
    step resets or reuses (before the fix the reset came after step 4's update). k2
    (rollout.max_staleness=2): the stream drew epoch 1's first batch at step 2, but epochs
    are the prompts the trainer consumes (issue 30, item 5)."""
    for rank in results:
        steps = rank[f"epoch_{mode}"]
        assert [s[0] for s in steps] == [0, 0, 0, 1, 1, 1, 2], steps
        assert [s[1] for s in steps] == ["", "", "", "epoch", "", "", "epoch"], steps
        assert [s[2] for s in steps] == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0], steps


@pytest.mark.parametrize("key", ["balance", "balance_stale"])
def test_token_balanced_dp_equals_the_rollouts_own_layout(results, key):
    """compute.balance_tokens (issue 32 item 4): the same rollout with its sequences moved
    between the two replicas by token count gives the DP-reduced gradient and the DP-summed
    loss of the unbalanced layout (summation order apart); rows did move, no token was lost,
    and the logged imbalance fell (replica 0's rollout is cut short on purpose).
    balance_stale: an async batch whose samples lag by 0, 1 and 3 versions (k = 1, weighted):
    each row's lag moves with it, so the fresh rows' weight and the stale rows' loss scale
    stay theirs (stop 37 found balancing crash on such a batch)."""
    moved = False
    for rank in results:
        r = rank[key]
        assert (r["stale_weighted"] > 0) == (key == "balance_stale"), r  # lag-3 rows scaled
        assert r["grad_rel"] < 1e-5, r
        assert abs(r["loss"][1] - r["loss"][0]) <= 1e-6 * (1 + abs(r["loss"][0])), r
        assert r["tokens"][0] == r["tokens"][1] > 0, r
        assert abs(r["entropy"][1] - r["entropy"][0]) <= 1e-5 * abs(r["entropy"][0]), r
        assert r["imbalance_off"][0] == r["imbalance_off"][1] == r["imbalance_on"][1], r
        assert 1.0 <= r["imbalance_on"][0] < r["imbalance_on"][1], r
        moved |= not r["same_rows_here"]
    assert moved, [rank["balance"] for rank in results]
