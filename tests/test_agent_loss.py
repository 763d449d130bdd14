"""The GRPO loss of multi-turn trajectories (megagrpo.train.losses.grpo_loss on a packed batch with
per-token loss masks) against a float64 formula over the model tokens only, and the
environment tokens carrying no loss and no gradient whatever their log-probs."""
from __future__ import annotations

import torch

from megagrpo.algo import LossCounts
from megagrpo.config.algo import AlgoConfig
from megagrpo.parallel.batch import pack
from megagrpo.train.losses import LossContext, grpo_loss

V = 40


def trajectories(g: torch.Generator):
    """Two prompts x 2 trajectories of model / environment segments."""
    prompts, comps, masks = [], [], []
    for segments in ([5, 3, 4], [2, 6, 3, 2, 1], [7], [3, 1, 3]):
        ids, mask = [], []
        for k, n in enumerate(segments):  # even segments: the model's, odd: the environment's
            ids += torch.randint(0, V, (n,), generator=g).tolist()
            mask += [k % 2 == 0] * n
        prompts.append(torch.randint(0, V, (3,), generator=g).tolist())
        comps.append(ids)
        masks.append(mask)
    logps = [[-0.5 * (t % 3) - 0.1 if m else 0.0 for t, m in zip(c, mk)]
             for c, mk in zip(comps, masks)]
    return prompts, comps, masks, logps


def loss_and_grad(batch, logits: torch.Tensor, a: AlgoConfig):
    x = logits.clone().requires_grad_(True)
    ctx = LossContext(tp_group=None, valid_local_vocab=V, temperature=1.0, impl="torch",
                      algo=a, counts=LossCounts(num_tokens=float(batch.mask.sum()),
                                                num_seqs=float(batch.seq_valid.sum())))
    loss, _ = grpo_loss(ctx, batch, x)
    loss.backward()
    return loss.detach(), x.grad


def reference(batch, logits: torch.Tensor, a: AlgoConfig, token_mask: torch.Tensor):
    """float64 PPO-clip + beta * k3 per token, mean over each sequence's `token_mask` tokens,
    mean over sequences; and its gradient."""
    x = logits.double().clone().requires_grad_(True)
    logp = torch.log_softmax(x, -1).gather(-1, batch.target[..., None]).squeeze(-1)
    ratio = torch.exp(logp - batch.old_logp.double())
    A = batch.advantages.double()
    pg = -torch.minimum(ratio * A, ratio.clamp(1 - a.eps_low, 1 + a.eps_high) * A)
    d = logp - batch.ref_logp.double()
    tok = pg + a.beta * (torch.exp(-d) - 1 + d)
    m = token_mask.double()
    loss = ((tok * m).sum(1) / m.sum(1)).sum() / batch.num_seqs
    loss.backward()
    return loss.detach(), x.grad


def test_multi_turn_loss_is_single_turn_loss_over_model_tokens():
    g = torch.Generator().manual_seed(0)
    prompts, comps, masks, logps = trajectories(g)
    a = AlgoConfig(beta=0.04)
    batch = pack(prompts, comps, logps, torch.tensor([1.0, -0.5, 0.7, -1.2]), pad_id=0,
                 loss_masks=masks)
    # the single-turn batch over the same tokens: every completion token in the loss
    single = pack(prompts, comps, logps, torch.tensor([1.0, -0.5, 0.7, -1.2]), pad_id=0)
    env = single.mask & ~batch.mask  # the rows' environment-token targets
    assert int(env.sum()) == sum(len(m) - sum(m) for m in masks) and torch.equal(
        single.ids, batch.ids)
    N, S = batch.ids.shape
    logits = torch.randn(N, S, V, generator=g)
    # old / reference log-probs near the current ones: ratios around 1 (some clipped), small KL
    now = torch.log_softmax(logits, -1).gather(-1, batch.target[..., None]).squeeze(-1)
    batch.old_logp = now + 0.3 * torch.randn(N, S, generator=g)
    batch.ref_logp = now + 0.2 * torch.randn(N, S, generator=g)
    loss, grad = loss_and_grad(batch, logits, a)
    want, want_grad = reference(batch, logits, a, batch.mask)
    assert abs(float(loss) - float(want)) <= 1e-6 * max(1.0, abs(float(want)))
    assert torch.allclose(grad.double(), want_grad, atol=1e-7, rtol=1e-5)
    # the single-turn formula over all completion tokens differs: the mask matters
    assert abs(float(reference(batch, logits, a, single.mask)[0]) - float(want)) > 1e-3
    assert (grad[env] == 0).all()

    # perturb everything the environment tokens carry: the trainer's logits at their
    # positions, their old / reference / rollout log-probs
    p = batch.rows(0, N)
    p.old_logp = torch.where(env, batch.old_logp + 3.0, batch.old_logp)
    p.ref_logp = torch.where(env, batch.ref_logp - 2.0, batch.ref_logp)
    p.rollout_logp = torch.where(env, -7.0, batch.rollout_logp)
    logits2 = torch.where(env[..., None], 5 * torch.randn(N, S, V, generator=g), logits)
    loss2, grad2 = loss_and_grad(p, logits2, a)
    assert torch.equal(loss2, loss) and torch.equal(grad2, grad)


def test_dr_grpo_scale_does_not_grow_with_max_turns(monkeypatch):
    """Dr. GRPO's constant in a multi-turn run is the trajectory's budget (agent.max_total_tokens,
    or rollout.max_model_len), not rollout.max_tokens (one turn's): the constant is the same at
    1, 4 and 16 turns, and trajectories of full turns (up to the budget) with a loss of 1 per
    token give at most 1 per sequence (with max_tokens: up to max_turns)."""
    import megagrpo.train.passes as passes_mod
    from megagrpo.algo import aggregate_loss
    from megagrpo.config.train import TrainConfig
    from megagrpo.parallel.batch import Batch

    monkeypatch.setattr(passes_mod.dist, "all_reduce", lambda t, group=None: t)  # one replica
    losses = {}
    for budget in (0, 96):
        for turns in (1, 4, 16):
            cfg = TrainConfig()
            cfg.agent.environment, cfg.agent.max_turns = "tools", turns
            cfg.agent.max_total_tokens = budget
            cfg.rollout.max_tokens, cfg.rollout.max_model_len = 16, 128
            # model tokens: every turn full, up to the budget
            width = min(turns * cfg.rollout.max_tokens, budget or cfg.rollout.max_model_len)
            mask = torch.ones(2, width, dtype=torch.bool)
            batch = Batch(ids=torch.zeros(2, width, dtype=torch.long),
                          target=torch.zeros(2, width, dtype=torch.long), mask=mask,
                          advantages=torch.zeros(2, width), rollout_logp=torch.zeros(2, width),
                          seq_valid=torch.ones(2, dtype=torch.bool))
            counts = passes_mod.Passes(cfg).counts(batch, 1)
            loss = aggregate_loss(torch.ones(2 * width, dtype=torch.float64),
                                  mask.reshape(-1).double(),
                                  torch.arange(2).repeat_interleave(width), mode="dr_grpo",
                                  counts=counts, num_local_seqs=2)
            losses[budget, turns] = (counts.max_len, float(loss))
    print(f"\nDr. GRPO (constant, loss of full trajectories) per (budget, turns): {losses}")
    for budget in (0, 96):
        assert len({losses[budget, t][0] for t in (1, 4, 16)}) == 1
    assert all(loss <= 1.0 for _, loss in losses.values())
    assert losses[96, 16][1] == 1.0
