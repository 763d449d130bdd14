"""Run under torchrun (2 ranks, gloo, DP=2) by tests/test_resume.py. With a real megatron-core
model and optimizer: (1) the optimizer state survives save_tree / load_tree bitwise (the next
step from the restored state equals the next step from the original); (2) a model save into a
full filesystem (a tmpfs mounted by the test) fails on every rank with "no space left on
device" and the path; (3) a per-rank write that runs out of space on one rank fails on both
(no rank is left waiting in a collective). Rank 0 writes WORK/results.json."""
import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException


def build(seed: int = 0):
    from megagrpo.config.model import ModelConfig, ParallelConfig
    from megagrpo.config.optim import OptimConfig
    from megagrpo.distributed import init_distributed
    from megagrpo.model import build_model
    from megagrpo.optim import build_optimizer, wrap_ddp

    model = ModelConfig(vocab_size=32, hidden_size=64, ffn_hidden_size=128, num_layers=2,
                        num_attention_heads=2, num_query_groups=1, head_dim=32,
                        max_position_embeddings=32)
    parallel = ParallelConfig(tp=1, pp=1, make_vocab_size_divisible_by=16)
    if not dist.is_initialized():
        init_distributed(parallel, model, seed=seed)
    policy = wrap_ddp(build_model(model, parallel, seed=seed), OptimConfig(lr=1e-2))
    return model, policy, build_optimizer(policy, OptimConfig(lr=1e-2))


def train_step(policy, optimizer, seed: int) -> None:
    from megagrpo.optim import forward_backward, optimizer_step, zero_grad

    g = torch.Generator().manual_seed(seed + 100 * dist.get_rank())
    ids = torch.randint(0, 32, (2, 8), generator=g)

    def fwd(batch, model):
        out = model(batch, torch.arange(8).expand_as(batch), None)
        return out, lambda o: (o.float().pow(2).mean(), {})

    zero_grad(policy, optimizer)
    forward_backward(policy, fwd, [ids], 1, seq_length=8, micro_batch_size=2)
    optimizer_step(policy, optimizer)


def params(policy) -> list[torch.Tensor]:
    return [p.detach().clone() for p in policy.parameters()]


def optimizer_roundtrip(work: Path) -> bool:
    from megagrpo.checkpoint import load_tree, save_tree
    from megagrpo.config.optim import OptimConfig
    from megagrpo.optim import build_optimizer

    _, policy, opt = build()
    train_step(policy, opt, 0)
    path = work / f"opt_rank{dist.get_rank()}.safetensors"
    save_tree(path, opt.state_dict())
    weights = params(policy)
    train_step(policy, opt, 1)  # the original continues
    expected = params(policy)
    with torch.no_grad():
        for p, w in zip(policy.parameters(), weights):
            p.copy_(w)
    fresh = build_optimizer(policy, OptimConfig(lr=1e-2))
    fresh.load_state_dict(load_tree(path))
    train_step(policy, fresh, 1)  # the restored copy takes the same step
    return all(torch.equal(a, b) for a, b in zip(expected, params(policy)))


def error_of(fn) -> dict:
    try:
        fn()
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - the test inspects it
        return {"type": type(e).__name__, "errno": getattr(e, "errno", None), "msg": str(e)}
    return {"type": None}


def fill(mount: Path) -> None:
    """Takes every free byte of the filesystem at `mount`."""
    try:
        with (mount / "filler").open("ab") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
    except OSError:  # ENOSPC: full (perhaps already before the file could be created)
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--full", required=True, help="a small mounted tmpfs")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from megagrpo.checkpoint import on_every_rank, save_model, save_tree

    work, full = Path(args.work), Path(args.full)
    res = {"rank": dist.get_rank() if dist.is_initialized() else None}
    res["optimizer_bitwise"] = optimizer_roundtrip(work)
    model, policy, opt = build()
    res["save_model"] = error_of(lambda: save_model(policy, full / "policy", model))
    dist.barrier()
    if dist.get_rank() == 0:
        fill(full)
    dist.barrier()
    target = (full if dist.get_rank() == 1 else work) / f"rank{dist.get_rank()}.safetensors"
    res["per_rank"] = error_of(lambda: on_every_rank(
        lambda: save_tree(target, opt.state_dict()), target))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, res)
    if dist.get_rank() == 0:
        (work / "results.json").write_text(json.dumps(gathered))
    dist.barrier()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
