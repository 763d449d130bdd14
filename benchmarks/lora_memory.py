"""Trainable parameters, optimizer state, reference copy and refit bytes: LoRA vs full fine-tuning.

    torchrun --nproc-per-node 1 benchmarks/lora_memory.py [--workload demo|midsize] [--rank 16]

Builds the workload's model at TP=1 (seeded random init), once as full fine-tuning and once
with adapters on qkv, proj, fc1, fc2, takes one optimizer step on random tokens (so Adam's
state exists) and counts what megatron's optimizer holds. The reference copy is what full
fine-tuning keeps for the KL (algo.beta > 0; LoRA keeps none); the refit bytes are what a weight
sync sends vLLM: the merged model in both cases on the path that runs today, and the adapters
alone on an adapter-only refit (not built yet; the figure is their size, HF layout, A repeated
per fused part as a peft adapter would carry it).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._workloads import get_workload  # noqa: E402


def _measure(model_cfg, lora_cfg, seed: int = 1) -> dict:
    from megagrpo.config.model import ParallelConfig
    from megagrpo.config.optim import OptimConfig
    from megagrpo.distributed import init_distributed
    from megagrpo.lora import add_adapters
    from megagrpo.model import build_model
    from megagrpo.optim import (
        build_optimizer,
        forward_backward,
        optimizer_step,
        torch_adams,
        wrap_ddp,
        zero_grad,
    )

    parallel = ParallelConfig(tp=1, pp=1)
    init_distributed(parallel, model_cfg)
    gpt = build_model(model_cfg, parallel, seed=seed)
    total = sum(p.numel() for p in gpt.parameters())
    if lora_cfg is not None:
        add_adapters(gpt, lora_cfg, seed=seed)
    ddp = wrap_ddp(gpt, OptimConfig(lr=1e-4))
    opt = build_optimizer(ddp, OptimConfig(lr=1e-4))
    ids = torch.randint(0, model_cfg.vocab_size, (1, 16))

    def fwd(batch, model):
        pos = torch.arange(batch.shape[1]).expand_as(batch)
        out = model(batch, pos, None, labels=batch)
        return out, lambda o: (o.float().mean(), {})

    zero_grad(ddp, opt)
    forward_backward(ddp, fwd, [ids], 1, seq_length=16, micro_batch_size=1)
    optimizer_step(ddp, opt)
    trainable = sum(p.numel() for p in gpt.parameters() if p.requires_grad)
    state = sum(t.numel() * t.element_size() for o in torch_adams(opt) for s in o.state.values()
                for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    grad_buf = sum(b.grad_data.numel() * b.grad_data.element_size()
                   for b in ddp.buffers) if hasattr(ddp, "buffers") else 0
    return {"params": total, "trainable": trainable, "opt_state_bytes": state,
            "grad_buffer_bytes": grad_buf}


def _adapter_refit_bytes(model_cfg, rank: int, esize: int) -> int:
    """Adapter bytes in HF layout: per projection A [r, in] and B [out, r] (q/k/v and gate/up
    each carry the shared A)."""
    H, F = model_cfg.hidden_size, model_cfg.ffn_hidden_size
    q = model_cfg.num_attention_heads * model_cfg.head_dim
    kv = model_cfg.num_query_groups * model_cfg.head_dim
    shapes = [(H, q), (H, kv), (H, kv), (q, H), (H, F), (H, F), (F, H)]  # (in, out)
    return model_cfg.num_layers * sum(rank * (i + o) for i, o in shapes) * esize


def main() -> None:
    from megagrpo.config.lora import LoRAConfig
    from megagrpo.config.train import load_config

    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="midsize")
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    w = get_workload(args.workload)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(os.path.join(root, w.recipe), list(w.overrides))
    torch.set_num_threads(1)
    full = _measure(cfg.model, None)
    lora = _measure(cfg.model, LoRAConfig(rank=args.rank, alpha=2.0 * args.rank))
    esize = 4 if cfg.model.dtype == "float32" else 2
    weights = full["params"] * esize
    adapter = _adapter_refit_bytes(cfg.model, args.rank, esize)
    rows = [("trainable parameters", full["trainable"], lora["trainable"]),
            ("optimizer state (bytes)", full["opt_state_bytes"], lora["opt_state_bytes"]),
            ("DDP grad buffer (bytes)", full["grad_buffer_bytes"], lora["grad_buffer_bytes"]),
            ("reference copy (bytes)", weights, 0),
            ("refit per step, merged (bytes)", weights, weights),
            ("refit per step, adapter-only (bytes)", weights, adapter)]
    print(f"{w.name}: {full['params']:,} parameters, {cfg.model.dtype}, lora rank {args.rank} "
          "on qkv,proj,fc1,fc2")
    print(f"{'':40s} {'full':>14s} {'lora':>14s} {'lora/full':>10s}")
    for name, a, b in rows:
        print(f"{name:40s} {a:14,d} {b:14,d} {b / a:10.2%}")


if __name__ == "__main__":
    main()
