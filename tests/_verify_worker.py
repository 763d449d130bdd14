"""Run on local ranks (2 ranks, gloo) by tests/test_model_families.py: `megagrpo verify` for
each job `DIR:TP:PP[:epN][:broken|:experts_swapped]` in one launch (the process group stays up;
each job sets up its own layout of the 2 ranks, TP=1 being DP=2, EP inside DP). A `broken` job
runs with a deliberately wrong HF -> megatron mapping (k and v swapped in the fused QKV, a
classic converter bug), `experts_swapped` with routed experts 0 and 1 exchanged (the router
then sends tokens to the wrong weights; the round trip stays bitwise), so the test sees verify
fail on weights it passes otherwise. Rank 0 writes [exit status per job] to --out."""
import argparse
import json
from pathlib import Path

import torch.distributed as dist

import megagrpo.config.params as hf_params
import megagrpo.hf as hf
import megagrpo.hf.io as hf_io
from megagrpo.config.model import ParallelConfig
from megagrpo.runtime.distributed import shutdown
from megagrpo.verify import verify


def _swap_experts_0_1(moe_specs):
    def specs(*args, **kwargs):
        out = moe_specs(*args, **kwargs)
        swap = {".experts.0.": ".experts.1.", ".experts.1.": ".experts.0."}
        for i, s in enumerate(out):
            for a, b in swap.items():
                if a in s.hf[0]:
                    out[i] = hf.ParamSpec(s.local, s.kind, tuple(h.replace(a, b) for h in s.hf),
                                          s.full_shape, s.ep_owner)
                    break
        return out
    return specs


def job(spec: str, seq_len: int) -> int:
    d, tp, pp, *flags = spec.split(":")
    ep = next((int(f[2:]) for f in flags if f.startswith("ep")), 1)
    model = hf.model_config_from_hf(d)
    # patched where they are looked up: the loader's fusion, the layout's MoE part
    fuse, moe_specs = hf_io.fuse_qkv, hf_params._moe_specs
    if "broken" in flags:
        hf_io.fuse_qkv = lambda q, k, v, model: fuse(q, v, k, model)
    if "experts_swapped" in flags:
        hf_params._moe_specs = _swap_experts_0_1(moe_specs)
    try:
        return verify(d, model, ParallelConfig(tp=int(tp), pp=int(pp), ep=ep), seq_len=seq_len)
    finally:
        hf_io.fuse_qkv, hf_params._moe_specs = fuse, moe_specs


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
