"""Run under torchrun (2 ranks, gloo, DP=2), by tests/_layout_resume_worker.py --full in the same
launch as its layouts (tests/test_resume.py), or alone. With a real megatron-core
model and optimizer: (1) the optimizer state survives save_tree / load_tree bitwise (the next
step from the restored state equals the next step from the original); (2) a model save into a
full filesystem fails on every rank with "no space left on device" and the path, and the
checkpoint saved there before the disk filled up is intact; (3) a per-rank write that runs out
of space on one rank fails on both (no rank is left waiting in a collective). Rank 0 writes
WORK/results.json.

The full filesystem is simulated (`FullDisk`), so no mount (root) is needed: once `full` is set,
every file write under the directory raises what a full disk raises at that layer (Python's io:
OSError(ENOSPC); safetensors' Rust writer: a SafetensorError that is not an OSError) and
shutil.disk_usage reports it 0 bytes free, as the kernel would."""
import argparse
import builtins
import errno
import io
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from tests.support.launch import write_results

_started: list[bool] = []


def build(seed: int = 0):
    from megagrpo.config.model import ModelConfig, ParallelConfig
    from megagrpo.config.optim import OptimConfig
    from megagrpo.model.gpt import build_model
    from megagrpo.model.optim import build_optimizer, wrap_ddp
    from megagrpo.runtime.distributed import init_distributed

    model = ModelConfig(vocab_size=32, hidden_size=64, ffn_hidden_size=128, num_layers=2,
                        num_attention_heads=2, num_query_groups=1, head_dim=32,
                        max_position_embeddings=32)
    parallel = ParallelConfig(tp=1, pp=1, make_vocab_size_divisible_by=16)
    if not _started:  # the first build starts this layout (after another worker's, too)
        init_distributed(parallel, model, seed=seed)
        _started.append(True)
    policy = wrap_ddp(build_model(model, parallel, seed=seed), OptimConfig(lr=1e-2))
    return model, policy, build_optimizer(policy, OptimConfig(lr=1e-2))


def train_step(policy, optimizer, seed: int) -> None:
    from megagrpo.model.optim import forward_backward, optimizer_step, zero_grad

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
    from megagrpo.model.optim import build_optimizer

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


class _FullFile(io.RawIOBase):
    """A file on a full disk: opening and seeking work, every write fails with ENOSPC."""

    def __init__(self, name: str):
        self.name, self.pos = name, 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        # SEEK_SET and SEEK_END alike count from 0: nothing was ever written
        self.pos = self.pos + offset if whence == os.SEEK_CUR else offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def write(self, b) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.name)


class FullDisk:
    """Simulates a full filesystem at `root` (see the module doc); call `install` before
    megagrpo is imported (megagrpo.checkpoint binds safetensors' save_file at import)."""

    def __init__(self, root: Path):
        self.root, self.full = Path(root).resolve(), False

    def holds(self, path) -> bool:
        if not isinstance(path, (str, os.PathLike)):
            return False  # a file descriptor
        return Path(os.fspath(path)).resolve().is_relative_to(self.root)

    def install(self) -> None:
        import safetensors.torch
        from safetensors import SafetensorError

        real_open, real_usage = io.open, shutil.disk_usage
        real_save_file = safetensors.torch.save_file

        def open_(file, mode="r", *args, **kwargs):
            if self.full and self.holds(file) and any(c in mode for c in "wax+"):
                real_open(file, mode.replace("a", "w"), *args, **kwargs).close()  # the inode
                raw = _FullFile(os.fspath(file))
                if "b" not in mode:
                    return io.TextIOWrapper(io.BufferedWriter(raw))
                unbuffered = (args[0] if args else kwargs.get("buffering", -1)) == 0
                return raw if unbuffered else io.BufferedWriter(raw)
            return real_open(file, mode, *args, **kwargs)

        def disk_usage(path):
            if self.full and self.holds(path):
                return shutil._ntuple_diskusage(64 << 10, 64 << 10, 0)
            return real_usage(path)

        def save_file(tensors, filename, metadata=None):
            if self.full and self.holds(filename):  # what the Rust writer raises on ENOSPC
                raise SafetensorError("Error while serializing: I/O error: No space left on "
                                      "device (os error 28)")
            return real_save_file(tensors, filename, metadata=metadata)

        io.open = builtins.open = open_  # pathlib's Path.open calls io.open
        shutil.disk_usage = disk_usage
        safetensors.torch.save_file = save_file


def full_disk_checks(work: Path, full: Path, disk: "FullDisk") -> dict:
    """This rank's results of (1)-(3) (see the module doc); `disk` installed before megagrpo
    was imported, `work` a directory with room."""
    from megagrpo.checkpoint import load_model, on_every_rank, save_model, save_tree

    work.mkdir(parents=True, exist_ok=True)
    res = {"rank": dist.get_rank() if dist.is_initialized() else None}
    res["optimizer_bitwise"] = optimizer_roundtrip(work)
    model, policy, opt = build()
    save_model(policy, full / "policy", model)  # while there is room: the earlier checkpoint
    saved = params(policy)
    train_step(policy, opt, 2)
    res["moved"] = not all(torch.equal(a, b) for a, b in zip(saved, params(policy)))
    disk.full = True  # the disk fills up (on every rank: one filesystem)
    res["save_model"] = error_of(lambda: save_model(policy, full / "policy", model))
    _, fresh, _ = build(seed=1)
    load_model(fresh, full / "policy")  # reading works on a full disk
    res["earlier_intact"] = all(torch.equal(a, b) for a, b in zip(saved, params(fresh)))
    dist.barrier()
    target = (full if dist.get_rank() == 1 else work) / f"rank{dist.get_rank()}.safetensors"
    res["per_rank"] = error_of(lambda: on_every_rank(
        lambda: save_tree(target, opt.state_dict()), target))
    disk.full = False
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--full", required=True, help="a directory whose filesystem will fill up")
    args = ap.parse_args()
    torch.set_num_threads(1)
    work, full = Path(args.work), Path(args.full)
    disk = FullDisk(full)
    disk.install()
    write_results(full_disk_checks(work, full, disk), work)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
