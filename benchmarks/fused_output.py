"""Benchmark the fused output layer against the logits path: forward + backward of the GRPO loss
from the final hidden states, time and peak extra memory.

Usage (from the repo root; the same command runs on CUDA unchanged):

    .venv/bin/python benchmarks/fused_output.py                  # H 1024, V 151936, TP 1 and 2
    .venv/bin/python benchmarks/fused_output.py --T 1024,2048 --tp 1 --iters 1 --check
    .venv/bin/python benchmarks/fused_output.py --out benchmarks/results/fused_output_cpu.jsonl

One JSON line per (TP, T, dtype, path). Every path computes the same thing from ``h [T, H]``
and this rank's output weight ``W [V/tp, H]``: per-token log-probs with grad, entropy, a clipped
GRPO loss with a k3 KL term, summed, then the gradients w.r.t. ``h`` and ``W``
(``torch.autograd.grad``).

Paths:
- ``logits`` (a): megatron's output-layer matmul (``h @ W^T``, as ColumnParallelLinear computes
  it; under TP its input gradient is all-reduced, as megatron does) + today's fused logits
  kernel (``grpo_token_loss``, gradient written into the logits buffer).
- ``fused_forward`` (b3): ``fused_output_grpo_weighted_loss`` (kernels/fused_output.py) forced
  onto its gradient-in-forward path: no [T, V/tp] logits, 3 matmuls.
- ``fused_recompute`` (b4): ``fused_output_grpo_loss``, the recomputing backward (4 matmuls).
- ``fused`` (optional, ``--paths``): ``fused_output_grpo_weighted_loss`` as training calls it,
  choosing (b3) or (b4) by ``use_grad_in_forward``.
- ``naive`` (c): the full logits, ``log_softmax`` of an fp32 copy, gather (TP=1 only).

TP=2 runs 2 ranks (spawned, gloo, the cores split between them); rank 0 measures and prints,
collectives included. ``peak_extra_bytes`` (``_harness``): the highest allocation during the
call beyond what existed before it; ``peak_beyond_outputs_bytes`` subtracts the outputs the
call returns (dh, dW), and ``peak_pct_of_logits`` is that over the bytes of (a)'s logits
``[T, V/tp]``. Before running a size, each path's need is estimated against the memory budget
(``--mem-gib``, default 85% of the free GPU memory, or of MemAvailable shared by the ranks):
a size a path cannot reach is a row with ``skipped`` saying why, never a crash (an allocation
failure is caught the same way).
On CPU each row carries the 1-minute load average and ``torch.backends.cpu`` capability.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import emit, peak_extra_bytes, time_samples  # noqa: E402

from megagrpo.kernels import (  # noqa: E402
    fused_output_grpo_loss, fused_output_grpo_weighted_loss, fused_output_logprob,
    grpo_loss_from_logp, grpo_token_loss,
)
from megagrpo.kernels import fused_output as fo  # noqa: E402
from megagrpo.kernels.fused_output import reference_output_logprob  # noqa: E402

LOSS_OPTS = dict(eps_low=0.2, eps_high=0.28, beta=0.04, kl_estimator="k3")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PATHS = ("logits", "fused_forward", "fused_recompute", "naive")
"""The default paths; "fused" (the automatic choice between the two fused ones) on request."""
TEMPERATURE = 0.9


def make_inputs(t: int, h: int, v: int, tp: int, rank: int, dtype, device, group=None) -> dict:
    """Hidden states, this rank's weight rows and the loss inputs (the same on every rank)."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(t, h, generator=g).to(device=device, dtype=dtype)
    v_local = v // tp
    g_w = torch.Generator().manual_seed(1 + rank)  # each rank's own shard of W
    w = (torch.randn(v_local, h, generator=g_w) * (2.0 / h ** 0.5)).to(device=device,
                                                                       dtype=dtype)
    target = torch.randint(0, v, (t,), generator=g).to(device)
    mask = (torch.rand(t, generator=g) > 0.1).to(device)
    with torch.no_grad():  # old / reference log-probs near the policy's: ratios near 1
        logp = fused_output_logprob(hidden, w, target, temperature=TEMPERATURE, group=group)
    return dict(hidden=hidden, weight=w, target=target, mask=mask,
                old_logp=logp + 0.3 * torch.randn(t, generator=g).to(device),
                advantages=torch.randn(t, generator=g).to(device),
                ref_logp=logp + 0.3 * torch.randn(t, generator=g).to(device))


def loss_of(path: str, h, w, inp: dict, group) -> tuple[torch.Tensor, torch.Tensor]:
    """(the summed loss to differentiate, the per-token loss [T] to compare)."""
    args = (inp["target"], inp["old_logp"], inp["advantages"], inp["mask"])
    if path in ("fused", "fused_forward"):
        ones = torch.ones_like(inp["advantages"])
        total, tok, _ = fused_output_grpo_weighted_loss(
            h, w, *args, ones, ref_logp=inp["ref_logp"], group=group, temperature=TEMPERATURE,
            grad_in_forward=True if path == "fused_forward" else None, **LOSS_OPTS)
        return total, tok
    if path == "fused_recompute":
        tok = fused_output_grpo_loss(h, w, *args, ref_logp=inp["ref_logp"], group=group,
                                     temperature=TEMPERATURE, **LOSS_OPTS)[0]
    elif path == "logits":
        h_in = _AllReduceGrad.apply(h, group) if group is not None else h
        tok = grpo_token_loss(h_in @ w.T, *args, ref_logp=inp["ref_logp"], group=group,
                              temperature=TEMPERATURE, inplace_backward=True, **LOSS_OPTS)[0]
    else:
        logp, entropy = reference_output_logprob(h, w, inp["target"], temperature=TEMPERATURE,
                                                 dtype=h.dtype)
        tok = grpo_loss_from_logp(logp, inp["old_logp"], inp["advantages"], inp["mask"],
                                  entropy=entropy.detach(), ref_logp=inp["ref_logp"],
                                  **LOSS_OPTS)[0]
    return tok.sum(), tok


class _AllReduceGrad(torch.autograd.Function):
    """Identity forward, all-reduce backward: megatron's copy_to_tensor_model_parallel_region
    in front of a ColumnParallelLinear."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g, None


def need_bytes(path: str, t: int, h: int, v_local: int, b: int) -> int:
    """Rough peak of one call beyond its inputs, to refuse sizes before allocating them."""
    outputs = (t + v_local) * h * b  # dh, dW
    logits = t * v_local
    if path == "logits":  # logits (gradient in place) + the kernel's chunks + matmul temporaries
        # 2x: at T=16384 (fp32, TP=1) the OOM killer took the run at 24 GB RSS, 2.4x the logits
        # (the dW GEMM on the transposed gradient may take a contiguous copy of it)
        return outputs + logits * b * 2 + (64 << 20)
    if path == "naive":  # logits, an fp32 copy, log_softmax, its exp, their gradients
        return outputs + logits * (b + 4 * 4)
    # fp32 accumulators (dW's beside a bf16 output: the weighted path holds it to backward),
    # chunks
    return outputs + (t * h + v_local * h) * 4 + logits * 4 // 32 + (256 << 20)


def mem_budget(arg_gib: float | None, tp: int, device: torch.device) -> int:
    """Bytes one rank may use: --mem-gib, else 85% of the free GPU memory or of MemAvailable
    shared by the ranks."""
    if arg_gib is not None:
        return int(arg_gib * (1 << 30))
    if device.type == "cuda":
        return int(0.85 * torch.cuda.mem_get_info(device)[0])
    with open("/proc/meminfo") as f:
        avail = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable"))
    return int(0.85 * avail / tp)


def run_path(path: str, inp: dict, group, device, iters: int) -> dict:
    h = inp["hidden"].clone().requires_grad_()
    w = inp["weight"].clone().requires_grad_()

    def step():
        return torch.autograd.grad(loss_of(path, h, w, inp, group)[0], [h, w])

    peak = peak_extra_bytes(step, device)  # first call: also the warm-up
    samples = time_samples(step, device, warmup=0, iters=iters)
    with torch.no_grad():
        loss = loss_of(path, h, w, inp, group)[1].float()
    out_bytes = (h.numel() + w.numel()) * h.element_size()
    return dict(fwd_bwd_s=round(statistics.median(samples), 6),
                fwd_bwd_min_s=round(min(samples), 6), peak_extra_bytes=peak,
                peak_beyond_outputs_bytes=max(0, peak - out_bytes), loss=loss)


def check(device) -> bool:
    """Fused op vs the float64 reference on a small shape (both paths of dispatch)."""
    worst = 0.0
    inp = make_inputs(64, 32, 4096, 1, 0, torch.float32, device)
    for impl in ("torch", "triton") if device.type == "cuda" else ("torch",):
        lp, ent = fused_output_logprob(inp["hidden"], inp["weight"], inp["target"],
                                       temperature=TEMPERATURE, with_entropy=True, impl=impl)
        rl, re = reference_output_logprob(inp["hidden"].cpu(), inp["weight"].cpu(),
                                          inp["target"].cpu(), temperature=TEMPERATURE)
        worst = max(worst, float((lp.cpu() - rl).abs().max()), float((ent.cpu() - re).abs().max()))
    ok = worst < 1e-4
    emit(dict(check="fused_output vs float64", device=device.type, ok=ok, max_abs_err=worst))
    return ok


def bench(rank: int, tp: int, args, rdzv: str | None) -> None:
    """One rank of one TP size: every (T, dtype, path) row; rank 0 prints."""
    device = torch.device(args.device)
    cpu = device.type == "cpu"
    if cpu:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    group = None
    if tp > 1:
        dist.init_process_group("nccl" if not cpu else "gloo", init_method=f"file://{rdzv}",
                                rank=rank, world_size=tp)
        if not cpu:
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        group = dist.group.WORLD
    budget = mem_budget(args.mem_gib, tp, device)
    try:
        for dname in args.dtypes.split(","):
            dtype = DTYPES[dname]
            for t in (int(s) for s in args.T.split(",")):
                bench_size(rank, tp, t, dname, dtype, budget, group, device, args)
    finally:
        if group is not None:
            dist.destroy_process_group()


def bench_size(rank, tp, t, dname, dtype, budget, group, device, args) -> None:
    v_local, b = args.V // tp, DTYPES[dname].itemsize
    logits_bytes = t * v_local * b
    ref = None
    inp = None
    for path in args.paths.split(","):
        record = dict(path=path, T=t, H=args.H, V=args.V, V_local=v_local, dtype=dname, TP=tp,
                      device=device.type, logits_bytes=logits_bytes)
        if path.startswith("fused"):  # rows before the gradient-in-forward path carry none
            record["fused_grad"] = _fused_grad(path, t, v_local, args.H, dname)
        if device.type == "cpu":
            record.update(load_avg_1m=round(os.getloadavg()[0], 2),
                          cpu=torch.backends.cpu.get_cpu_capability())
        need = need_bytes(path, t, args.H, v_local, b)
        inputs = (t * args.H + v_local * args.H) * b
        if path == "naive" and tp > 1:
            reason = "needs the full vocab on one rank (TP=1 only)"
        elif need + inputs > budget:
            reason = (f"needs ~{(need + inputs) / 2**30:.1f} GiB > the budget "
                      f"{budget / 2**30:.1f} GiB per rank")
        else:
            reason = None
        if reason is None:
            try:
                if inp is None:
                    inp = make_inputs(t, args.H, args.V, tp, rank, dtype, device, group)
                res = run_path(path, inp, group, device, args.iters)
            except (RuntimeError, MemoryError) as e:  # an allocation failure: a row, no crash
                reason = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        if reason is not None:
            if rank == 0:
                emit(dict(record, skipped=reason), args.out)
            continue
        loss = res.pop("loss")
        ref = loss if ref is None else ref
        record.update(res, peak_pct_of_logits=round(
            100 * res["peak_beyond_outputs_bytes"] / logits_bytes, 2),
            loss_max_abs_diff=float((loss - ref).abs().max()),
            loss_max_rel_diff=float((loss - ref).abs().max() / (1 + ref.abs().max())))
        if rank == 0:
            emit(record, args.out)
    del inp


def fit_rows(args) -> None:
    """The step-level effect on the vocab pass: the largest micro-batch (tokens) whose vocab
    pass fits ``--fit-gib`` per rank, per path, on the SmolLM2-135M shapes (H 576, V 49,152,
    TP=1): peak extra memory (beyond inputs and outputs) measured at two sizes, a line through
    them (the pass is linear in T), solved for the budget. The fused op's chunk grows with T up
    to its cap (``CHUNK_ELEMS``), which these small sizes do not reach: its fixed term is then
    up to ~2 x 16 MiB larger than fitted (negligible against a GiB budget). The rest of the step
    (weights, activations) is not in it: that is the planner's arithmetic (megagrpo plan)."""
    device = torch.device(args.device)
    h, v, sizes = 576, 49152, (128, 256)
    for path in args.paths.split(","):
        peaks = []
        for t in sizes:
            inp = make_inputs(t, h, v, 1, 0, DTYPES["fp32"], device)
            peaks.append(run_path(path, inp, None, device, 1)["peak_beyond_outputs_bytes"])
        per_token = (peaks[1] - peaks[0]) / (sizes[1] - sizes[0])
        fixed = peaks[0] - per_token * sizes[0]
        budget = args.fit_gib * (1 << 30)
        out_per_token = h * 4  # dh is an output, but it is live memory too
        max_t = int((budget - fixed) / (per_token + out_per_token)) if per_token > 0 else None
        emit(dict(fit="smollm2-135m vocab pass", path=path, H=h, V=v, dtype="fp32",
                  device=device.type, budget_gib=args.fit_gib, measured_T=list(sizes),
                  bytes_per_token=round(per_token + out_per_token), fixed_bytes=round(fixed),
                  max_tokens=max_t), args.out)


def _fused_grad(path: str, t: int, v_local: int, h: int = 1024, dtype: str = "fp32") -> str:
    """Which backward a fused path runs at this size: "forward" (3 matmuls) or "recompute"."""
    if path == "fused":
        tc = fo.grad_chunk_tokens(t, v_local)
        auto = fo.use_grad_in_forward(t, tc, h, DTYPES[dtype].itemsize)
        return "forward" if auto else "recompute"
    return "forward" if path == "fused_forward" else "recompute"


def _column(r: dict) -> str:
    """The table column of a row: by the backward a fused row ran ("fused" rows without
    ``fused_grad`` predate the gradient-in-forward path: the recomputing backward)."""
    if r["path"].startswith("fused"):
        return "fused_forward" if r.get("fused_grad") == "forward" else "fused_recompute"
    return r["path"]


def table(path: str) -> str:
    """The markdown table of docs/performance.md from the JSON lines in ``path``: per (device,
    TP, dtype, T) the newest row of each column, times in s and as a ratio to (a), peaks beyond
    the outputs in % of (a)'s logits, which fused path training takes there (``use_grad_in_
    forward``) and the 1-minute load average of the (b3) row."""
    latest: dict[tuple, dict] = {}
    for line in open(path):
        r = json.loads(line) if line.strip() else None
        if r and "path" in r:
            latest[(r["device"], r["TP"], r["dtype"], r["T"], _column(r))] = r
    sizes = sorted({k[:4] for k in latest}, key=lambda k: (k[0], k[2] != "fp32", k[1], k[3]))
    head = ("| device | TP | dtype | T | (a) logits | (b3) fused, 3 matmuls | (b4) fused, "
            "recompute | (b3) / (a) | (b4) / (a) | training runs | (b3) / (b4) peak, % of "
            "logits | (c) naive | load |")
    lines = [head, "|" + "---|" * 13]
    for key in sizes:
        a, b3, b4, c = (latest.get(key + (p,)) for p in PATHS)

        def sec(r):
            return "-" if r is None else (f"{r['fwd_bwd_s']:.2f} s" if "fwd_bwd_s" in r
                                          else "n/a: " + r["skipped"].split(" (")[0])

        def ratio(r):
            ok = r and a and "fwd_bwd_s" in r and "fwd_bwd_s" in a
            return f"{r['fwd_bwd_s'] / a['fwd_bwd_s']:.2f}x" if ok else "-"

        def pct(r):
            return f"{r['peak_pct_of_logits']:.1f}%" if r and "peak_pct_of_logits" in r else "-"

        r0 = a or b3 or b4
        auto = _fused_grad("fused", key[3], r0["V_local"], r0["H"], key[2])
        runs = "(b3)" if auto == "forward" else "(b4)"
        load = next((r.get("load_avg_1m") for r in (b3, b4, a) if r), None)
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {sec(a)} | {sec(b3)} | "
                     f"{sec(b4)} | {ratio(b3)} | {ratio(b4)} | {runs} | {pct(b3)} / {pct(b4)} | "
                     f"{sec(c)} | {'-' if load is None else load} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--H", type=int, default=1024)
    ap.add_argument("--V", type=int, default=151936, help="full vocab (V/tp per rank)")
    ap.add_argument("--T", default="1024,2048,4096,8192,16384,32768", help="tokens, comma list")
    ap.add_argument("--tp", default="1,2", help="comma-separated TP sizes")
    ap.add_argument("--dtypes", default="fp32", help="fp32 and/or bf16 (bf16 where it is fast)")
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--iters", type=int, default=None, help="timed iterations (5 GPU, 1 CPU)")
    ap.add_argument("--mem-gib", type=float, default=None, help="memory budget per rank")
    ap.add_argument("--out", default=None, help="append the JSON lines to this file too")
    ap.add_argument("--check", action="store_true", help="float64 check first (exit 1 on error)")
    ap.add_argument("--fit-gib", type=float, default=None,
                    help="only the largest micro-batch whose vocab pass fits this budget "
                         "(SmolLM2-135M shapes), see fit_rows")
    ap.add_argument("--table", default=None, metavar="JSONL",
                    help="only print docs/performance.md's table from these result lines")
    args = ap.parse_args(argv)
    if args.table:
        print(table(args.table))
        return
    if args.fit_gib is not None:
        args.iters = 1
        fit_rows(args)
        return
    args.iters = args.iters or (5 if args.device == "cuda" else 1)
    if args.check and not check(torch.device(args.device)):
        sys.exit(1)
    for tp in (int(s) for s in args.tp.split(",")):
        if tp == 1:
            bench(0, 1, args, None)
        else:
            rdzv = os.path.join(tempfile.mkdtemp(), "rdzv")
            mp.spawn(bench, args=(tp, args, rdzv), nprocs=tp)


if __name__ == "__main__":
    main()
