"""Run on local ranks (4 processes, gloo) by tests/test_foundation.py. One launch covers every
layout: for (TP, PP) in the list it re-initialises parallel_state, loads the tiny HF models
prepared by the parent, and records logits agreement, an HF export right after loading (round
trip), the reduced gradients of one training step (exported as an HF checkpoint) with the
optimizer's grad norm, and (llama) an HF export after that step. Results go to
WORK/results.json (rank 0)."""
import os

import torch
import torch.distributed as dist

from tests.support.launch import worker_args, write_results
from tests.support.megatron import backward_rows, ddp_and_optimizer


def logits_of(gpt, ids, model_cfg, parallel):
    from megatron.core import parallel_state as ps

    from megagrpo.model.optim import forward_backward

    def fwd(batch, model):
        pos = torch.arange(batch.shape[1]).expand_as(batch)
        out = model(batch, pos, None)
        return out, lambda o: (o.sum() * 0, {"logits": o.detach()})

    res = forward_backward(gpt, fwd, [ids], 1, seq_length=ids.shape[1],
                           micro_batch_size=ids.shape[0], forward_only=True)
    if not ps.is_pipeline_last_stage():
        return None
    local = res[0]["logits"]  # [B, S, V/tp]
    parts = [torch.empty_like(local) for _ in range(parallel.tp)]
    dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)[..., : model_cfg.vocab_size]


def ce_forward(batch, model):
    ids, labels = batch
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    out = model(ids, pos, None, labels=labels)  # per-token CE [B, S] on the last stage

    def loss_fn(o):
        loss = o.float().mean()
        return loss, {"loss": loss.detach()}

    return out, loss_fn


def export_grads(gpt, out_dir, model_cfg, parallel):
    """Writes every parameter's DDP main_grad as an HF checkpoint (the same TP/PP gather and
    name mapping as the weights), then puts the weights back."""
    from megagrpo.sync.source import export_hf

    params = list(gpt.parameters())
    with torch.no_grad():
        saved = [p.detach().clone() for p in params]
        for p in params:
            p.copy_(p.main_grad)
        export_hf(gpt, out_dir, model_cfg, parallel)
        for p, w in zip(params, saved):
            p.copy_(w)


def check_and_step(name, mcfg, parallel, tag, work, ref, results, *, own_slices=False):
    """One model at one layout: load the HF folder `work/name`, record the logits error
    against transformers' (ref), export right after loading (round trip), run one training
    step on ref's batch and export its reduced gradients with the optimizer's grad norm.
    `own_slices`: each DP rank trains on its own equal slice of ref's rows (else every rank on
    all of them). Returns (gpt, info)."""
    from megagrpo.hf import load_hf_weights
    from megagrpo.model.gpt import build_model
    from megagrpo.model.optim import OptimConfig, optimizer_step
    from megagrpo.runtime.distributed import init_distributed
    from megagrpo.sync.source import export_hf

    hf_dir = os.path.join(work, name)
    info = init_distributed(parallel, mcfg)
    gpt = build_model(mcfg, parallel, seed=7)
    load_hf_weights(gpt, hf_dir, mcfg, parallel, tp_rank=info.tp_rank, pp_rank=info.pp_rank)
    logits = logits_of(gpt, ref["ids"], mcfg, parallel)
    if logits is not None and info.tp_rank == 0 and info.dp_rank == 0:
        hf = ref[f"{name}_logits"]
        err = ((logits - hf).abs().max() / hf.abs().max()).item()
        results.append({"layout": tag, "model": name, "logits_rel_err": err})
    export_hf(gpt, os.path.join(work, f"rt_{name}_{tag}"), mcfg, parallel)
    ddp, opt = ddp_and_optimizer(gpt, OptimConfig(lr=1e-3, clip_grad=1.0))
    # every DP rank feeds the same batch (own_slices: its slice) as micro-batches of 1 row:
    # the reduced gradient is their mean (and over DP), so a DP sum or a missing
    # 1/num_microbatches scales it and the parent's single-process reference no longer
    # matches (with MoE the experts also see every DP rank's tokens through the all-to-all)
    ids, labels = ref["ids"], ref["labels"]
    if own_slices:  # the mean over the DP ranks' equal slices is the mean over the batch
        ids, labels = ids.chunk(info.dp)[info.dp_rank], labels.chunk(info.dp)[info.dp_rank]
    backward_rows(ddp, ce_forward, ids, labels)
    # the finalized grads (DP all-reduce + tied-embedding all-reduce across stages), before
    # the optimizer clips them in place, exported under HF names
    export_grads(gpt, os.path.join(work, f"grad_{name}_{tag}"), mcfg, parallel)
    ok, gnorm = optimizer_step(ddp, opt)
    if info.rank == 0:
        results.append({"layout": tag, "model": name, "step_ok": ok, "grad_norm": gnorm})
    return gpt, info


def run_layout(tp, pp, work, results):
    from megagrpo.config.model import ParallelConfig
    from megagrpo.hf import model_config_from_hf
    from megagrpo.sync.source import export_hf

    ref = torch.load(os.path.join(work, "ref.pt"))
    # 56: the padded vocab (112) is the same at TP=1 and TP=2, so the CE losses compare
    parallel = ParallelConfig(tp=tp, pp=pp, make_vocab_size_divisible_by=56)
    tag = f"tp{tp}_pp{pp}"
    for name in ("llama", "qwen2"):
        mcfg = model_config_from_hf(os.path.join(work, name))
        gpt, _ = check_and_step(name, mcfg, parallel, tag, work, ref, results)
        if name == "llama":
            export_hf(gpt, os.path.join(work, f"step_{name}_{tag}"), mcfg, parallel)
        dist.barrier()


def main():
    args = worker_args(layouts="1x1,2x1,1x2,2x2")
    results = []
    for lay in args.layouts.split(","):
        tp, pp = map(int, lay.split("x"))
        run_layout(tp, pp, args.work, results)
    write_results(results, args.work, flat=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
