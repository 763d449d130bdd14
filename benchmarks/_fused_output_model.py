"""A byte / FLOP / launch model of the fused output layer and the logits path on one GPU, and
docs/performance.md's H200 table (measured beside modelled), for benchmarks/fused_output.py.

Per forward + backward (``b`` bytes per value, ``T`` tokens, ``V`` the shard's vocab, ``H``):

- logits path: 3 GEMMs of ``2 T V H`` FLOPs, the loss kernel's row passes over the ``[T, V]``
  logits (read in the forward, read + written in the backward: ``3 T V b`` bytes), ~40 ops.
- fused, recomputing (chunks ``[Tc, Vc]``): 4 GEMMs (forward, recomputed logits, dh, dW), the
  same row passes, the fp32 accumulators (each chunk's ``[Tc, H]`` dh product added into fp32:
  ``(2b + 8) T H`` bytes per vocab chunk; below fp32 and with several token chunks the same for
  dW per token chunk) and ~22 launches per chunk (2 GEMMs + 2 Triton kernels + ~12 ops merging
  the online statistics in the forward; 3 GEMMs, a Triton kernel and the adds in the backward).
- fused, gradient in the forward (token chunks ``[Tc, V]``): 3 GEMMs, each streaming the whole
  weight shard per chunk (a thin chunk is bound by those bytes, not its FLOPs), the fp32 ``dW``
  accumulator read + written per chunk (``(2b + 8) V H`` below fp32: the bf16 product of each
  block of DW rows, then the fp32 add), and per chunk 2 launches per dW block plus the per-token
  loss graph (LOSS_OPS) plus ~20.

Device time = GEMM FLOPs / GEMM_RATE + bytes / ROW_BYTES_RATE; host time = launches x
LAUNCH_S; the call takes the larger (the host enqueues while the GPU runs). The rates come from
the H200 rows (logits path and log-prob kernels), LAUNCH_S from the probe's host times.
"""
from __future__ import annotations

import json
import os

GEMM_RATE = 700e12
"""bf16 GEMM FLOP/s as the logits path gets it on the H200 (T=16384, H 1024: 15.3 TFLOP in its
three GEMMs, ~21.5 ms of its 26.6 ms beside the ~5.1 ms of its loss kernel)."""
ROW_BYTES_RATE = 2.7e12
"""Bytes/s of the row passes and accumulator adds (the Triton log-prob kernels' 2.7 TB/s at
T=16384 on the H200, 0.67 of its copy bandwidth)."""
LAUNCH_S = 25e-6
"""Host seconds per launched op in these loops (H200 machine, torch 2.11, triton 3.6): the probe's
host time per chunk over its launches, 0.58 ms per recomputing chunk of ~22 launches and 4.4 ms
per 128-token gradient chunk of ~180."""
MISALIGNED_GEMM = 0.37
"""GEMM rate factor when the chunk's rows are not 16-byte aligned (Vc = 4748 in bf16): fitted to
the probe's two GEMM-bound (H 4096) rows, 88 / 35 ms and 353 / 167 ms against Vc = 4736."""
LOSS_OPS = {"grpo": 40, "nll": 10}
"""Ops of one token chunk's per-token loss graph (forward and autograd backward): the
benchmark's GRPO loss (clip, k3 KL) and the probe's NLL."""
MS = 1e3


def cost_model(path: str, t: int, h: int, v: int, b: int, grad: str | None = None,
               chunk_tokens: int | None = None, chunk_vocab: int | None = None,
               dw_block: int = 16384, loss: str = "grpo") -> dict:
    """Predicted seconds ``s`` of one forward + backward and what is behind them (module doc):
    ``path`` "logits" or "fused" with ``grad`` "forward" | "recompute" and its chunk shape."""
    rows = 3 * t * v * b
    if path == "logits":
        flops, acc, launches = 6 * t * v * h, 0, 40
        gemm_s = flops / GEMM_RATE
    elif grad == "forward":
        tc = chunk_tokens
        n = -(-t // tc)
        flops = 6 * t * v * h
        per_gemm = max(2 * tc * v * h / GEMM_RATE, (v * h * b + tc * v * b) / ROW_BYTES_RATE)
        gemm_s = n * 3 * per_gemm
        blocks = -(-v // dw_block) if b < 4 else 1
        acc = n * v * h * ((2 * b + 8) if b < 4 else 8) + t * h * (2 * b + 8)
        launches = n * (2 * blocks + LOSS_OPS[loss] + 20)
    else:
        tc, vc = chunk_tokens, chunk_vocab
        nt, nv = -(-t // tc), -(-v // vc)
        flops = 8 * t * v * h
        gemm_s = flops / (GEMM_RATE * (MISALIGNED_GEMM if vc * b % 16 else 1.0))
        acc = nv * t * h * (2 * b + 8) + (nt * v * h * (2 * b + 8) if nt > 1 and b < 4 else 0)
        launches = nt * nv * 22
    device_s = gemm_s + (rows + acc) / ROW_BYTES_RATE
    return dict(s=max(device_s, launches * LAUNCH_S), device_s=device_s,
                host_s=launches * LAUNCH_S, flops=flops, bytes=rows + acc, launches=launches)


def _v1_shapes(t: int, v: int) -> dict:
    """(Tc, Vc) of the H200 benchmark's fused rows: the v1 GPU rules they ran under."""
    tc = min(t, 4096)
    vc = min(v, max(256, min(1 << 25, max(1 << 20, t * v // 32)) // tc))
    tg = min(t, min(1 << 25, max(1 << 20, t * v // 32)) // v)
    return {"fused_recompute": ("recompute", tc, vc, 2048),
            "fused_forward": ("forward", tg, v, 2048)}


def _v2_shapes(t: int, v: int) -> dict:
    """(Tc, Vc) of the fused rows run under the v2 GPU rules (kernels/fused_output.py)."""
    from megagrpo.kernels import fused_output as fo

    tc, vc = fo.chunk_shape(t, v, True)
    tg = fo.grad_chunk_tokens(t, v, cuda=True)
    return {"fused_recompute": ("recompute", tc, vc, fo.DW_BLOCK_ROWS_CUDA),
            "fused_forward": ("forward", tg, v, fo.DW_BLOCK_ROWS_CUDA)}


def _probe_case(case: str, t: int, v: int) -> tuple | None:
    """(grad, Tc, Vc, dW block) of a probe row's case name ("rec 4096x4736", "grad 128
    blk2048"); None for its naive row."""
    parts = case.split()
    if parts[0] == "rec":
        tc, vc = (int(x) for x in parts[1].split("x"))
        return "recompute", tc, vc, 16384
    if parts[0] == "grad":
        return "forward", int(parts[1]), v, int(parts[2][3:])
    return None


def _row(source, h, t, path, shape, measured_s, host_s, loss, v, peak_pct) -> str:
    grad, tc, vc, blk = shape if shape else (None, None, None, None)
    m = cost_model("logits" if shape is None else "fused", t, h, v, 2, grad, tc, vc, blk or 16384,
                   loss)
    chunk = "-" if shape is None else (f"{tc} x {vc}" + (f", dW blocks {blk}" if grad == "forward"
                                                          else ""))
    host = "-" if host_s is None else f"{host_s * MS:.1f}"
    pct = "-" if peak_pct is None else f"{peak_pct:.1f}%"
    return (f"| {source} | {h} | {t} | {path} | {chunk} | {measured_s * MS:.1f} | {host} | "
            f"{m['s'] * MS:.1f} | {m['launches']} | {measured_s / m['s']:.2f} | {pct} |")


def h200_table(path: str) -> str:
    """docs/performance.md's "Fused output layer on the H200" table: the gpu_check rows of
    ``path`` (GRPO loss; the naive row left out, it is not modelled) and the probe rows of
    fused_output_probe_h200.jsonl beside it (NLL loss), each with the model's time, launches
    and measured / model."""
    lines = ["| source | H | T | path | Tc x Vc | measured ms | host ms | model ms | model "
             "launches | measured / model | peak, % of logits |", "|" + "---|" * 11]
    for line in open(path):
        r = json.loads(line) if line.strip() else None
        if not r or "fwd_bwd_s" not in r or r["path"] == "naive":
            continue
        shape = _v1_shapes(r["T"], r["V_local"]).get(r["path"])
        lines.append(_row("gpu_check, GRPO", r["H"], r["T"], r["path"], shape, r["fwd_bwd_s"],
                          None, "grpo", r["V_local"], r.get("peak_pct_of_logits")))
    v2 = os.path.join(os.path.dirname(path), "fused_output_v2_h200.jsonl")
    if os.path.exists(v2):  # the same gpu_check step, rerun under the v2 rules
        for line in open(v2):
            r = json.loads(line) if line.strip() else None
            if not r or "fwd_bwd_s" not in r or r["path"] == "naive":
                continue
            shape = _v2_shapes(r["T"], r["V_local"]).get(r["path"])
            lines.append(_row("gpu_check v2, GRPO", r["H"], r["T"], r["path"], shape,
                              r["fwd_bwd_s"], None, "grpo", r["V_local"],
                              r.get("peak_pct_of_logits")))
    probe = os.path.join(os.path.dirname(path), "fused_output_probe_h200.jsonl")
    if os.path.exists(probe):
        for line in open(probe):
            r = json.loads(line) if line.strip() else None
            shape = _probe_case(r["case"], r["T"], r["V"]) if r and "s" in r else None
            if shape is None:
                continue
            name = "recompute" if shape[0] == "recompute" else "grad in forward"
            lines.append(_row("probe, NLL", r["H"], r["T"], name, shape, r["s"], r["host_s"],
                              "nll", r["V"], None))
    return "\n".join(lines)
