"""The rollout floor: the least time this machine needs to sample a rollout, from its shapes.

A rollout is a prefill (each group's prompt once, with the first token's logits) and then
decode steps. Prefill is matrix-matrix work: its floor is its FLOPs at torch.mm's measured rate
(`machine.gemm_gflops`). A decode step computes one token for every live sequence, and it must
read every weight once (whatever the batch) plus each live sequence's keys and values; with a
small batch that reading, not the arithmetic, is the limit. So per decode step s

    floor_s = max(FLOPs_s / GEMM rate,  bytes_s / memory read bandwidth)
    FLOPs_s = live_s x (2 x matmul params + 2 x hidden x vocab) + 4 x head dims x layers x ctx_s
    bytes_s = weights read by the step + KV bytes per position x ctx_s

where live_s is the number of sequences still decoding at step s and ctx_s the positions their
tokens attend (sum over them of prompt + s). The bandwidth is `machine.memory_read_gbs` (a
streaming read of 1 GiB, far above the LLC). The FLOPs are the same ones `_workloads.
rollout_flops` counts (their sum over steps plus the prefill equals it), so the FLOP-only floor
of earlier records is this floor with an infinite bandwidth.

Weights read by a decode step: each layer's q, k, v, output projection and MLP (an MoE layer:
its router, its shared expert and min(experts, top-k x live) routed experts, the most the live
tokens can touch), the output layer (hidden x vocab) and the live tokens' embedding rows. Norm
weights are ignored (a few KB). The model assumes what megagrpo's engine does: every sequence of
the rollout decodes in one batch (rollout.max_num_seqs, 256 by default, is above every
workload's batch x G) and all start together after the prefill.

A rollout is recorded (`rollout_costs`) as its prefill FLOPs and each decode step's FLOPs and
bytes, so a record's floor can be recomputed at any rates (`rollout_floor`).
"""
from __future__ import annotations

import torch

import _workloads as W  # benchmarks/ is on sys.path (run as a script or via grpo_step)
from _common import markdown_table, parser, records


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of the rollout's weights and KV cache."""
    return torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def kv_bytes_per_position(model, nbytes: int) -> int:
    """Bytes of keys and values one position holds over all layers: 2 x layers x KV heads x
    head_dim x element size."""
    return 2 * model.num_layers * model.num_query_groups * model.head_dim * nbytes


def _layer_weights(model, layer: int, live: int) -> int:
    """Weight elements a decode step of `live` sequences reads in transformer layer `layer`."""
    H, hd = model.hidden_size, model.head_dim
    q, kv = model.num_attention_heads * hd, model.num_query_groups * hd
    attention = H * (q + 2 * kv) + q * H
    if not model.is_moe_layer(layer):
        return attention + 3 * H * model.ffn_hidden_size
    experts = min(model.num_experts, model.moe_topk * live)
    return (attention + H * model.num_experts + 3 * H * experts * model.moe_ffn_hidden_size
            + 3 * H * model.shared_expert_ffn_hidden_size)


def weight_bytes(model, nbytes: int, live: int) -> int:
    """Bytes of weights one decode step of `live` sequences reads (module docstring)."""
    layers = sum(_layer_weights(model, i, live) for i in range(model.num_layers))
    return (layers + model.hidden_size * model.vocab_size + live * model.hidden_size) * nbytes


def decode_profile(prompt_lengths: list[int], completion_lengths: list[list[int]]
                   ) -> list[list[int]]:
    """`[live_s, ctx_s]` for each decode step s = 1, 2, ...: the sequences still decoding (a
    completion of c tokens takes c - 1 decode steps after the prefill's first token) and the
    positions their new tokens attend (prompt + s each)."""
    seqs = [(p, c) for p, comps in zip(prompt_lengths, completion_lengths) for c in comps]
    steps = max((c - 1 for _, c in seqs), default=0)
    out = []
    for s in range(1, steps + 1):
        live = [p + s for p, c in seqs if c - 1 >= s]
        out.append([len(live), sum(live)])
    return out


def prefill_flops(model, prompt_lengths: list[int]) -> float:
    """Each group's prompt once plus the first token's logits (`_workloads.rollout_flops`)."""
    return sum(W.forward_flops(model, torch.tensor([p]), 1) for p in prompt_lengths)


def step_cost(model, nbytes: int, live: int, ctx: int) -> tuple[float, float]:
    """(FLOPs, bytes) of one decode step of `live` sequences attending `ctx` positions."""
    L, d = model.num_layers, model.num_attention_heads * model.head_dim
    per_token = sum(W.matmul_params_per_layer(model, i) for i in range(L))
    flops = live * (2.0 * per_token + 2.0 * model.hidden_size * model.vocab_size) \
        + 4.0 * d * L * ctx
    return flops, float(weight_bytes(model, nbytes, live) + kv_bytes_per_position(model, nbytes)
                        * ctx)


def rollout_costs(model, nbytes: int, prompt_lengths: list[int],
                  completion_lengths: list[list[int]]) -> list:
    """One rollout as `[prefill FLOPs, [[FLOPs_s, bytes_s] per decode step]]`: what its floor
    needs besides the rates, so a record holding it can be priced at any rates."""
    return [prefill_flops(model, prompt_lengths),
            [list(step_cost(model, nbytes, live, ctx))
             for live, ctx in decode_profile(prompt_lengths, completion_lengths)]]


def rollout_floor(rollouts: list, gflops: float, gbs: float) -> dict:
    """The floor of `rollouts` (each `rollout_costs`' output; several are summed: on one
    machine they share its rates) at `gflops` GFLOP/s and `gbs` GB/s: floor_s, its prefill and
    decode parts, the decode's FLOP-only and bytes-only sums, and the decode steps where the
    bytes bind (of all steps)."""
    pre = decode = flop_s = byte_s = 0.0
    steps = bound = 0
    for prefill, costs in rollouts:
        pre += prefill / (gflops * 1e9)
        for f, b in costs:
            tf, tb = f / (gflops * 1e9), b / (gbs * 1e9)
            decode += max(tf, tb)
            flop_s, byte_s = flop_s + tf, byte_s + tb
            bound += tb > tf
        steps += len(costs)
    return dict(floor_s=pre + decode, prefill_s=pre, decode_s=decode, decode_flop_s=flop_s,
                decode_byte_s=byte_s, steps=steps, bandwidth_bound_steps=bound)


def binding(rec: dict) -> str:
    """Which limit binds a record's rollout: bandwidth / FLOPs on how many decode steps, and
    the prefill's share of the floor."""
    steps, bw = rec["rollout_decode_steps"], rec["rollout_bandwidth_bound_steps"]
    if bw == 0:
        limit = "FLOPs (every decode step)"
    elif bw == steps:
        limit = "bandwidth (every decode step)"
    else:
        limit = f"FLOPs on {steps - bw}, bandwidth on {bw} of {steps} decode steps"
    return limit


def table(path: str) -> str:
    """The markdown table of the bandwidth-aware rollout floor, one row per grpo_step.py record
    of `path` that holds its rollouts' costs (the newest per workload, dtype and rank count)."""
    rows: dict = {}
    for r in records(path):
        if r.get("system") == "megagrpo" and "mem_read_gbs" in r:
            rows[(r["workload"], r["dtype"], r["nproc"])] = r
    cells = []
    for (wl, dt, n), r in rows.items():
        t = r["time_rollout_s"]
        flop = r["floor_rollout_flops_only_s"]
        cells.append([
            wl, dt, n, f"{t:.3f} s", f"{flop:.3f} s ({flop / t:.1%})",
            f"{r['floor_rollout_s']:.3f} s ({r['floor_frac_rollout']:.1%})",
            f"{r['rollout_decode_flop_s']:.3f} / {r['rollout_decode_byte_s']:.3f} s",
            binding(r), f"{r['gemm_gflops']:.0f} GFLOP/s", f"{r['mem_read_gbs']:.1f} GB/s",
            f"{r['loadavg_1m']:.2f}"])
    return markdown_table(
        ["workload", "dtype", "ranks", "rollout", "FLOP floor (fraction)",
         "bandwidth-aware floor (fraction)", "decode at GEMM rate / at bandwidth",
         "limit that binds", "GEMM rate", "read bandwidth", "load"], cells)


def main() -> None:
    ap = parser("The bandwidth-aware rollout floor table of docs/performance.md from "
                "grpo_step.py records.")
    ap.add_argument("--table", default="benchmarks/results/rollout_floor_epyc_cpu.jsonl")
    print(table(ap.parse_args().table))


if __name__ == "__main__":
    main()
