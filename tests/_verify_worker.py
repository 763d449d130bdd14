"""Run under torchrun (2 ranks, gloo) by tests/test_model_families.py: `megagrpo verify` for
each job `DIR:TP:PP[:broken]` in one launch (the process group stays up; each job sets up its
own layout of the 2 ranks, TP=1 being DP=2). A `broken` job runs with a deliberately wrong HF ->
megatron mapping (k and v swapped in the fused QKV, a classic converter bug), so the test sees
verify fail on weights it passes otherwise. Rank 0 writes [exit status per job] to --out."""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch.distributed as dist  # noqa: E402

import megagrpo.hf as hf  # noqa: E402
from megagrpo.config.model import ParallelConfig  # noqa: E402
from megagrpo.distributed import shutdown  # noqa: E402
from megagrpo.verify import verify  # noqa: E402


def job(spec: str, seq_len: int) -> int:
    d, tp, pp, *flags = spec.split(":")
    model = hf.model_config_from_hf(d)
    fuse = hf.fuse_qkv
    if "broken" in flags:
        hf.fuse_qkv = lambda q, k, v, groups: fuse(q, v, k, groups)
    try:
        return verify(d, model, ParallelConfig(tp=int(tp), pp=int(pp)), seq_len=seq_len)
    finally:
        hf.fuse_qkv = fuse


def run() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("jobs", nargs="+")
    args = ap.parse_args()
    codes = [job(spec, args.seq_len) for spec in args.jobs]
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(codes))
    shutdown()


if __name__ == "__main__":
    run()
