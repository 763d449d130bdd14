"""HF logits agreement at TP=1: a tiny random HF Llama/Qwen2 loaded into the megatron GPTModel
vs transformers' own forward, in fp32 and bf16, on this machine's device. Prints one JSON line
per (model, dtype). Runs on CPU here and, unchanged, on the H200 (benchmarks/gpu_check.sh).

    python benchmarks/hf_logits.py [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def run(model_name: str, dtype: str, work: str) -> dict:
    from megagrpo.config.model import ParallelConfig
    from megagrpo.hf import load_hf_weights, model_config_from_hf
    from megagrpo.model.gpt import DTYPE, build_model
    from tests.support.tiny import tiny_llama, tiny_qwen2

    path = os.path.join(work, model_name)
    hf = (tiny_llama if model_name == "llama" else tiny_qwen2)(path)
    mcfg = model_config_from_hf(path, dtype=dtype)
    parallel = ParallelConfig(make_vocab_size_divisible_by=8)
    gpt = build_model(mcfg, parallel)
    load_hf_weights(gpt, path, mcfg, parallel, tp_rank=0, pp_rank=0)
    dev = next(gpt.parameters()).device
    ids = torch.randint(0, mcfg.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    hf = hf.to(device=dev, dtype=DTYPE[dtype]).eval()
    with torch.no_grad():
        ref = hf(ids.to(dev)).logits.float()
        pos = torch.arange(ids.shape[1], device=dev).expand(ids.shape)
        got = gpt(ids.to(dev), pos, None)[..., : mcfg.vocab_size].float()
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    return {"model": model_name, "dtype": dtype, "device": dev.type, "tp": 1,
            "max_rel_err": rel, "max_abs_err": (got - ref).abs().max().item(),
            "greedy_agree": float((got.argmax(-1) == ref.argmax(-1)).float().mean())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from megagrpo.config.model import ParallelConfig
    from megagrpo.runtime.distributed import init_distributed

    init_distributed(ParallelConfig())
    with tempfile.TemporaryDirectory() as work:
        for model_name in ("llama", "qwen2"):
            for dtype in ("float32", "bfloat16"):
                line = json.dumps(run(model_name, dtype, work))
                print(line, flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(line + "\n")


if __name__ == "__main__":
    main()
