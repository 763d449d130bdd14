"""Run on local ranks (4 ranks, gloo) by tests/test_fused_output_layer.py. For each layout
(TP=2 x PP=2 untied and tied; TP=2 x DP=2 tied, padded and packed micro-batches) it builds a
tiny megatron policy and one GRPO batch, then runs the same scoring pass, GRPO update passes
(grpo with k3 KL; gspo; cispo; at TP=2 x PP=2 also bnpo/k1, dr_grpo/k2, dapo; unpacked also
with the output layer at every position) and supervised pass with
compute.fused_output_layer false and true from the same weights: per rank, the finalized (DP-
and embedding-reduced) gradients of every parameter shard, the scored log-probs and the loss
reports of both. Rank 0 writes WORK/results.json."""
import os
from functools import partial

import torch
import torch.distributed as dist

from tests.kernels.fused_cases import count_fused_paths
from tests.support.launch import worker_args, write_results
from tests.support.megatron import ddp_and_optimizer

LAYOUTS = {  # tp, pp, tied, packed
    "tp2_pp2": (2, 2, False, False),
    "tp2_pp2_tied": (2, 2, True, False),
    "tp2_dp2_tied": (2, 1, True, False),
    "tp2_dp2_tied_packed": (2, 1, True, True),
    "tp1": (1, 1, False, False),  # a quick one-rank look (not in the test)
}
TESTED = ["tp2_pp2", "tp2_pp2_tied", "tp2_dp2_tied", "tp2_dp2_tied_packed"]
LOSSES = {"grpo_k3": ("grpo", 0.05, "k3"), "gspo": ("gspo", 0.0, "k3"),
          "cispo": ("cispo", 0.1, "k3")}
EXTRA = {  # every other loss_agg and KL estimator, at one layout
    "bnpo_k1": ("bnpo", 0.05, "k1"), "dr_grpo_k2": ("dr_grpo", 0.05, "k2"),
    "dapo": ("dapo", 0.0, "k3"),
}


def make_config(tp: int, pp: int, tied: bool):
    from megagrpo.config.train import load_config

    return load_config(None, [
        "model.vocab_size=100", "model.hidden_size=64", "model.ffn_hidden_size=128",
        "model.num_layers=2", "model.num_attention_heads=4", "model.num_query_groups=2",
        "model.head_dim=16", "model.max_position_embeddings=64",
        f"model.tie_word_embeddings={str(tied).lower()}",
        f"parallel.tp={tp}", f"parallel.pp={pp}", "parallel.make_vocab_size_divisible_by=16",
        "optim.lr=1e-3", "rollout.max_tokens=6", "rollout.temperature=0.7", "algo.beta=0.05",
        "algo.kl_estimator=k3", "compute.micro_batch_size=4", "compute.kernel_impl=torch",
        "compute.skip_zero_advantage=false", "log.progress=false",
    ])


def make_batch(seed: int, multiple: int):
    from megagrpo.parallel.batch import pack

    g = torch.Generator().manual_seed(seed)
    n = 8
    prompts = [torch.randint(1, 100, (int(torch.randint(2, 6, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(n)]
    comps = [torch.randint(1, 100, (int(torch.randint(1, 7, (1,), generator=g)),),
                           generator=g).tolist() for _ in range(n)]
    lps = [[-1.0] * len(c) for c in comps]
    return pack(prompts, comps, lps, torch.randn(n, generator=g), pad_id=0, multiple=multiple)


def grads(passes, ddp, opt, loss_fn, batch, m, algo):
    """Finalized gradients (fp32 copies) and summed reports of one pass over `batch`."""
    from megagrpo.model.optim import zero_grad

    plan = passes.plan(batch, m)
    ctx = passes.loss_context(scale=len(plan) * passes.ranks.dp,
                              counts=passes.counts(batch, len(plan)), algo=algo,
                              inplace_backward=True)
    zero_grad(ddp, opt)
    out = passes.run(ddp, partial(loss_fn, ctx), plan, batch.ids.shape[1], m)
    keys = [k for k in (out[0] if out else {}) if k != "logp"]
    report = {k: float(sum(float(o[k]) for o in out)) for k in keys}
    return [p.main_grad.detach().clone() for p in ddp.parameters()], report


def count_fused_calls() -> list[int]:
    """Wrap the fused op where the scoring op (`kernels.ops.token_logprob`) looks it up;
    returns a call counter."""
    from megagrpo.kernels import ops

    calls, op = [0], ops.fused_output_logprob

    def counted(*args, **kwargs):
        calls[0] += 1
        return op(*args, **kwargs)

    ops.fused_output_logprob = counted
    return calls


def small_chunks() -> None:
    """Chunks of 16 tokens x 48 vocab rows: every micro-batch crosses chunk boundaries on both
    axes (V/tp = 64 or 128 here), as a real vocab does."""
    from megagrpo.kernels import fused_output as fo

    fo.CHUNK_TOKENS, fo.CHUNK_ELEMS, fo.MIN_CHUNK_VOCAB = 16, 16 * 48, 48
    fo.GRAD_CHUNK_ELEMS = fo.MIN_CHUNK_ELEMS = 8 * 64  # 8 tokens at V/tp = 64, 4 at 128
    fo.GRAD_MIN_TOKENS = 1  # ... and the gradient computed in the forward even so


def run_layout(name: str, results: list, calls: list[int], paths: dict[str, int]) -> None:
    from megagrpo.model.gpt import build_model
    from megagrpo.runtime.distributed import init_distributed, training_layout
    from megagrpo.train.losses import grpo_loss, sft_loss
    from megagrpo.train.passes import Passes

    tp, pp, tied, packed = LAYOUTS[name]
    cfg = make_config(tp, pp, tied)
    if packed:
        cfg.compute.micro_batch_tokens = 40
    info = init_distributed(cfg.parallel, cfg.model)
    ranks, groups = training_layout(cfg.parallel, cfg.model, info)
    gpt = build_model(cfg.model, cfg.parallel, seed=7)
    ddp, opt = ddp_and_optimizer(gpt, cfg.optim)
    passes = Passes(cfg, ranks, groups, packed=packed)
    m = cfg.compute.micro_batch_size
    batch = make_batch(3, m)
    cfg.compute.fused_output_layer = False
    scored = passes.logprobs(ddp, batch)
    if scored is not None:  # the last stage: old / reference log-probs near the policy's
        g = torch.Generator().manual_seed(5)
        batch.old_logp = torch.where(batch.mask, scored + 0.3 * torch.randn(
            scored.shape, generator=g), 0.0)
        batch.ref_logp = torch.where(batch.mask, scored + 0.5 * torch.randn(
            scored.shape, generator=g), 0.0)
    res = {"layout": name, "rank": info.rank, "last_stage": scored is not None}
    logp, n_calls = {}, {}
    for fused in (False, True):
        cfg.compute.fused_output_layer = fused
        before = calls[0]
        logp[fused] = passes.logprobs(ddp, batch)
        n_calls[fused] = calls[0] - before
    res["fused_calls"] = [n_calls[False], n_calls[True]]
    if scored is not None:
        res["logp_diff"] = float((logp[True] - logp[False])[batch.mask].abs().max())
        res["logp_offmask_zero"] = bool((logp[True][~batch.mask] == 0).all())
        res["rescored_equal"] = bool(torch.equal(logp[False], scored))
    losses = dict(LOSSES, **(EXTRA if name == "tp2_pp2" else {}))
    runs = {k: (grpo_loss, *v, True) for k, v in losses.items()}
    runs["sft"] = (sft_loss, "grpo", 0.0, "k3", True)
    if not packed:  # the output layer (and the fused op) at every position, not loss ones only
        runs["grpo_k3_all_positions"] = (grpo_loss, "grpo", 0.05, "k3", False)
    for key, (fn, agg, beta, est, at_loss) in runs.items():
        cfg.algo.loss_agg, cfg.algo.beta, cfg.algo.kl_estimator = agg, beta, est
        cfg.compute.logits_at_loss_positions = at_loss
        both = {}
        for fused in (False, True):
            cfg.compute.fused_output_layer = fused
            before = dict(paths)
            both[fused] = grads(passes, ddp, opt, fn, batch, m, cfg.algo)
        ran = {k: paths[k] - before[k] for k in paths}  # the fused run's training paths
        (g0, r0), (g1, r1) = both[False], both[True]
        res[key] = {
            "grad_rel": max(float((a - b).norm() / b.norm().clamp_min(1e-30))
                            for a, b in zip(g1, g0)),
            "grad_norm": float(sum(b.norm() ** 2 for b in g0) ** 0.5),
            "report_rel": {k: abs(r1[k] - r0[k]) / (1.0 + abs(r0[k])) for k in r0},
            "paths": ran,
        }
    results.append(res)
    dist.barrier()


def main():
    args = worker_args(layouts=",".join(TESTED))
    results, calls, paths = [], count_fused_calls(), count_fused_paths()
    small_chunks()
    for name in args.layouts.split(","):
        run_layout(name, results, calls, paths)
    write_results(results, args.work, flat=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
