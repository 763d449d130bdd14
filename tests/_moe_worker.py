"""Run on local ranks (4 processes, gloo) by tests/test_moe.py. For every (TP, PP, EP) layout
and both MoE families it loads the tiny HF checkpoints the parent wrote, records the logits
against transformers', exports the weights right after loading (round trip), runs one training
step (each DP rank on its own slice of the parent's batch) and exports the reduced gradients
(DDP main_grad, expert and dense) under HF names with the optimizer's grad norm
(tests/_foundation_worker.check_and_step, the dense families' steps). WORK/results.json."""
import dataclasses
import os

import torch
import torch.distributed as dist

from tests._foundation_worker import check_and_step
from tests.support.launch import worker_args, write_results


def run_layout(tp, pp, ep, work, results):
    from megagrpo.config.model import ParallelConfig
    from megagrpo.hf import model_config_from_hf

    ref = torch.load(os.path.join(work, "ref.pt"))
    parallel = ParallelConfig(tp=tp, pp=pp, ep=ep, make_vocab_size_divisible_by=56)
    tag = f"tp{tp}_pp{pp}_ep{ep}"
    for name in ("qwen3_moe", "qwen2_moe"):
        # no load-balancing loss: the parent's reference is the plain cross-entropy
        mcfg = dataclasses.replace(model_config_from_hf(os.path.join(work, name)),
                                   moe_aux_loss_coef=0.0)
        check_and_step(name, mcfg, parallel, tag, work, ref, results, own_slices=True)
        dist.barrier()


def main():
    args = worker_args(layouts="1x1x1,2x1x2,1x2x2,1x1x4")
    results = []
    for lay in args.layouts.split(","):
        tp, pp, ep = map(int, lay.split("x"))
        run_layout(tp, pp, ep, args.work, results)
    write_results(results, args.work, flat=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
