"""Packing rollouts into aligned [N, S] training tensors, checked token by token."""
import math

import pytest
import torch

from megagrpo import algo
from megagrpo.parallel.batch import pack


def test_pack_aligns_targets_mask_and_logprobs():
    prompts = [[5, 6, 7], [5, 8]]
    comps = [[9, 3], [10, 11, 3]]
    lps = [[-0.5, -0.25], [-1.0, -2.0, -3.0]]
    b = pack(prompts, comps, lps, torch.tensor([1.5, -0.5]), pad_id=0, multiple=4)
    assert b.ids.shape == (4, 5)  # S = max(3+2, 2+3); rows padded to a multiple of 4
    assert b.ids[0].tolist() == [5, 6, 7, 9, 3] and b.ids[1].tolist() == [5, 8, 10, 11, 3]
    for i, (p, c, lp) in enumerate(zip(prompts, comps, lps)):
        for t in range(b.ids.shape[1]):
            j = t - (len(p) - 1)  # completion token predicted at logits position t
            in_comp = 0 <= j < len(c)
            assert bool(b.mask[i, t]) == in_comp
            if in_comp:
                assert b.target[i, t] == c[j] == b.ids[i, t + 1]
                assert b.rollout_logp[i, t] == lp[j]
                assert b.advantages[i, t] == [1.5, -0.5][i]
    assert not b.mask[2:].any() and b.seq_valid.tolist() == [True, True, False, False]


def test_completion_mask_drops_sequence_and_microbatches_are_views():
    b = pack([[1, 2], [1, 3]], [[4, 5], [6]], [[0.0, 0.0], [0.0]], torch.ones(2), pad_id=0,
             completion_mask=torch.tensor([True, False]))
    assert b.mask[0].sum() == 2 and b.mask[1].sum() == 0
    mbs = b.micro_batches(1)
    assert len(mbs) == 2 and mbs[1].ids.data_ptr() == b.ids[1:].data_ptr()


def _rollout(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 5, (n, 2), generator=g).tolist()
    prompts = [[1 + (i + j) % 7 for j in range(p)] for i, (p, _) in enumerate(lens)]
    comps = [[10 + (i * 3 + j) % 5 for j in range(c)] for i, (_, c) in enumerate(lens)]
    lps = [[-0.1 * (j + 1) - i for j in range(len(c))] for i, c in enumerate(comps)]
    return prompts, comps, lps


def test_spread_rows_leaves_no_minibatch_all_padding():
    """3 prompts x G=8 = 24 sequences, 4 minibatches of micro-batch 4: padding to the end left
    the last minibatch (rows 24..31) without a real sequence; spread, each holds 6."""
    prompts, comps, lps = _rollout(24)
    adv = torch.linspace(-1, 1, 24)
    b = pack(prompts, comps, lps, adv, pad_id=0, multiple=16, blocks=4)
    assert b.num_seqs == 32
    per_block = b.seq_valid.view(4, 8).sum(1).tolist()
    assert per_block == [6, 6, 6, 6]
    # real rows keep their order and their data: row r of the i-th real sequence
    rows = b.seq_valid.nonzero().squeeze(1).tolist()
    assert rows == sorted(rows)
    for i, r in enumerate(rows):
        L, c = len(prompts[i]), comps[i]
        assert b.ids[r, :L + len(c)].tolist() == prompts[i] + c
        assert b.mask[r].sum() == len(c) and (b.advantages[r][b.mask[r]] == adv[i]).all()
        assert b.rollout_logp[r, L - 1:L - 1 + len(c)].tolist() == pytest.approx(lps[i])
    assert not b.mask[~b.seq_valid].any()
    assert torch.equal(b.real(torch.arange(32)), torch.tensor(rows))
    # uneven: 10 sequences in 4 blocks -> 3, 3, 2, 2
    assert pack(*_rollout(10), torch.zeros(10), pad_id=0, multiple=16,
                blocks=4).seq_valid.view(4, 4).sum(1).tolist() == [3, 3, 2, 2]
    with pytest.raises(ValueError, match="blocks=3"):
        pack(prompts, comps, lps, adv, pad_id=0, multiple=16, blocks=3)


@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "gspo", "dapo"])
def test_minibatch_losses_finite_and_match_float64(mode):
    """Each minibatch's loss, summed over its micro-batches with the trainer's global counts,
    equals a float64 loop over that minibatch's real sequences, and is finite."""
    prompts, comps, lps = _rollout(24, seed=3)
    b = pack(prompts, comps, lps, torch.zeros(24), pad_id=0, multiple=16, blocks=4)
    g = torch.Generator().manual_seed(4)
    tok_loss = torch.randn(b.mask.shape, generator=g, dtype=torch.float64)
    rows, micro = b.num_seqs // 4, 4
    for k in range(4):
        mini = b.rows(k * rows, (k + 1) * rows)
        real = [r for r in range(rows) if mini.seq_valid[r]]
        counts = algo.LossCounts(num_tokens=float(mini.mask.sum()),
                                 num_seqs=float((mini.mask.any(1) & mini.seq_valid).sum()),
                                 max_len=8.0)
        total = 0.0
        for lo in range(0, rows, micro):
            mb_mask = mini.mask[lo:lo + micro]
            S = mb_mask.shape[1]
            total += float(algo.aggregate_loss(
                tok_loss[k * rows + lo:k * rows + lo + micro].reshape(-1),
                mb_mask.reshape(-1).double(), torch.arange(micro).repeat_interleave(S),
                mode=mode, counts=counts, num_local_seqs=micro))
        seq_sum = [float((tok_loss[k * rows + r] * mini.mask[r]).sum()) for r in real]
        seq_len = [float(mini.mask[r].sum()) for r in real]
        want = {"grpo": sum(s / n for s, n in zip(seq_sum, seq_len)) / len(real),
                "gspo": sum(s / n for s, n in zip(seq_sum, seq_len)) / len(real),
                "dr_grpo": sum(seq_sum) / (len(real) * 8.0),
                "dapo": sum(seq_sum) / sum(seq_len)}[mode]
        assert math.isfinite(total) and total == pytest.approx(want, abs=1e-12), (k, total)
