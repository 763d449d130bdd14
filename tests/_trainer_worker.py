"""Run on local ranks (4 ranks, TP=2 x PP=2, gloo) by tests/test_trainer.py. One launch drives a
real trainer (megatron policy + reference, in-process vLLM per rank) through: on-policy steps,
the scheduled in-place reference reset, alpha mixing, checkpoint + resume of the schedule, and
async (one-step off-policy) rollouts. Rank 0 writes WORK/results.json."""
import argparse
import json
import os

import torch
import torch.distributed as dist

from tests._inflight_check import inflight_check
from tests._partial_check import agent_partial_check, partial_check
from tests.support.launch import write_results


def make_config(work):
    from megagrpo.config.train import load_config

    return load_config(None, [
        "model.vocab_size=19", "model.hidden_size=64", "model.ffn_hidden_size=128",
        "model.num_layers=2", "model.num_attention_heads=4", "model.num_query_groups=2",
        "model.head_dim=32", "model.max_position_embeddings=64",
        "parallel.tp=2", "parallel.pp=2", "parallel.make_vocab_size_divisible_by=16",
        "optim.lr=1e-3", "rollout.max_tokens=6", "rollout.max_model_len=64",
        "algo.group_size=4", "algo.beta=0.05", "reference.sync_every_steps=2",
        "data.batch_size=4", "arithmetic.num_train=256", "arithmetic.num_eval=8",
        f"arithmetic.tokenizer_dir={work}/tok",
        "reward.terms=[{name: 'tests._rewards:length_reward'}]",
        "compute.micro_batch_size=8", "compute.kernel_impl=torch", f"run.out_dir={work}/run",
        "run.steps=100", "log.progress=false", "log.tensorboard=false",
        # eager layers: the workers compare paths, not the compile (tests/test_compile.py);
        # (workers that set tp = pp = 1 and run.steps >= 200 would compile under auto)
        "compute.compile_layers=false",
    ])


def last_stage_logps(tr, batch):
    """(policy, reference) log-probs [N, S] on the last stage's TP rank 0, else None."""
    pol = tr.passes.logprobs(tr.policy, batch)
    ref = tr.passes.logprobs(tr.reference.model, batch)
    return (pol, ref) if pol is not None and tr.ranks.tp_rank == 0 else None


def _last_position(batch, model):
    out = model(batch, torch.arange(batch.shape[1]).expand_as(batch), None)
    return out, lambda o: (o.sum() * 0, {"last": o[0, -1].detach()})


def megatron_greedy(tr, prompts, max_tokens):
    """A plain argmax loop over the sharded megatron policy (PP schedule, TP-gathered logits)."""
    from megagrpo.model.optim import forward_backward

    outs = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(max_tokens):
            x = torch.tensor([ids])
            res = forward_backward(tr.policy, _last_position, [x], 1, seq_length=len(ids),
                                   micro_batch_size=1, forward_only=True)
            tok = torch.zeros(1, dtype=torch.long)
            if res:  # last stage: gather the vocab shards, drop padding, argmax
                local = res[0]["last"].contiguous()
                parts = [torch.empty_like(local) for _ in range(tr.cfg.parallel.tp)]
                dist.all_gather(parts, local, group=tr.groups.tp)
                tok[0] = torch.cat(parts)[: tr.model_cfg.vocab_size].argmax()
            dist.broadcast(tok, src=tr.ranks.pp_last_rank, group=tr.groups.pp)
            ids.append(int(tok))
            if int(tok) == tr.tokens.eos_id:
                break
        outs.append(ids[len(prompt):])
    return outs


def vllm_greedy(tr, prompts, max_tokens):
    from megagrpo.engine import SamplingSettings

    s = SamplingSettings(temperature=0.0, max_tokens=max_tokens, n=1,
                         stop_token_ids=(tr.tokens.eos_id,))
    return [c.token_ids for c in tr.engine.generate(prompts, s)]


def greedy_check(tr, n=4, max_tokens=6):
    from megagrpo.data import encode_prompt

    prompts = [encode_prompt(tr.tokenizer, e.prompt) for e in tr.task.eval[:n]]
    return megatron_greedy(tr, prompts, max_tokens), vllm_greedy(tr, prompts, max_tokens)


def reshard_peak(tr, bucket_bytes):
    """Peak bytes allocated while draining the reshard stream (consumer drops each tensor)."""
    from benchmarks._harness import _cpu_peak_bytes
    from megagrpo.sync.source import iter_hf_weights

    def drain():
        for _, t in iter_hf_weights(tr.policy, tr.model_cfg, tr.cfg.parallel,
                                    bucket_bytes=bucket_bytes):
            del t

    return _cpu_peak_bytes(drain)


def local_params(module):
    from megagrpo.model.gpt import unwrap

    return {n: p.detach().clone() for n, p in unwrap(module).named_parameters()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from megagrpo.model.optim import torch_adams
    from megagrpo.model.reference import ReferenceState, sync_reference
    from megagrpo.run import checkpoints, setup

    def fused_flags():
        return [g["fused"] for o in torch_adams(tr.optimizer) for g in o.param_groups]

    res = {}
    tr = setup(make_config(args.work))
    res["fused_adam"] = fused_flags()
    tr.sync_weights()
    res["greedy_initial"] = greedy_check(tr)
    bucket = 64 << 10
    largest = max(p.numel() for p in tr.policy.parameters()) * tr.cfg.parallel.tp * 4
    res["reshard_peak"] = [reshard_peak(tr, bucket), bucket, largest]
    before = local_params(tr.policy)
    ref_ptrs = [p.data_ptr() for p in tr.reference.model.parameters()]

    m1 = tr.step()  # step 1: no reference sync (every 2)
    res["greedy_after_step"] = greedy_check(tr)
    after = local_params(tr.policy)
    res["unchanged_params"] = [n for n in before if torch.equal(before[n], after[n])]
    res["gap_step1"] = m1["logp_gap_vllm_mean"]
    batch, _ = tr.build_batch(tr.rollout())
    lp1 = last_stage_logps(tr, batch)
    m2 = tr.step()  # step 2: the schedule re-initialises the reference in place
    lp2 = last_stage_logps(tr, batch)
    res["sync_reasons"] = [m1["reference_sync"], m2["reference_sync"]]
    res["ref_ptrs_unchanged"] = ref_ptrs == [p.data_ptr() for p in tr.reference.model.parameters()]
    if lp1 is not None:
        res["pre_sync_max_diff"] = float((lp1[0] - lp1[1]).abs().max())
        res["post_sync_equal"] = bool(torch.equal(lp2[0], lp2[1]))
        res["post_sync_valid_tokens"] = int(batch.mask.sum())

    checkpoints(tr).save(tr.step_idx)  # step 2, reference just synced
    saved = local_params(tr.policy)
    tr.step()  # step 3: policy moves on
    # alpha mixing: ref <- a * policy + (1 - a) * ref, against float64 math
    r0, p0 = local_params(tr.reference.model), local_params(tr.policy)
    sync_reference(tr.reference.model, tr.policy, 0.3)
    mixed = local_params(tr.reference.model)
    res["alpha_max_err"] = max(float((mixed[n].double() - (0.3 * p0[n].double() + 0.7 * r0[n]
                                                            .double())).abs().max()) for n in r0)
    res["alpha_moved"] = any(not torch.equal(mixed[n], r0[n]) for n in r0)

    # scramble the state, then resume from the step-2 checkpoint
    with torch.no_grad():
        for p in tr.policy.parameters():
            p.add_(1.0)
    tr.reference.state, tr.step_idx = ReferenceState(), 99
    checkpoints(tr).load(tr_ckpt(args.work))
    restored = local_params(tr.policy)
    res["fused_adam_after_resume"] = fused_flags()
    res["resume_policy_equal"] = all(torch.equal(saved[n], restored[n]) for n in saved)
    res["resume_state"] = [tr.step_idx, tr.reference.state.syncs, tr.reference.state.last_sync_step]
    tr.sync_weights()
    res["resume_sync_reasons"] = [tr.step()["reference_sync"] for _ in range(2)]  # steps 3, 4

    res["sync_versions"] = [[tr.step_idx + 1, tr.step()["policy_version_of_batch"]]]
    tr.cfg.run.async_rollout = True
    recs = [tr.step() for _ in range(3)]
    res["async_versions"] = [[r["step"], r["policy_version_of_batch"]] for r in recs]
    # issue 30: stale batches train with the decoupled correction under rollout_is=none
    res["async_offpolicy"] = [[r["policy_lag"], r["offpolicy_corrected"],
                               "logp_gap_vllm_mean" in r, "logp_gap_stale_mean" in r,
                               r.get("rollout_is_weight_mean"), r.get("rollout_logp_gap_mean")]
                              for r in recs]
    # issue 30: k = 2 batches drawn ahead (after k = 1 left one queued): per-sample staleness
    # within the bound, the queue depth the console shows, nothing dropped
    tr.cfg.rollout.max_staleness = 2
    res["k2_stream"] = [[r["policy_lag"], r["staleness_max"], r["staleness_mean"],
                         r["rollout_queue_depth"], r["stale_dropped"], r["offpolicy_corrected"],
                         r["trainer_idle_s"] >= 0, r["rollout_idle_s"] >= 0]
                        for r in (tr.step() for _ in range(3))]
    res["inflight"] = inflight_check(tr, greedy_check)  # issue 30 item 3, still at k = 2
    res["partial"] = partial_check(tr)  # issue 47 item 1, still at k = 2
    tr.cfg.rollout.max_staleness = None
    # off-policy machinery: mu=2 passes x 2 minibatches, old log-probs, truncated rollout IS,
    # token-level (dapo) aggregation, dual clip, GSPO-free
    tr.cfg.run.async_rollout = False
    tr.rollouts.join()
    for key, value in (("mu", 2), ("loss_agg", "dapo"), ("rollout_is", "truncate"),
                       ("dual_clip_c", 3.0)):
        setattr(tr.cfg.algo, key, value)
    tr.cfg.algo.num_minibatches, tr.cfg.compute.micro_batch_size = 2, 4
    steps_before = tr.opt_steps
    m = tr.step()
    res["offpolicy"] = {"opt_steps": tr.opt_steps - steps_before,
                        "old_vs_vllm_gap": m["rollout_logp_gap_mean"],
                        "ratio_mean": m["ratio_mean"], "loss": m["loss"],
                        "is_weight_mean": m["rollout_is_weight_mean"]}
    # DAPO dynamic sampling + GSPO sequence ratio + KL as a reward penalty + batch-std advantages
    for key, value in (("mu", 1), ("loss_agg", "gspo"), ("rollout_is", "none"),
                       ("dynamic_sampling", True), ("kl_in_reward", True),
                       ("std_mode", "batch")):
        setattr(tr.cfg.algo, key, value)
    tr.cfg.algo.num_minibatches = 1
    m = tr.step()
    res["variants"] = {k: m.get(k) for k in ("loss", "resample_rounds", "filtered_groups",
                                             "reward_mean", "kl")}
    # no silent wrong results (issue 10)
    res["kl_in_reward"] = kl_in_reward_check(tr)
    res["empty_minibatches"] = empty_minibatch_check(tr)
    res["eval_accuracy"] = eval_accuracy_check(tr)
    res["multi_turn"] = multi_turn_check(tr)
    res["agent_partial"] = agent_partial_check(tr)  # issue 47 item 1: multi-turn, k = 1
    bad = bad_steps_check(tr)
    err = bad.pop("error", None)
    res["bad_steps"] = bad
    write_results(res, args.work)
    if err is not None:
        stop_check(tr, err, args.work)  # closes the engine (and the default process group)
    else:
        tr.engine.close()


class HugeReward:
    """A reward function gone wrong: finite but absurd values (1e30 x a length score)."""

    def score(self, samples):
        from megagrpo.reward import Scores

        values = torch.tensor([1e30 * (1 + len(s.completion)) for s in samples])
        return Scores(rewards=values, per_term={"huge": values}, correct=values >= 1.0)

    def close(self):
        pass


def kl_in_reward_check(tr):
    """Score a fresh batch with KL in the reward; on the last stage compare the advantages with
    float64 math on its own old/reference log-probs: rewards - beta * sum k3, then the group
    baseline and std. None on the other ranks."""
    for key, value in (("dynamic_sampling", False), ("std_mode", "group"),
                       ("kl_in_reward", True)):
        setattr(tr.cfg.algo, key, value)
    a, G = tr.cfg.algo, tr.cfg.algo.group_size
    g = torch.Generator().manual_seed(0)  # the schedule may just have reset the reference
    with torch.no_grad():
        for p in tr.reference.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    batch, _ = tr.prepare(tr.rollout())
    if batch.old_logp is None or tr.ranks.tp_rank != 0:
        return None
    rows = batch.seq_valid.nonzero().squeeze(1)
    mask = batch.mask[rows]
    d = (batch.old_logp[rows].double() - batch.ref_logp[rows].double()).clamp(-20, 20)
    kl = ((torch.exp(-d) + d - 1).clamp(max=10) * mask).sum(1)
    shaped = (batch.rewards[rows].double() - a.beta * kl).view(-1, G)
    plain = batch.rewards[rows].double().view(-1, G)
    want, before = [((x - x.mean(1, keepdim=True)) / (x.std(1, keepdim=True) + a.std_eps))
                    .reshape(-1) for x in (shaped, plain)]
    got = torch.where(mask, batch.advantages[rows].double(), 0.0).sum(1) / mask.sum(1).clamp(min=1)
    has = mask.any(1)
    return {"max_err": float((got - want)[has].abs().max()),
            "moved": float((want - before)[has].abs().max())}


def empty_minibatch_check(tr):
    """One prompt's group (G=4 sequences) in 8 minibatches: 4 hold no real sequence. They must
    be skipped (no optimizer step, no LR advance) and the logged loss stay finite."""
    from megagrpo.rollout.collect import select_groups

    tr.cfg.algo.kl_in_reward = False
    tr.cfg.algo.num_minibatches = 8
    ro = tr.rollout()
    keep = torch.zeros(len(ro.prompts), dtype=torch.bool)
    keep[0] = True
    batch, _ = tr.prepare(select_groups(ro, keep, tr.cfg.algo.group_size))
    before = tr.opt_steps
    upd = tr.update(batch)
    tr.cfg.algo.num_minibatches = 1
    return {"rows": batch.num_seqs, "opt_steps": tr.opt_steps - before,
            "loss": upd.metrics["loss"], "skipped": upd.empty_minibatches,
            "grad_norm": upd.metrics["grad_norm"]}


EVAL_RIGHT = (0, 1, 4)
"""Held-out examples whose answer is set to their greedy completion (the rest get one it cannot
be): engines take every num_engines-th example, so the right ones fall unevenly on them."""


def known_share_eval(tr, reward_fn) -> dict:
    """evaluate() on the held-out prompts with answers chosen so that a known share is right:
    the greedy completions, decoded here on the engine with eval's sampling settings (rank 0's,
    broadcast: every engine must agree with them), are the answers of EVAL_RIGHT, and a wrong
    answer (completion + "9") of the others. `reward_fn` (a reward source) is installed for
    the evaluation.
    Returns what evaluate() reports, the share the task's own check (arithmetic.reward) scores
    on the completions decoded here, and the share by construction."""
    from megagrpo.data import Example, encode_prompt
    from megagrpo.engine import SamplingSettings
    from megagrpo.tasks.arithmetic import reward

    evals = tr.task.eval
    s = SamplingSettings(temperature=0.0, max_tokens=tr.cfg.eval.max_tokens, n=1,
                         stop_token_ids=tr.tokens.stop_ids)
    comps = tr.engine.generate([encode_prompt(tr.tokenizer, e.prompt) for e in evals], s)
    box = [[c.text or tr.tokenizer.decode(c.token_ids) for c in comps]]
    dist.broadcast_object_list(box, src=0, group=tr.groups.world)
    texts = box[0]
    examples = [Example(prompt=e.prompt, answer=t.strip() if i in EVAL_RIGHT else t.strip() + "9")
                for i, (e, t) in enumerate(zip(evals, texts))]
    from megagrpo.reward import Rewards

    saved, tr.rollouts.rewards = tr.rollouts.rewards, Rewards(reward_fn)
    try:
        acc = tr.evaluate(examples)
    finally:
        tr.rollouts.rewards = saved
    ref = sum(reward(t, e.answer) for t, e in zip(texts, examples)) / len(examples)
    return {"accuracy": acc, "reference": ref, "expected": len(EVAL_RIGHT) / len(examples)}


def eval_accuracy_check(tr):
    """known_share_eval with a second term that always pays 1: a summed reward >= 1 everywhere,
    so an accuracy counted on the sum instead of the correctness term would be 1."""
    from megagrpo.config.data import RewardConfig, RewardTermConfig
    from megagrpo.reward import RuleTerms

    return known_share_eval(tr, RuleTerms(RewardConfig(terms=[
        RewardTermConfig(name="arithmetic"),
        RewardTermConfig(name="format", kwargs={"pattern": ".*"})])))


class Recorder:
    """The engine, recording what each generate call sampled: turn 1 (n = G) by prompt, later
    turns (n = 1) by their token prefix; lists of (ids, log-probs)."""

    def __init__(self, engine):
        self.engine, self.first, self.later = engine, {}, {}

    def generate(self, prompts, sampling, **kw):
        out = self.engine.generate(prompts, sampling, **kw)
        n = sampling.n
        for i, p in enumerate(prompts):
            group = [(c.token_ids, c.logprobs) for c in out[i * n:(i + 1) * n]]
            if n > 1:
                self.first.setdefault(tuple(p), []).append(group)
            else:
                self.later.setdefault(tuple(p), []).append(group[0])
        return out


def scored_equals_sampled(rec, batch, ro):
    """Per trajectory this rank sampled: each model segment of the batch row (ids at mask
    True, rollout log-probs) equals what vLLM returned for that turn's exact prefix.
    Returns (trajectories checked, mismatches, most turns)."""
    checked = bad = most = 0
    ids, mask, lps = (batch.real(x) for x in (batch.ids, batch.mask, batch.rollout_logp))
    for i, c in enumerate(ro.completions):
        L = len(ro.prompts[c.prompt_index])
        n = len(c.token_ids)
        row, m, lp = ids[i, :L + n].tolist(), mask[i, L - 1:L - 1 + n], lps[i, L - 1:L - 1 + n]
        if tuple(row[:L]) not in rec.first:
            continue  # another rank's engine sampled it
        checked += 1
        starts = [j for j in range(n) if m[j] and (j == 0 or not m[j - 1])]
        most = max(most, len(starts))
        for k, s in enumerate(starts):
            e = s
            while e < n and m[e]:
                e += 1
            seg = (row[L + s:L + e], lp[s:e].tolist())
            options = ([g[c.sample_index] for g in rec.first[tuple(row[:L])]] if k == 0
                       else rec.later.get(tuple(row[:L + s]), []))
            bad += seg not in options
    return checked, bad, most


def multi_turn_check(tr):
    """agent on (tests._agent_env:Digits, 3 turns; about half the ids end a turn, so most
    trajectories run all 3): the ids and rollout log-probs the trainer scores are vLLM's per
    turn; then a step trains on multi-turn trajectories (vLLM gap over model tokens, loss)."""
    from megagrpo.agent.runner import TrajectoryRunner, environment_factory

    cfg, c = tr.cfg, tr.rollouts
    for key, value in (("loss_agg", "grpo"), ("mu", 1), ("num_minibatches", 1),
                       ("dynamic_sampling", False), ("kl_in_reward", False),
                       ("rollout_is", "none"), ("mask_truncated", False)):
        setattr(cfg.algo, key, value)
    saved = (cfg.agent.environment, c.stop_ids)
    cfg.agent.environment, cfg.agent.max_turns = "tests._agent_env:Digits", 3
    rec = Recorder(tr.engine)
    c.runner = TrajectoryRunner(engine=rec, tokenizer=tr.tokenizer, agent=cfg.agent,
                                factory=environment_factory(cfg.agent, tr.tokenizer),
                                max_model_len=cfg.rollout.max_model_len)
    c.stop_ids = (3, *range(4, 19, 2))
    tr.sync_weights()  # empty_minibatch_check updated the policy without a sync
    try:
        ro = tr.rollout()
        batch, _ = tr.build_batch(ro)
        checked, bad, most = scored_equals_sampled(rec, batch, ro)
        m = tr.step()
    finally:
        cfg.agent.environment, c.stop_ids = saved
        c.runner = None
    return {"checked": checked, "mismatches": bad, "most_turns": most,
            "gap": m["logp_gap_vllm_mean"], "loss": m["loss"], "turns": m["turns"],
            "env_token_share": m["env_token_share"], "tool_calls": m["tool_calls"]}


def bad_steps_check(tr):
    """Absurd rewards (1e30) skip the update; unbounded (max_abs_reward=0) they overflow the
    gradient norm, which skips it too; the second bad step in a row raises BadStepsError."""
    from megagrpo.train.trainer import BadStepsError

    for key, value in (("std_mode", "none"), ("mu", 1), ("loss_agg", "grpo")):
        setattr(tr.cfg.algo, key, value)
    tr.cfg.run.max_bad_steps = 2
    from megagrpo.reward import Rewards

    saved, tr.rollouts.rewards = tr.rollouts.rewards, Rewards(HugeReward())
    p0, opt0, version0 = local_params(tr.policy), tr.opt_steps, tr.version
    m = tr.step()
    out = {"rewards_step": {k: m[k] for k in ("nonfinite_rewards", "update_skipped",
                                               "nonfinite_grad", "bad_steps_in_a_row")}}
    tr.cfg.algo.max_abs_reward = 0.0  # no bound: the update runs and its grad norm overflows
    try:
        tr.step()
        out["raised"] = False
    except BadStepsError as e:
        out["raised"] = True
        out["grad_step"] = {k: e.metrics[k] for k in ("nonfinite_rewards", "nonfinite_grad",
                                                       "update_skipped", "bad_steps_in_a_row")}
        out["message"] = str(e)
        out["error"] = e
    p1 = local_params(tr.policy)
    out["params_unchanged"] = all(torch.equal(p0[n], p1[n]) for n in p0)
    out["opt_steps"], out["versions"] = tr.opt_steps - opt0, tr.version - version0
    tr.rollouts.rewards = saved
    return out


def stop_check(tr, err, work):
    """run.train's handler: checkpoint, engine closed, SystemExit with the reason (per rank)."""
    from megagrpo.run import checkpoints, stop_on_bad_steps

    try:
        stop_on_bad_steps(tr, checkpoints(tr), err)
        msg = "no SystemExit"
    except SystemExit as e:
        msg = str(e.code)
    with open(os.path.join(work, f"stop_rank{os.environ['RANK']}.json"), "w") as f:
        json.dump({"message": msg, "step": tr.step_idx}, f)


def tr_ckpt(work):
    from pathlib import Path

    return sorted(Path(work, "run", "checkpoints").glob("step_*"))[-1]


if __name__ == "__main__":
    main()
