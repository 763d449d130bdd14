"""Packing rollouts into aligned [N, S] training tensors, checked token by token."""
import torch

from megagrpo.batch import pack


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
