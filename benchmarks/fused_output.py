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
  kernel (``token_loss`` on the logits, gradient written into the logits buffer).
- ``fused_forward`` (b3): ``token_loss`` on the hidden states with token weights forced
  onto its gradient-in-forward path: no [T, V/tp] logits, 3 matmuls.
- ``fused_recompute`` (b4): ``token_loss`` on the hidden states without token weights: the
  recomputing backward (4 matmuls).
- ``fused`` (optional, ``--paths``): ``token_loss`` with token weights as training calls it,
  choosing (b3) or (b4) by ``use_grad_in_forward``.
- ``naive`` (c): the full logits, ``log_softmax`` of an fp32 copy, gather (TP=1 only).

TP=2 runs 2 ranks (spawned, gloo, the cores split between them); rank 0 measures and prints,
collectives included. ``peak_extra_bytes`` (``_harness``): the highest allocation during the
call beyond what existed before it; ``peak_beyond_outputs_bytes`` subtracts the outputs the
call returns (dh, dW), and ``peak_pct_of_logits`` is that over the bytes of (a)'s logits
``[T, V/tp]``; on CPU the peak is torch's allocations (the profiler's record) up to
PROFILE_MAX_LOGITS logits per rank and the RSS high-water mark beyond (``peak_method``; the
table marks those "(RSS)"). Before running a size, each path's need is estimated against the
memory budget (``--mem-gib``, default 85% of the free GPU memory, or of MemAvailable shared
by the ranks): a size a path cannot reach is a row with ``skipped`` saying why, never a
crash (an allocation failure is caught the same way).
On CPU each row carries the 1-minute load average and ``torch.backends.cpu`` capability.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import parser, print_table  # noqa: E402
from _fused_output_model import cost_model, h200_table  # noqa: E402
from _harness import emit, peak_extra_bytes, sync, time_samples  # noqa: E402

from megagrpo.kernels import (  # noqa: E402
    LossSpec, TokenInputs, VocabPass, fused_output_logprob, loss_from_logp, token_loss,
)
from megagrpo.kernels import fused_output as fo  # noqa: E402
from megagrpo.kernels.fused_output import reference_output_logprob  # noqa: E402

SPEC = LossSpec(eps_low=0.2, eps_high=0.28, beta=0.04, kl_estimator="k3", temperature=0.9)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PATHS = ("logits", "fused_forward", "fused_recompute", "naive")
"""The default paths; "fused" (the automatic choice between the two fused ones) on request."""
TEMPERATURE = SPEC.temperature


def make_inputs(t: int, h: int, v: int, tp: int, rank: int, dtype, device, group=None,
                on_device: bool = False) -> dict:
    """Hidden states, this rank's weight rows and the loss inputs (the same on every rank);
    ``on_device``: drawn by the device's generator (fast on a GPU; other values than the CPU's)."""
    dev = device if on_device else torch.device("cpu")
    g = torch.Generator(dev).manual_seed(0)

    def draw(fn, *shape, **kw):
        return fn(*shape, generator=g, device=dev, **kw).to(device)

    hidden = draw(torch.randn, t, h).to(dtype)
    v_local = v // tp
    g_w = torch.Generator(dev).manual_seed(1 + rank)  # each rank's own shard of W
    w = (torch.randn(v_local, h, generator=g_w, device=dev) * (2.0 / h ** 0.5)).to(
        device=device, dtype=dtype)
    target = draw(torch.randint, 0, v, (t,))
    mask = draw(torch.rand, t) > 0.1
    with torch.no_grad():  # old / reference log-probs near the policy's: ratios near 1
        logp = fused_output_logprob(hidden, w, target, temperature=TEMPERATURE, group=group)
    return dict(hidden=hidden, weight=w, target=target, mask=mask,
                old_logp=logp + 0.3 * draw(torch.randn, t), advantages=draw(torch.randn, t),
                ref_logp=logp + 0.3 * draw(torch.randn, t))


def loss_of(path: str, h, w, inp: dict, group, run: VocabPass | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the summed loss to differentiate, the per-token loss [T] to compare); ``run`` sets the
    fused paths' chunks and grad_in_forward choice (the sweep)."""
    inputs = TokenInputs(inp["old_logp"], inp["advantages"], inp["mask"],
                         ref_logp=inp["ref_logp"])
    run = VocabPass(group=group) if run is None else run
    if path in ("fused", "fused_forward"):
        ones = torch.ones_like(inp["advantages"])
        if path == "fused_forward":
            run = run._replace(grad_in_forward=True)
        total, tok, _ = token_loss(h, inp["target"], SPEC, inputs, weight=w, token_weight=ones,
                                   run=run)
        return total, tok
    if path == "fused_recompute":
        tok = token_loss(h, inp["target"], SPEC, inputs, weight=w, run=run)[0]
    elif path == "logits":
        h_in = _AllReduceGrad.apply(h, group) if group is not None else h
        tok = token_loss(h_in @ w.T, inp["target"], SPEC, inputs,
                         run=run._replace(inplace_backward=True))[0]
    else:
        logp, entropy = reference_output_logprob(h, w, inp["target"], temperature=TEMPERATURE,
                                                 dtype=h.dtype)
        tok = loss_from_logp(SPEC, inputs, logp, entropy.detach())[0]
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


PROFILE_MAX_LOGITS = 1 << 31
"""Above this many logits per rank the CPU peak is the RSS high-water mark, not the profiler's
allocation record (which grows with the op count: >16 GB at T=32768, TP=1)."""


def peak_method(t: int, v_local: int, device: torch.device, arg: str = "auto") -> str:
    if device.type != "cpu":
        return "allocator"
    if arg != "auto":
        return arg
    return "rss" if t * v_local > PROFILE_MAX_LOGITS else "allocator"


def run_path(path: str, inp: dict, group, device, iters: int, method: str = "allocator") -> dict:
    h = inp["hidden"].clone().requires_grad_()
    w = inp["weight"].clone().requires_grad_()

    def step():
        return torch.autograd.grad(loss_of(path, h, w, inp, group)[0], [h, w])

    peak = peak_extra_bytes(step, device, method)  # first call: also the warm-up
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


def spawned_bench(rank: int, tp: int, args, rdzv: str) -> None:
    """`bench` in a spawned TP rank, ended by `os._exit` once it has returned (every row printed
    and written). With torch 2.13, gloo collectives run under torch.profiler (the allocator peak)
    leave the process group's worker threads alive after destroy_process_group; ~15-20% of
    2-rank runs then died at interpreter exit ("terminate called without an active exception",
    SIGABRT) after printing every row. An exception still exits non-zero through mp.spawn."""
    bench(rank, tp, args, rdzv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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
        record["peak_method"] = peak_method(t, v_local, device, args.peak_method)
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
                res = run_path(path, inp, group, device, args.iters, record["peak_method"])
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


SMOLLM2_135M = ["model.vocab_size=49152", "model.hidden_size=576", "model.ffn_hidden_size=1536",
                "model.num_layers=30", "model.num_attention_heads=9", "model.num_query_groups=3",
                "model.head_dim=64", "model.max_position_embeddings=2048",
                "model.tie_word_embeddings=true"]
"""SmolLM2-135M-Instruct's shapes (the step-level rows use random weights: memory depends on
shapes only)."""


def _step_batch(n: int, prompt: int, completion: int, vocab: int):
    from megagrpo.parallel.batch import pack

    g = torch.Generator().manual_seed(n)
    prompts = [torch.randint(1, vocab, (prompt,), generator=g).tolist() for _ in range(n)]
    comps = [torch.randint(1, vocab, (completion,), generator=g).tolist() for _ in range(n)]
    return pack(prompts, comps, [[-1.0] * completion] * n, torch.randn(n, generator=g), pad_id=0,
                multiple=n)


def fit_rows(args) -> None:
    """The step-level effect: the largest micro-batch (tokens) whose GRPO update pass (one
    micro-batch forward + backward through a megatron model of SmolLM2-135M's shapes, 1 rank,
    fp32, beta 0.04 with k3, the output layer at loss positions) fits ``--fit-gib`` of extra
    memory beyond the model, its gradients and the optimizer state, with the fused output layer
    and without (the logits path). Peak extra memory (torch's allocations) is measured at two
    micro-batch sizes (sequences of 64 prompt + ``--fit-completion`` completion tokens), a line
    through them (the pass is linear in the sequence count) solved for the budget; with
    ``--fit-verify`` the pass is then run at the fitted size and its peak printed too."""
    from functools import partial

    from megagrpo.config.train import load_config
    from megagrpo.runtime.distributed import init_distributed, training_layout
    from megagrpo.train.losses import grpo_loss
    from megagrpo.model.gpt import build_model
    from megagrpo.model.optim import build_optimizer, wrap_ddp, zero_grad
    from megagrpo.train.passes import Passes

    cfg = load_config(None, SMOLLM2_135M + [f"model.num_layers={args.fit_layers}",
        "algo.beta=0.04", "algo.kl_estimator=k3", "compute.skip_zero_advantage=false",
        "log.progress=false"])
    device = torch.device("cpu")
    info = init_distributed(cfg.parallel, cfg.model)  # a bare process: rank 0 of 1
    ranks, groups = training_layout(cfg.parallel, cfg.model, info)
    ddp = wrap_ddp(build_model(cfg.model, cfg.parallel, seed=3), cfg.optim)
    opt = build_optimizer(ddp, cfg.optim)
    passes = Passes(cfg, ranks, groups)
    prompt, completion = 64, args.fit_completion
    seq = prompt + completion

    def peak(n: int, fused: bool) -> int:
        cfg.compute.micro_batch_size = n  # all n sequences in one (packed) micro-batch
        cfg.compute.micro_batch_tokens = n * seq
        cfg.compute.fused_output_layer = fused
        batch = _step_batch(n, prompt, completion, cfg.model.vocab_size)
        with torch.no_grad():
            scored = passes.logprobs(ddp, batch)
        batch.old_logp = torch.where(batch.mask, scored + 0.1, 0.0)
        batch.ref_logp = torch.where(batch.mask, scored - 0.1, 0.0)
        plan = passes.plan(batch, n)
        ctx = passes.loss_context(scale=len(plan), counts=passes.counts(batch, len(plan)),
                                  algo=cfg.algo, inplace_backward=True)
        zero_grad(ddp, opt)
        return peak_extra_bytes(lambda: passes.run(ddp, partial(grpo_loss, ctx), plan,
                                                    batch.ids.shape[1], n), device)

    sizes = (2, 4)
    budget = args.fit_gib * (1 << 30)
    rows = {}
    for fused in (False, True):
        peaks = [peak(n, fused) for n in sizes]
        per_seq = (peaks[1] - peaks[0]) / (sizes[1] - sizes[0])
        fixed = peaks[0] - per_seq * sizes[0]
        max_seqs = int((budget - fixed) // per_seq)
        row = dict(fit="smollm2-135m grpo update micro-batch", layers=args.fit_layers,
                   path="fused" if fused else "logits", H=576, V=49152, dtype="fp32",
                   device=device.type, cpu=torch.backends.cpu.get_cpu_capability(),
                   budget_gib=args.fit_gib,
                   seq_tokens=seq, measured_seqs=list(sizes), measured_peak_bytes=peaks,
                   bytes_per_token=round(per_seq / seq), fixed_bytes=round(fixed),
                   max_seqs=max_seqs, max_tokens=int((budget - fixed) // (per_seq / seq)))
        if fused:
            row["tokens_vs_logits_path"] = round(row["max_tokens"] /
                                                 max(1, rows[False]["max_tokens"]), 2)
        if args.fit_verify and budget < 0.6 * mem_budget(None, 1, device):
            row["verified_peak_bytes"] = peak(max_seqs, fused)
        rows[fused] = row
        emit(row, args.out)


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
        if r and "path" in r and "fit" not in r:  # --fit-gib rows have their own lines
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
            if not (r and "peak_pct_of_logits" in r):
                return "-"
            rss = " (RSS)" if r.get("peak_method") == "rss" else ""
            return f"{r['peak_pct_of_logits']:.1f}%{rss}"

        r0 = a or b3 or b4
        auto = _fused_grad("fused", key[3], r0["V_local"], r0["H"], key[2])
        runs = "(b3)" if auto == "forward" else "(b4)"
        load = next((r.get("load_avg_1m") for r in (b3, b4, a) if r), None)
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {sec(a)} | {sec(b3)} | "
                     f"{sec(b4)} | {ratio(b3)} | {ratio(b4)} | {runs} | {pct(b3)} / {pct(b4)} | "
                     f"{sec(c)} | {'-' if load is None else load} |")
    return "\n".join(lines)


def fit_table(path: str) -> str:
    """docs/performance.md's step-level rows from the --fit-gib lines in ``path`` (the newest
    line per path and budget)."""
    latest: dict[tuple, dict] = {}
    for line in open(path):
        r = json.loads(line) if line.strip() else None
        if r and "fit" in r:
            latest[(r["budget_gib"], r["path"])] = r
    lines = []
    for (gib, path_name), r in sorted(latest.items(), key=lambda kv: (kv[0][0],
                                                                      kv[0][1] != "logits")):
        name = "(a) logits" if path_name == "logits" else "(b) fused output layer"
        more = (f" ({r['tokens_vs_logits_path']:.2f}x)" if "tokens_vs_logits_path" in r else "")
        lines.append(f"| {name} | {r['bytes_per_token'] / 1e6:.3f} MB | "
                     f"{r['fixed_bytes'] / 2**20:.0f} MiB | {r['max_tokens']} tokens{more} |")
    return "\n".join(lines)


@contextmanager
def cuda_rules(rules: str):
    """Within the block the fused op's GPU chunk rules are ``rules`` ("v1" | "v2")."""
    before, fo.CUDA_RULES = fo.CUDA_RULES, rules
    try:
        yield
    finally:
        fo.CUDA_RULES = before


def sweep_configs(t: int, v_local: int) -> list[dict]:
    """The chunk shapes the sweep times at ``t`` tokens, each ``dict(name, path, rules, run)``
    (``run``: VocabPass fields): the logits path; training's call (``fused``, token weights) under
    the old ("v1") and new ("v2") GPU rules; its gradient-in-forward path forced on at the old
    width (v1 and v2: the dW block size differs) and at 1024 / 2048 / 4096 tokens; forced off at
    (Tc, Vc) = (4096, 8192 / 16384 / 32768) and (16384, 8192). Shapes are capped at the size
    (a tiny CPU smoke grid collapses to a few), duplicates dropped."""
    old_tc = fo.grad_chunk_tokens(t, v_local)  # the same under both rules' CPU constants
    rows = [dict(name="logits", path="logits", rules="v2", run={}),
            dict(name="default v1", path="fused", rules="v1", run={}),
            dict(name="default v2", path="fused", rules="v2", run={}),
            dict(name=f"grad Tc={old_tc} v1", path="fused", rules="v1",
                 run=dict(grad_in_forward=True))]
    for tc in (old_tc, 1024, 2048, 4096):
        tc = min(tc, t)
        rows.append(dict(name=f"grad Tc={tc}", path="fused", rules="v2",
                         run=dict(grad_in_forward=True, chunk_tokens=tc)))
    for tc, vc in ((4096, 8192), (4096, 16384), (4096, 32768), (16384, 8192)):
        tc, vc = min(tc, t), min(vc, v_local)
        rows.append(dict(name=f"recompute {tc}x{vc}", path="fused", rules="v2",
                         run=dict(grad_in_forward=False, chunk_tokens=tc, chunk_vocab=vc)))
    seen, out = set(), []
    for r in rows:
        key = (r["path"], r["rules"] if not r["run"] else "", tuple(sorted(r["run"].items())))
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def _resolved(cfg: dict, t: int, h: int, v_local: int, itemsize: int, cuda: bool) -> dict:
    """The (grad, Tc, Vc) a fused sweep row runs: its forced choices, else the op's rules."""
    if cfg["path"] == "logits":
        return {}
    run = cfg["run"]
    with cuda_rules(cfg["rules"]):
        tg = fo.grad_chunk_tokens(t, v_local, run.get("chunk_tokens"), cuda)
        grad = run.get("grad_in_forward")
        if grad is None:
            grad = fo.use_grad_in_forward(t, tg, h, itemsize, cuda)
        if grad:
            return dict(grad="forward", chunk_tokens=tg, chunk_vocab=v_local)
        tc, vc = fo.chunk_shape(t, v_local, cuda, run.get("chunk_tokens"),
                                run.get("chunk_vocab"))
    return dict(grad="recompute", chunk_tokens=tc, chunk_vocab=vc)


def _timed(step, device, iters: int, max_s: float) -> dict:
    """Median / min seconds of ``step()`` and the median host time to enqueue it (a call whose
    host time is its whole time is bound by launches, not by the device); at most ``iters``
    calls, fewer when one call takes more than ``max_s / iters``."""
    import time

    total, host = [], []
    for _ in range(max(1, iters)):
        sync(device)
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        sync(device)
        total.append(time.perf_counter() - t0)
        host.append(t1 - t0)
        if sum(total) > max_s:
            break
    return dict(fwd_bwd_s=round(statistics.median(total), 6), fwd_bwd_min_s=round(min(total), 6),
                host_s=round(statistics.median(host), 6), timed_calls=len(total))


def sweep(args) -> None:
    """``--sweep``: every ``sweep_configs`` shape at every (H, T) of ``--H`` x ``--T`` (one
    rank, ``--dtypes``' first dtype): time, host time, peak extra memory, the model's prediction
    (``cost_model``) and the largest gradient difference (dh, dW, relative to the largest value)
    from the logits path's per row; rows beyond the memory budget say so."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dname = args.dtypes.split(",")[0]
    dtype = DTYPES[dname]
    budget = mem_budget(args.mem_gib, 1, device)
    sizes = [(int(h), int(t)) for h in str(args.H).split(",") for t in args.T.split(",")]
    est = sum(cost_model(c["path"] if c["path"] == "logits" else "fused", t, h, args.V,
                         dtype.itemsize, **_resolved(c, t, h, args.V, dtype.itemsize, True),
                         dw_block=fo.DW_BLOCK_ROWS if c["rules"] == "v1"
                         else fo.DW_BLOCK_ROWS_CUDA)["s"]
              for h, t in sizes for c in sweep_configs(t, args.V))
    emit(dict(sweep="plan", sizes=sizes, rows=sum(len(sweep_configs(t, args.V))
                                                  for _, t in sizes),
              model_device_s_per_pass=round(est, 2), calls_per_row=2 + args.iters))
    for h, t in sizes:
        inp = ref = None
        for cfg in sweep_configs(t, args.V):
            res = _resolved(cfg, t, h, args.V, dtype.itemsize, cuda)
            record = dict(sweep=cfg["name"], path=cfg["path"], rules=cfg["rules"], T=t, H=h,
                          V=args.V, V_local=args.V, dtype=dname, TP=1, device=device.type,
                          logits_bytes=t * args.V * dtype.itemsize, **res)
            record["model_s"] = round(cost_model(
                "logits" if cfg["path"] == "logits" else "fused", t, h, args.V, dtype.itemsize,
                **res, dw_block=fo.DW_BLOCK_ROWS if cfg["rules"] == "v1"
                else fo.DW_BLOCK_ROWS_CUDA)["s"], 6)
            if not cuda:
                record.update(load_avg_1m=round(os.getloadavg()[0], 2),
                              cpu=torch.backends.cpu.get_cpu_capability())
            need = need_bytes("logits" if cfg["path"] == "logits" else "fused_forward", t, h,
                              args.V, dtype.itemsize) + (t + args.V) * h * dtype.itemsize
            if need > budget:
                emit(dict(record, skipped=f"needs ~{need / 2**30:.1f} GiB > the budget "
                          f"{budget / 2**30:.1f} GiB"), args.out)
                continue
            if inp is None:
                inp = make_inputs(t, h, args.V, 1, 0, dtype, device, on_device=cuda)
            hh = inp["hidden"].clone().requires_grad_()
            ww = inp["weight"].clone().requires_grad_()
            run = VocabPass()._replace(**cfg["run"])

            def step(path=cfg["path"], hh=hh, ww=ww, inp=inp, run=run):
                return torch.autograd.grad(loss_of(path, hh, ww, inp, None, run)[0], [hh, ww])

            try:
                with cuda_rules(cfg["rules"]):
                    # first call: also the warm-up (CPU: the RSS mark, O(1), smoke runs only)
                    peak = peak_extra_bytes(step, device, "allocator" if cuda else "rss")
                    record.update(_timed(step, device, args.iters, args.sweep_max_s))
            except (RuntimeError, MemoryError) as e:
                emit(dict(record, skipped=f"failed: {type(e).__name__}: "
                                          f"{str(e).splitlines()[0][:200]}"), args.out)
                continue
            out_bytes = (hh.numel() + ww.numel()) * hh.element_size()
            record.update(peak_extra_bytes=peak, peak_pct_of_logits=round(
                100 * max(0, peak - out_bytes) / record["logits_bytes"], 2))
            with cuda_rules(cfg["rules"]):
                grads = [g.float() for g in step()]
            ref = grads if ref is None else ref  # the first row: the logits path
            record["grad_max_rel_diff"] = max(float((g - r).abs().max() / r.abs().max())
                                              for g, r in zip(grads, ref))
            emit(record, args.out)
        del inp, ref
        if cuda:
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--H", default="1024", help="hidden size (--sweep: a comma list)")
    ap.add_argument("--V", type=int, default=151936, help="full vocab (V/tp per rank)")
    ap.add_argument("--T", default="1024,2048,4096,8192,16384,32768", help="tokens, comma list")
    ap.add_argument("--tp", default="1,2", help="comma-separated TP sizes")
    ap.add_argument("--dtypes", default="fp32", help="fp32 and/or bf16 (bf16 where it is fast)")
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--iters", type=int, default=None, help="timed iterations (5 GPU, 1 CPU)")
    ap.add_argument("--mem-gib", type=float, default=None, help="memory budget per rank")
    ap.add_argument("--peak-method", default="auto", choices=("auto", "allocator", "rss"),
                    help="CPU peak memory: torch's allocations (profiler) or the RSS high-water "
                         "mark; auto: rss above PROFILE_MAX_LOGITS logits per rank")
    ap.add_argument("--out", default=None, help="append the JSON lines to this file too")
    ap.add_argument("--check", action="store_true", help="float64 check first (exit 1 on error)")
    ap.add_argument("--fit-gib", type=float, default=None,
                    help="only the largest GRPO micro-batch (tokens) whose update pass fits this "
                         "budget with and without the fused layer (SmolLM2-135M shapes), see "
                         "fit_rows")
    ap.add_argument("--fit-completion", type=int, default=448,
                    help="completion tokens per sequence of the --fit-gib rows")
    ap.add_argument("--fit-layers", type=int, default=30,
                    help="decoder layers of the --fit-gib model (30: SmolLM2-135M's)")
    ap.add_argument("--fit-verify", action="store_true",
                    help="--fit-gib: also run the fitted size and print its measured peak")
    ap.add_argument("--sweep", action="store_true",
                    help="time the fused paths over a grid of chunk shapes (sweep_configs) at "
                         "every --H x --T, one rank, the first of --dtypes")
    ap.add_argument("--sweep-max-s", type=float, default=2.0,
                    help="--sweep: stop timing a row after this many seconds of calls")
    ap.add_argument("--gpu-table", default=None, metavar="JSONL",
                    help="only print docs/performance.md's H200 table (measured vs the model of "
                         "_fused_output_model) from these gpu_check lines and the probe's")
    ap.add_argument("--table", default=None, metavar="JSONL",
                    help="only print docs/performance.md's table from these result lines")
    args = ap.parse_args(argv)
    if print_table(args, gpu_table=h200_table):
        return
    if args.table:
        print(table(args.table))
        fit = os.path.join(os.path.dirname(args.table), "fused_output_fit_cpu.jsonl")
        if os.path.exists(fit):
            print("\n" + fit_table(fit))
        return
    if args.fit_gib is not None:
        fit_rows(args)
        return
    args.iters = args.iters or (5 if args.device == "cuda" else 1)
    if args.sweep:
        sweep(args)
        return
    args.H = int(args.H)
    if args.check and not check(torch.device(args.device)):
        sys.exit(1)
    for tp in (int(s) for s in args.tp.split(",")):
        if tp == 1:
            bench(0, 1, args, None)
        else:
            rdzv = os.path.join(tempfile.mkdtemp(), "rdzv")
            mp.spawn(spawned_bench, args=(tp, args, rdzv), nprocs=tp)


if __name__ == "__main__":
    main()
