"""Routing replay through the trainer's scoring pass, for tests/_seqpar_worker.py (4 ranks,
Qwen3-MoE at TP=1 x EP=2 x DP=4, each DP rank scoring its own 2 sequences of the parent's 8).

The parent (tests/test_seqpar.py) wrote the sequences and two sets of routes [len, L_moe, k] for
each: "own", the experts transformers' float64 model chooses itself, and "permuted", the same
with every MoE layer of one position of each sequence and of all after it sent to other
experts. This rank scores its
sequences with `Passes.logprobs` (the packed and the padded micro-batch layouts, whose router
rows are ordered differently: `megagrpo.train.passes._router_rows`) without replay, replaying "own"
and replaying "permuted", and records the [n, S] log-probs at the loss positions for the parent
to compare with float64 forwards that route as told."""
from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist


def replay_config(work: str):
    """The trainer's config for the check: the tiny Qwen3-MoE at EP=2, routing replay on."""
    from megagrpo.config.train import load_config
    from megagrpo.hf import model_config_from_hf

    cfg = load_config(None, ["parallel.ep=2", "parallel.make_vocab_size_divisible_by=56",
                             "algo.routing_replay=true", "compute.micro_batch_size=2",
                             "compute.kernel_impl=torch", "log.progress=false"])
    cfg.model = dataclasses.replace(model_config_from_hf(os.path.join(work, "qwen3_moe")),
                                    moe_aux_loss_coef=0.0)
    return cfg


def replay_scores(work: str, results: list) -> None:
    """Scores this DP rank's slice under each (layout, routes) case; appends one record."""
    from megatron.core import parallel_state as ps

    from megagrpo.hf import load_hf_weights
    from megagrpo.model.gpt import build_model
    from megagrpo.model.moe import enable_replay
    from megagrpo.model.optim import wrap_ddp
    from megagrpo.parallel.batch import pack
    from megagrpo.runtime.distributed import init_distributed, training_layout
    from megagrpo.train.passes import Passes

    cfg = replay_config(work)
    info = init_distributed(cfg.parallel, cfg.model)
    ranks, groups = training_layout(cfg.parallel, cfg.model, info)
    gpt = build_model(cfg.model, cfg.parallel, seed=7)
    load_hf_weights(gpt, os.path.join(work, "qwen3_moe"), cfg.model, cfg.parallel,
                    tp_rank=info.tp_rank, pp_rank=info.pp_rank)
    ddp = wrap_ddp(gpt, cfg.optim)
    enable_replay(gpt)
    ref = torch.load(os.path.join(work, "replay.pt"))
    dp, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    n = len(ref["prompts"]) // dp
    mine = slice(r * n, (r + 1) * n)
    prompts, comps = ref["prompts"][mine], ref["completions"][mine]
    lps = [[0.0] * len(c) for c in comps]
    rec: dict = {"part": "replay", "rank": info.rank, "rows": [r * n, (r + 1) * n]}
    gpt.eval()
    for routes in ("none", "own", "permuted"):
        batch = pack(prompts, comps, lps, torch.zeros(n), pad_id=0,
                     routes=None if routes == "none" else ref[routes][mine])
        for packed in (True, False):
            passes = Passes(cfg, ranks, groups, packed=packed)
            with torch.no_grad():
                logp = passes.logprobs(ddp, batch)
            rec[f"{routes}_{'packed' if packed else 'padded'}"] = \
                torch.where(batch.mask, logp, 0.0)[:n].tolist()
    rec["mask"] = batch.mask[:n].tolist()
    results.append(rec)
    dist.barrier()


# ------------------------------------------------------------------ the parent's reference
def forced_logprobs(model, ids: torch.Tensor, routes: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence `ids` [S] through a float64 copy of transformers' Qwen3-MoE `model`,
    every MoE layer routing as `routes` [S, L_moe, k] says (None: by itself), the top-k
    weights being the chosen experts' softmax probabilities renormalised (what megatron's
    RouterReplay computes from the router's own logits). Returns ([S - 1] log-probs of each next
    token, [S, L_moe, k] the experts used)."""
    used: list[torch.Tensor] = []

    def force(gate, args, out):
        logits, _, idx = out
        if routes is not None:
            idx = routes[:, len(used)].long()
        w = logits.softmax(-1).gather(1, idx)
        if gate.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        used.append(idx)
        return logits, w.to(logits.dtype), idx

    hooks = [layer.mlp.gate.register_forward_hook(force) for layer in model.model.layers
             if hasattr(layer.mlp, "gate")]
    try:
        with torch.no_grad():
            logp = model(ids[None]).logits[0].log_softmax(-1)
    finally:
        for h in hooks:
            h.remove()
    return logp[:-1].gather(1, ids[1:, None])[:, 0], torch.stack(used, 1)


def replay_reference(model, path) -> dict:
    """Writes the worker's 8 sequences and their "own" / "permuted" routes to `path` and
    returns the float64 log-probs of each under either, with the position of each sequence
    from which on its routes were moved. That is a loss position (a completion token's input),
    so the log-probs before it must stay and those from it on change."""
    import copy

    m = copy.deepcopy(model).double()
    m.config._experts_implementation_internal = "eager"  # grouped_mm has no float64
    g = torch.Generator().manual_seed(11)
    E = m.config.num_experts
    prompts, comps, own, permuted, moved, logp = [], [], [], [], [], {"own": [], "permuted": []}
    for i in range(8):
        p = torch.randint(1, 100, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g)
        c = torch.randint(1, 100, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g)
        ids = torch.cat([p, c])
        lp, routes = forced_logprobs(m, ids, None)
        at = len(p) - 1 + i % len(c)  # a loss position
        perm = routes.clone()
        perm[at:] = (perm[at:] + 1) % E  # other experts (a k-set never maps to itself)
        prompts.append(p.tolist())
        comps.append(c.tolist())
        own.append(routes.to(torch.int16))
        permuted.append(perm.to(torch.int16))
        moved.append(at)
        logp["own"].append(lp.tolist())
        logp["permuted"].append(forced_logprobs(m, ids, perm)[0].tolist())
    torch.save({"prompts": prompts, "completions": comps, "own": own, "permuted": permuted}, path)
    return {"prompt_lens": [len(p) for p in prompts], "moved": moved, "logp": logp}
