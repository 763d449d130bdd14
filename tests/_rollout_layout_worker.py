"""Run on local ranks (4 ranks, training TP=2 x PP=2, gloo) by tests/test_rollout_layout.py:
the real trainer with vLLM engines of rollout.tensor_parallel_size=2 (two engines, ranks [0, 1]
and [2, 3], external_launcher on part of the world), fed shard to shard.

Records per rank: megatron argmax loop vs vLLM greedy before and after an optimizer step, the
trainer's log-probs vs vLLM's on a sampled batch (fp32), which prompts each engine sampled, the
bytes each rank received for a full-tensor feed (what vLLM TP=1 engines need) and for the
shard-to-shard feed, and the peak memory of both. Rank 0 writes WORK/results.json."""
import argparse
import os

import torch
import torch.distributed as dist

from tests.support.launch import write_results


def feed_bytes(tr, feed) -> dict:
    """Drains one weight feed without an engine: bytes received, peak extra bytes, largest
    tensor yielded (bytes)."""
    from benchmarks._harness import _cpu_peak_bytes
    from megagrpo.sync.source import ReshardStats

    stats, largest = ReshardStats(), [0]

    def drain():
        for _, t in feed(tr.policy, tr.model_cfg, tr.cfg.parallel, bucket_bytes=64 << 10,
                         stats=stats):
            largest[0] = max(largest[0], t.numel() * t.element_size())
            del t

    peak = _cpu_peak_bytes(drain)
    return {"received": stats.received_bytes, "peak": peak, "buffer": stats.peak_buffer_bytes,
            "largest": largest[0]}


def logprob_gap(tr) -> float | None:
    """Max |trainer log-prob - vLLM sampling log-prob| over a fresh batch's completion tokens
    (last stage's TP rank 0; None elsewhere)."""
    batch, _ = tr.build_batch(tr.rollout())
    logp = tr.passes.logprobs(tr.policy, batch)
    if logp is None or tr.ranks.tp_rank != 0:
        return None
    mask = batch.mask.bool()
    return float((logp - batch.rollout_logp).abs()[mask].max())


def sampled_prompts(tr) -> dict:
    """Which replica prompts this rank's engine sampled, and the gathered batch's coverage."""
    ro = tr.rollout()
    groups = sorted({(c.prompt_index, c.sample_index) for c in ro.completions})
    pool = len(ro.prompts) * (tr.ranks.dp if tr.rollouts.layout.pooled else 1)
    return {"engine": tr.rollouts.layout.engine, "mine": tr.rollouts.layout.prompt_indices(pool),
            "num_prompts": len(ro.prompts), "num_completions": len(ro.completions),
            "distinct": len(groups), "prompts": ro.prompts}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--pooled", action="store_true",
                    help="training TP=1 x DP=4 instead: each TP=2 engine spans two replicas")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from megagrpo.config.data import RewardConfig, RewardTermConfig
    from megagrpo.reward import RuleTerms
    from megagrpo.run import setup
    from megagrpo.sync.source import iter_hf_weights, iter_vllm_slices
    from tests._trainer_worker import greedy_check, known_share_eval, make_config

    cfg = make_config(args.work)
    cfg.rollout.tensor_parallel_size = 2
    cfg.algo.beta, cfg.reference.sync_every_steps = 0.0, 0  # no reference: not tested here
    if args.pooled:
        cfg.parallel.tp, cfg.parallel.pp = 1, 1
    tr = setup(cfg)
    res = {"rank": dist.get_rank(), "shard_to_shard": tr.rollouts.layout.shard_to_shard,
           "pooled": tr.rollouts.layout.pooled, "dp_rank": tr.ranks.dp_rank}
    res["sync"] = tr.sync_weights()
    res["greedy_initial"] = greedy_check(tr)
    if not args.pooled:
        res["feed_full"] = feed_bytes(tr, iter_hf_weights)
        res["feed_slices"] = feed_bytes(tr, iter_vllm_slices)
    res["prompts"] = sampled_prompts(tr)
    res["step"] = {k: v for k, v in tr.step().items() if isinstance(v, (int, float))}
    res["greedy_after_step"] = greedy_check(tr)
    res["logprob_gap"] = logprob_gap(tr)
    res["eval_accuracy"] = known_share_eval(tr, RuleTerms(RewardConfig(
        terms=[RewardTermConfig(name="arithmetic")])))
    write_results(res, args.work)


if __name__ == "__main__":
    main()
    os._exit(0)  # skip vLLM's shutdown hooks (they tear down the process group mid-exit)
