"""Run on local ranks (2 ranks, DP=2, TP=1, PP=1, gloo) by tests/test_microbatch.py: the same
rollout batch scored and back-propagated with every micro-batching lever off (consecutive
rows at full width, logits at every position) and on (length-sorted trimmed micro-batches,
token-budget micro-batches, logits at loss positions only). Rank 0 writes WORK/results.json."""
import argparse
import copy
from functools import partial

import torch

from tests._trainer_worker import make_config
from tests.support.launch import write_results

VARIANTS = {  # trim, logits at loss positions only, token budget, packed end to end
    "baseline": (False, False, 0, False),
    "trim": (True, False, 0, False),
    "positions": (False, True, 0, False),
    "trim+positions": (True, True, 0, False),
    "budget": (True, True, 24, False),
    "packed": (True, True, 40, True),
}


def grads_and_report(tr, mini, trained=None) -> tuple[list[torch.Tensor], dict, int, list[int]]:
    """One forward/backward of the GRPO loss over `mini` (no optimizer step; `trained`: the
    rows that run, default all): the DP-reduced gradients, the summed reports, the
    micro-batch count and the tokens each processed."""
    from megagrpo.model.optim import zero_grad
    from megagrpo.train.losses import grpo_loss

    m = tr.passes.micro_size(mini.num_seqs)
    plan = tr.passes.plan(mini if trained is None else trained, m)
    ctx = tr.passes.loss_context(scale=len(plan) * tr.ranks.dp,
                                 counts=tr.passes.counts(mini, len(plan)), algo=tr.cfg.algo,
                                 inplace_backward=True)
    zero_grad(tr.policy, tr.optimizer)
    out = tr.passes.run(tr.policy, partial(grpo_loss, ctx), plan, mini.ids.shape[1], m)
    grads = [p.main_grad.detach().clone() for p in tr.policy.parameters()]
    keys = ("loss", "tokens", "kl_sum", "entropy_sum", "ratio_sum")
    report = {k: float(sum(float(o[k]) for o in out)) for k in keys}
    return grads, report, len(plan), [
        int((mb.batch.ids if mb.packed is None else mb.packed.ids).numel()) for mb in plan]


def compare(tr, batch) -> dict:
    res, base = {}, None
    for name, (trim, positions, budget, packed) in VARIANTS.items():
        tr.cfg.compute.trim_micro_batches, tr.cfg.compute.logits_at_loss_positions = trim, positions
        tr.cfg.compute.micro_batch_tokens, tr.passes.packed = budget, packed
        logp = tr.passes.logprobs(tr.policy, batch)
        ref = tr.passes.logprobs(tr.reference.model, batch)
        grads, report, n_mb, sizes = grads_and_report(tr, batch)
        if base is None:
            base = (logp, ref, grads, report)
        mask = batch.mask
        res[name] = {
            "logp_diff": float((logp - base[0])[mask].abs().max()),
            "ref_diff": float((ref - base[1])[mask].abs().max()),
            "logp_offmask_zero": bool((logp[~mask] == 0).all()),
            "grad_rel": max(float((g - b).norm() / b.norm().clamp_min(1e-30))
                            for g, b in zip(grads, base[2])),
            # |diff| / (1 + |value|): the loss of a zero-mean-advantage batch is near 0
            "report_rel": {k: abs(report[k] - base[3][k]) / (1.0 + abs(base[3][k]))
                           for k in report},
            "micro_batches": n_mb, "tokens": sizes, "budget": budget,
            "padded_rows_width": int(batch.ids.shape[1]),
            "real_tokens": int(batch.lengths.clamp(min=1).sum()),
        }
    return res


def skip_check(tr, batch) -> dict:
    """beta = 0: half the rows get advantage 0; the update's gradient and loss with those rows
    skipped (compute.skip_zero_advantage) vs run."""
    tr.cfg.algo.beta, tr.cfg.algo.loss_agg = 0.0, "grpo"
    batch.advantages[::2] = 0.0
    runs = {}
    for skip in (False, True):
        tr.cfg.compute.skip_zero_advantage = skip
        trained = tr.passes.trained_rows(batch, tr.loss_has_kl())
        runs[skip] = grads_and_report(tr, batch, trained) + (trained.num_seqs,)
    (g0, r0, _, s0, n0), (g1, r1, _, s1, n1) = runs[False], runs[True]
    # scoring with truncated rollout IS: the skipped rows are not scored, the others get the
    # same old log-probs and weights, and no row's mask changes differently
    tr.cfg.algo.rollout_is, tr.cfg.algo.rollout_is_cap = "truncate", 1.0 + 1e-7
    scored = {}
    for skip in (False, True):
        tr.cfg.compute.skip_zero_advantage = skip
        b = copy.deepcopy(batch)
        b.mask = batch.mask.clone()
        scored[skip] = score_stage(tr, b)
    keep = (batch.advantages != 0).any(dim=1)
    full, part = scored[False], scored[True]
    m = batch.mask & keep[:, None]
    return {"grad_rel": max(float((a - b).norm() / b.norm().clamp_min(1e-30))
                            for a, b in zip(g1, g0)),
            "grad_norm": float(sum(b.norm() ** 2 for b in g0) ** 0.5),
            "loss_diff": abs(r1["loss"] - r0["loss"]), "rows": [n0, n1],
            "tokens": [sum(s0), sum(s1)],
            "score_old_diff": float((part.old_logp - full.old_logp)[m].abs().max()),
            "score_skipped_zero": bool((part.old_logp[~keep] == 0).all()),
            "score_is_diff": float((part.is_weight - full.is_weight)[m].abs().max()),
            "score_capped": float((full.is_weight[m] < 1).float().mean()),
            "score_mask_equal": bool(torch.equal(part.mask, full.mask))}


def score_stage(tr, b):
    """The step's scoring stage on `b` (old log-probs, then the rollout-IS correction)."""
    from megagrpo.train.advantage import rollout_is

    s = tr.score(b, async_batch=False)
    b.old_logp, b.ref_logp = s.old_logp, s.ref_logp
    if b.old_logp is not None:  # the last stage
        corr = rollout_is(b, s.rows, tr.cfg.algo)
        b.mask, b.is_weight = corr.mask, corr.weight
    return b


def reuse_check(tr, batch) -> dict:
    """compute.reuse_equal_reference: while the reference is bitwise the policy, its log-probs are
    taken from the policy's scoring pass, bitwise what its own pass gives; after an optimizer
    step they are computed again."""
    from megagrpo.model.gpt import unwrap

    def scored(reuse: bool):
        tr.cfg.compute.reuse_equal_reference = reuse
        s = tr.score(copy.deepcopy(batch), async_batch=False)
        return s.ref_logp, float(s.reference_reused)

    res = {"equal_before": tr.reference.equals(unwrap(tr.policy))}
    (own, r0), (reused, r1) = scored(False), scored(True)
    res.update(bitwise=bool(torch.equal(own, reused)), reused=[r0, r1])
    tr.update(copy.deepcopy(batch))  # optimizer steps: the policy moves away
    res["equal_after"] = tr.reference.equals(unwrap(tr.policy))
    (own, r0), (again, r1) = scored(False), scored(True)
    res.update(bitwise_after=bool(torch.equal(own, again)), reused_after=[r0, r1],
               moved=float((own - reused)[batch.mask].abs().max()))
    return res


def epoch_check(tr, async_rollout: bool, k: int | None = None) -> dict:
    """reference.sync_every_epoch with 3 batches per epoch: the reference is reset before the
    first batch of each new epoch is scored, so that batch's reference pass is the policy's
    own (reused bitwise); the other batches are scored against a reference the policy has left.
    Sync or async rollouts alike, and k = 2 batches drawn ahead (`k`: rollout.max_staleness),
    where the stream draws an epoch's prompts two steps before the trainer consumes them. Per
    step: (epoch, reference_sync, reference_pass_reused)."""
    from megagrpo.data import PromptLoader
    from megagrpo.model.reference import ReferenceState

    c = tr.cfg
    c.algo.beta, c.algo.rollout_is = 0.05, "none"  # (skip_check left beta 0: no KL in the loss)
    c.reference.sync_every_steps, c.reference.sync_every_epoch = 0, True
    c.compute.reuse_equal_reference, c.run.async_rollout = True, async_rollout
    c.rollout.max_staleness = k
    tr.rollouts.queue.clear()  # batches an earlier check drew ahead from another loader
    tr.rollouts.loader = PromptLoader(tr.task.train[:12], c.data.batch_size, tr.ranks.dp_rank,
                                      tr.ranks.dp, seed=5)
    tr.reference.state = ReferenceState(last_sync_step=tr.step_idx)  # this loader's epoch 0
    steps = []
    for _ in range(7):
        m = tr.step()
        steps.append([m["epoch"], m["reference_sync"], m["reference_pass_reused"]])
    tr.rollouts.join()
    c.run.async_rollout, c.rollout.max_staleness = False, None
    return steps


def balance_check(tr, ro, stale: bool = False) -> dict:
    """compute.balance_tokens off vs on for the same rollout: the scored old log-probs feed the
    loss (mu = 2), then one forward/backward; the DP-reduced gradients and the DP-summed loss
    must agree to summation order. Also: how many rows changed replica, the imbalance.
    `stale`: an async batch whose samples lag the trainer by 0, 1 or 3 versions (k = 1,
    rollout.stale_policy=weight): the fresh rows' weight 1 under the decoupled default and the
    lag-3 rows' loss scale must travel with the rows balancing moves."""
    import torch.distributed as dist

    ro = copy.deepcopy(ro)
    if tr.ranks.dp_rank == 0:  # a lopsided rollout: replica 0's every other completion cut
        for c in ro.completions[::2]:
            c.token_ids, c.logprobs = c.token_ids[:1], c.logprobs[:1]
    saved = tr.version, tr.cfg.rollout.max_staleness, tr.cfg.rollout.stale_policy
    if stale:
        tr.version = ro.version + 3
        tr.cfg.rollout.max_staleness, tr.cfg.rollout.stale_policy = 1, "weight"
        for i, c in enumerate(ro.completions):
            c.version = tr.version - (0, 1, 3)[(i + tr.ranks.dp_rank) % 3]
    runs = {}
    for on in (False, True):
        tr.cfg.compute.balance_tokens = on
        batch, prep = tr.prepare(copy.deepcopy(ro))
        grads, report, _, _ = grads_and_report(tr, batch)
        loss = torch.tensor([report["loss"], report["tokens"], report["entropy_sum"]],
                            dtype=torch.float64)
        dist.all_reduce(loss, group=tr.groups.dp)
        keys = sorted(map(tuple, batch.ids[batch.seq_valid].tolist()))
        runs[on] = (grads, loss.tolist(), keys, prep.metrics)
    tr.cfg.compute.balance_tokens = None
    tr.version, tr.cfg.rollout.max_staleness, tr.cfg.rollout.stale_policy = saved
    (g0, l0, k0, m0), (g1, l1, k1, m1) = runs[False], runs[True]
    return {"stale_weighted": m1["stale_weighted"],
            "grad_rel": max(float((a - b).norm() / b.norm().clamp_min(1e-30))
                            for a, b in zip(g1, g0)),
            "loss": [l0[0], l1[0]], "tokens": [l0[1], l1[1]], "entropy": [l0[2], l1[2]],
            "rows_here": [len(k0), len(k1)], "same_rows_here": k0 == k1,
            "imbalance_off": [m0["token_imbalance"], m0["token_imbalance_before"]],
            "imbalance_on": [m1["token_imbalance"], m1["token_imbalance_before"]]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from megagrpo.run import setup

    cfg = make_config(args.work)
    cfg.parallel.tp = cfg.parallel.pp = 1
    cfg.compute.micro_batch_size = 3
    cfg.algo.mu = 2  # old log-probs are scored, so every per-token input takes the new path
    tr = setup(cfg)
    tr.sync_weights()
    ro = tr.rollout()
    res = {"balance": balance_check(tr, ro), "balance_stale": balance_check(tr, ro, stale=True)}
    batch, _ = tr.prepare(copy.deepcopy(ro))  # balanced (compute.balance_tokens unset: on)
    res["grpo"] = compare(tr, batch)
    tr.cfg.algo.loss_agg = "gspo"  # sequence-level ratios: per-token sequence ids matter
    res["gspo"] = compare(tr, batch)
    res["lengths"] = batch.lengths.tolist()
    tr.cfg.algo.loss_agg = "grpo"
    res["reuse"] = reuse_check(tr, batch)
    res["skip"] = skip_check(tr, batch)
    res["epoch_sync"] = epoch_check(tr, async_rollout=False)
    res["epoch_async"] = epoch_check(tr, async_rollout=True)
    res["epoch_k2"] = epoch_check(tr, async_rollout=False, k=2)
    write_results(res, args.work)
    tr.engine.close()


if __name__ == "__main__":
    main()
