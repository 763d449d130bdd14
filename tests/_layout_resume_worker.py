"""Run on local ranks (2 ranks, gloo) by tests/test_resume.py: optimizer state through
megatron's dist-checkpointing (`megagrpo.checkpoint.save_optimizer` / `load_optimizer`), with
the plain and the distributed optimizer, at one layout and across layouts, all in one launch
(megatron's parallel state is rebuilt for each layout on the same two ranks).

For each case (optimizer, source layout, target layouts): build at the source layout, take 2
steps, save model + optimizer to WORK/<case>/ckpt, take a third step (its loss and grad norm
-> results) and save the continued state to WORK/<case>/continued. Then for each target layout:
build there, load WORK/<case>/ckpt, re-save what was loaded to reloaded_<target> (the moments
as that layout holds them; the test compares them with ckpt offline), take the same third step
and save continued_<target>. Every layout trains on the same global batch (each DP replica
takes its slice), so the third step agrees across layouts to float tolerance, and bitwise at
the same layout. Layouts: "tp2", "pp2", "dp2" (2 ranks each). With `--full DIR`, the same
launch then runs tests/_resume_worker.py's checks (optimizer state through save_tree, a full
disk simulated at DIR; its FullDisk installed before megagrpo is imported, inert until it
fills), each rank's results under "full_disk": one launch of the two ranks instead of two.
Rank 0 writes WORK/results.json.
"""
import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "dp2": (1, 1)}
GLOBAL_BATCH, SEQ, VOCAB = 4, 8, 32


def build(layout: str, distributed_optimizer: bool):
    from megagrpo.config.model import ModelConfig, ParallelConfig
    from megagrpo.config.optim import OptimConfig
    from megagrpo.model.gpt import build_model
    from megagrpo.model.optim import build_optimizer, wrap_ddp
    from megagrpo.runtime.distributed import init_distributed

    tp, pp = LAYOUTS[layout]
    model = ModelConfig(vocab_size=VOCAB, hidden_size=64, ffn_hidden_size=128, num_layers=2,
                        num_attention_heads=2, num_query_groups=2, head_dim=32,
                        max_position_embeddings=32)
    parallel = ParallelConfig(tp=tp, pp=pp, make_vocab_size_divisible_by=16)
    init_distributed(parallel, model, seed=0)
    ocfg = OptimConfig(lr=1e-2, distributed_optimizer=distributed_optimizer, clip_grad=1.0)
    policy = wrap_ddp(build_model(model, parallel, seed=0), ocfg)
    return model, policy, build_optimizer(policy, ocfg)


def step(policy, optimizer, k: int) -> dict:
    """One optimizer step on global batch k (this DP replica's slice); the loss is the mean
    over the global batch whatever the layout."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megagrpo.model.optim import forward_backward, optimizer_step, zero_grad

    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(k))
    dp, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = ids.chunk(dp)[r]
    losses = []

    def fwd(batch, model):
        out = model(batch, torch.arange(SEQ).expand_as(batch), None)

        def loss_fn(o):
            full = gather_from_tensor_model_parallel_region(o.float())  # vocab shards
            loss = torch.log_softmax(full, -1)[..., :4].mean().neg()
            losses.append(loss.detach())
            return loss, {}
        return out, loss_fn

    zero_grad(policy, optimizer)
    forward_backward(policy, fwd, [mine], 1, seq_length=SEQ, micro_batch_size=mine.shape[0])
    applied, norm = optimizer_step(policy, optimizer)
    loss = torch.tensor([float(losses[0]) if losses and ps.is_pipeline_last_stage() else 0.0,
                         1.0 if ps.is_pipeline_last_stage() else 0.0], dtype=torch.float64)
    dist.all_reduce(loss)
    return {"loss": float(loss[0] / loss[1]), "grad_norm": norm, "applied": applied}


CASES = [  # (distributed optimizer, source layout, target layouts)
    (True, "dp2", ("dp2", "tp2")),
    (True, "tp2", ("dp2",)),
    (True, "pp2", ("dp2",)),
    (False, "tp2", ("tp2", "dp2", "pp2")),
    (False, "dp2", ()),  # the plain optimizer's steps, for the distributed one's to equal
]


def case_name(distributed: bool, src: str) -> str:
    return f"{'distopt' if distributed else 'plain'}_{src}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--full", default=None,
                    help="then tests/_resume_worker.py's checks, this directory's disk filling up")
    args = ap.parse_args()
    torch.set_num_threads(1)
    disk = None
    if args.full:  # before megagrpo.checkpoint is imported (it binds safetensors' save_file)
        from tests._resume_worker import FullDisk

        disk = FullDisk(Path(args.full))
        disk.install()
    from megagrpo.checkpoint import load_model, load_optimizer, save_model, save_optimizer

    def save(policy, model, opt, where: Path) -> None:
        save_model(policy, where / "policy", model)
        save_optimizer(policy, opt, where / "optimizer")

    results = {}
    for distributed, src, targets in CASES:
        work = Path(args.work) / case_name(distributed, src)
        model, policy, opt = build(src, distributed)
        for k in range(2):
            step(policy, opt, k)
        save(policy, model, opt, work / "ckpt")
        results[f"{work.name}/{src}"] = step(policy, opt, 2)
        save(policy, model, opt, work / "continued")
        for dst in targets:
            model, policy, opt = build(dst, distributed)
            load_model(policy, work / "ckpt" / "policy")
            load_optimizer(policy, opt, work / "ckpt" / "optimizer")
            save_optimizer(policy, opt, work / f"reloaded_{dst}" / "optimizer")
            results[f"{work.name}/{dst}"] = step(policy, opt, 2)
            save(policy, model, opt, work / f"continued_{dst}")
        if distributed and src == "tp2":  # the control: weights only, Adam restarts
            model, policy, opt = build("dp2", distributed)
            load_model(policy, work / "ckpt" / "policy")
            results[f"{work.name}/fresh_adam"] = step(policy, opt, 2)
            save(policy, model, opt, work / "continued_fresh_adam")
    if disk is not None:  # its own layout (DP=2) and model, started by its first build
        from tests._resume_worker import full_disk_checks

        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, full_disk_checks(Path(args.work) / "full_disk_work",
                                                       Path(args.full), disk))
        results["full_disk"] = ranks
    if dist.get_rank() == 0:
        (Path(args.work) / "results.json").write_text(json.dumps(results))
    dist.barrier()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
