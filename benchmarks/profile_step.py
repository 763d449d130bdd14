"""Per-phase profile of megagrpo's update and scoring on a named workload (one rank).

    .venv/bin/python benchmarks/profile_step.py [--workload demo|varlen|smollm2]
        [--dtype float32|bfloat16] [--warmup 1] [--steps 2] [--threads N] [--set KEY=VALUE ...]
        [--out benchmarks/results/profile_<workload>_<dtype>.json]

After `--warmup` unprofiled steps, torch.profiler records `--steps` trainer steps at one rank
(torchrun, DP=1, the in-process vLLM engine as in grpo_step.py). Ranges are marked with
record_function by wrapping what the trainer calls:
  forward      tr.passes.forward (the model's forward of each micro-batch)
  backward     megatron's schedules.backward_step
  attention    every `*.core_attention` module's forward (megatron's DotProductAttention or the
               SDPA module put in that slot); its backward is the autograd nodes whose forward
               op ran inside it (matched by autograd sequence number)
  output+loss  the `output_layer` module and the trainer's loss functions (the vocab pass:
               fused log-prob / GRPO loss kernels), forward and backward as above
  optimizer    megagrpo.train.trainer.optimizer_step
  other        the rest of the phase (micro-batch slicing, zero_grad, metrics, reductions)
forward and backward are reported without their attention and output+loss parts.

The same phases split by what the CPU ran (`kernels`): the self time of torch's GEMM kernels
(aten::mm, addmm, bmm, ...; their FLOPs from the profiler's `with_flops`, so `gemm_rate_frac` is
the rate the GEMMs reached at these shapes over torch.mm's 2048^3 rate), of the SDPA attention
kernels, of copies (copy_, cat, clone, index, fill), of every other aten op (element-wise: norm,
activation, RoPE, softmax, adds, the loss), and the rest of the phase: Python, megatron-core's
module code, autograd's bookkeeping and op dispatch (`overhead`). `top_gemms` lists the shapes
that took the most GEMM time, with their rate, `top_other` the other ops (with their input
shapes; a list input such as cat's records none) that took longest. `shim`: the CPU shim's
calls a step (counted over one extra unprofiled step) and the cost of one call.

Per phase (update, score): seconds per step and share of the phase, the padded-token share (as
grpo_step.py) and the achieved useful FLOP/s (`_workloads.forward_flops`) against torch.mm's
measured rate at the same threads and dtype. The profiler's own overhead inflates the seconds a
little (most on the smallest models); the shares are what to read. Prints a table, then one
JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _workloads as W  # noqa: E402
from _common import parser  # noqa: E402
import grpo_step  # noqa: E402

from megagrpo.runtime.machine import cpu_name  # noqa: E402

LABELS = ("forward", "backward", "attention", "output_loss", "optimizer")
ROWS = ("forward", "backward", "attention", "output_loss", "optimizer", "other")
BWD_PREFIX = "autograd::engine::evaluate_function: "


def _labeled(label: str, fn, *args, **kwargs):
    with torch.profiler.record_function(f"mg::{label}"):
        return fn(*args, **kwargs)


def install_labels(tr) -> None:
    """record_function ranges around what the trainer calls (see the module docstring)."""
    import megagrpo.train.passes as passes_mod
    import megagrpo.train.trainer as trainer_mod
    from megatron.core.pipeline_parallel import schedules

    tr.passes.forward = partial(_labeled, "forward", tr.passes.forward)
    schedules.backward_step = partial(_labeled, "backward", schedules.backward_step)
    trainer_mod.optimizer_step = partial(_labeled, "optimizer", trainer_mod.optimizer_step)
    # the loss functions, looked up at call time in the modules that call them
    for mod, name in ((trainer_mod, "grpo_loss"), (passes_mod, "logprob_loss")):
        setattr(mod, name, partial(_labeled, "output_loss", getattr(mod, name)))
    models = [tr.policy] + ([tr.reference.model] if tr.reference is not None else [])
    chunks = [c for m in models for c in (m if isinstance(m, list) else [m])]
    for chunk in chunks:
        for name, m in chunk.named_modules():
            if name.endswith("core_attention"):
                m.forward = partial(_labeled, "attention", m.forward)
            elif name.endswith("output_layer"):
                m.forward = partial(_labeled, "output_loss", m.forward)
    tr.update = partial(_labeled, "phase_update", tr.update)
    tr.score = partial(_labeled, "phase_score", tr.score)


def _inside(ev, ranges: list[tuple[float, float]]) -> bool:
    t = ev.time_range.start
    return any(a <= t < b for a, b in ranges)


def label_ranges(events) -> dict[str, list[tuple[float, float]]]:
    """The time ranges of each `mg::<label>` record_function range, by label."""
    ranges: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for ev in events:
        if ev.name.startswith("mg::"):
            ranges[ev.name[4:]].append((ev.time_range.start, ev.time_range.end))
    return ranges


def attribute(events) -> dict[str, dict[str, float]]:
    """Seconds per phase ('update', 'score') and row (ROWS) from the profiler's events."""
    ranges = label_ranges(events)
    # forward ops run inside an attention / output_loss range: their autograd nodes' backward
    seq_label = {}
    for ev in events:
        if ev.sequence_nr >= 0 and not ev.name.startswith(BWD_PREFIX):
            for label in ("attention", "output_loss"):
                if _inside(ev, ranges[label]):
                    seq_label.setdefault(ev.sequence_nr, label)
    out = {}
    for phase in ("update", "score"):
        span = ranges[f"phase_{phase}"]
        sec = {r: 0.0 for r in ROWS}
        fwd_parts = {"attention": 0.0, "output_loss": 0.0}
        for ev in events:
            if not ev.name.startswith("mg::") or not _inside(ev, span):
                continue
            label = ev.name[4:]
            if label in LABELS:
                sec[label] += ev.time_range.elapsed_us() / 1e6
                if label in fwd_parts and _inside(ev, ranges["forward"]):
                    fwd_parts[label] += ev.time_range.elapsed_us() / 1e6
        bwd_parts = {"attention": 0.0, "output_loss": 0.0}
        for ev in events:
            if ev.name.startswith(BWD_PREFIX) and ev.sequence_nr in seq_label and _inside(
                    ev, span):
                bwd_parts[seq_label[ev.sequence_nr]] += ev.time_range.elapsed_us() / 1e6
        for label in ("attention", "output_loss"):
            sec[label] += bwd_parts[label]
        sec["forward"] -= fwd_parts["attention"] + fwd_parts["output_loss"]
        sec["backward"] -= bwd_parts["attention"] + bwd_parts["output_loss"]
        total = sum(b - a for a, b in span) / 1e6
        sec["other"] = total - sum(sec[r] for r in ROWS if r != "other")
        out[phase] = dict(sec, total=total)
    return out


GEMM_OPS = frozenset(("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addmv",
                      "aten::mv", "aten::_addmm_activation"))
COPY_OPS = frozenset(("aten::copy_", "aten::cat", "aten::clone", "aten::index",
                      "aten::index_select", "aten::index_put_", "aten::fill_", "aten::zero_",
                      "aten::contiguous", "aten::_to_copy", "aten::stack"))
KERNEL_ROWS = ("gemm", "attention", "copy", "elementwise", "overhead")


def kernel_row(name: str) -> str:
    """The `kernels` row of one aten op's self time."""
    if name in GEMM_OPS:
        return "gemm"
    if "scaled_dot_product" in name or "flash_attention" in name:
        return "attention"
    return "copy" if name in COPY_OPS else "elementwise"


def kernel_breakdown(events, total_s: float, span: list[tuple[float, float]],
                     rate_gflops: float, steps: int = 1, top: int = 6) -> dict:
    """Seconds per step of one phase by what ran (KERNEL_ROWS), the GEMMs' achieved rate and
    the shapes that took longest (see the module docstring). `total_s`: the phase's seconds
    over all `steps` profiled steps."""
    sec = {r: 0.0 for r in KERNEL_ROWS}
    gemm_flops = 0.0
    shapes: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    ops: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in events:
        if not ev.name.startswith("aten::") or not _inside(ev, span):
            continue
        row = kernel_row(ev.name)
        t = ev.self_cpu_time_total / 1e6
        sec[row] += t
        if row != "gemm":
            key = f"{ev.name[6:]} {[list(x) for x in ev.input_shapes if x]}"
            ops[key][0] += t
            ops[key][1] += 1
        else:
            gemm_flops += ev.flops or 0
            key = (ev.name, tuple(tuple(x) for x in ev.input_shapes if x))
            shapes[key][0] += t
            shapes[key][1] += ev.flops or 0
            shapes[key][2] += 1
    sec["overhead"] = total_s - sum(sec[r] for r in KERNEL_ROWS if r != "overhead")
    ranked = sorted(shapes.items(), key=lambda kv: -kv[1][0])[:top]
    other = sorted(ops.items(), key=lambda kv: -kv[1][0])[:2 * top]
    return dict(
        seconds={k: round(v / steps, 4) for k, v in sec.items()},
        share={k: round(v / total_s, 4) if total_s else None for k, v in sec.items()},
        gemm_gflops=round(gemm_flops / sec["gemm"] / 1e9, 1) if sec["gemm"] else None,
        gemm_rate_frac=round(gemm_flops / sec["gemm"] / 1e9 / rate_gflops, 4)
        if sec["gemm"] else None,
        top_gemms=[dict(op=k[0], shapes=[list(x) for x in k[1]], calls=v[2] // steps,
                        seconds=round(v[0] / steps, 4),
                        gflops=round(v[1] / v[0] / 1e9, 1) if v[0] else None)
                   for k, v in ranked],
        top_other=[dict(op=k, calls=v[1] // steps, seconds=round(v[0] / steps, 4))
                   for k, v in other])


def shim_cost(tr, steps: int = 1, reps: int = 20000) -> dict:
    """The CPU shim's cost (`megagrpo.runtime.cpu_compat`, the torch function mode megatron-core
    needs without CUDA): its calls per trainer step (counted over `steps` unprofiled steps) and the
    microseconds one call adds (a small op timed with the mode on and with torch functions
    disabled, best of 5 x `reps`). {} when the shim is not on (a CUDA machine)."""
    import megagrpo.runtime.cpu_compat as cc

    if not cc.active():
        return {}
    cls, calls = cc._CudaToCpu, [0]
    orig = cls.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        calls[0] += 1
        return orig(self, func, types, args, kwargs)

    cls.__torch_function__ = counting
    try:
        for _ in range(steps):
            tr.step()
    finally:
        cls.__torch_function__ = orig
    x = torch.ones(8)

    def best(disabled: bool) -> float:
        out = []
        for _ in range(5):
            t = time.perf_counter()
            if disabled:
                with torch._C.DisableTorchFunction():
                    for _ in range(reps):
                        torch.add(x, x)
            else:
                with cc.megatron_scope():  # the mode is on only inside megatron-core calls
                    for _ in range(reps):
                        torch.add(x, x)
            out.append((time.perf_counter() - t) / reps)
        return min(out)

    per_call = max(best(False) - best(True), 0.0)
    return dict(calls_per_step=calls[0] // steps, us_per_call=round(per_call * 1e6, 2),
                seconds_per_step=round(calls[0] // steps * per_call, 4))


def worker(recipe: str, sets: list[str], warmup: int, steps: int, out_dir: str) -> None:
    """One rank: warm-up steps, then `steps` profiled steps; prints `RESULT {json}`."""
    from torch.profiler import ProfilerActivity, profile

    from megagrpo.config.train import load_config
    from megagrpo.run import setup

    cfg = load_config(recipe, [*sets, f"run.out_dir={out_dir}", "run.overwrite=true"])
    tr = setup(cfg)
    tr.sync_weights()
    counter = grpo_step.StepCounter(tr.model_cfg, tr.tokens.pad_id, count_lengths=True)
    counter.install(tr)
    install_labels(tr)
    # torch.mm's rate before and after the steps, the best kept (a busy moment lowers one)
    before = W.gemm_gflops(cfg.model.dtype, torch.get_num_threads())
    for _ in range(warmup):
        tr.step()
    shim = shim_cost(tr)
    totals = defaultdict(float)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                 with_flops=True) as prof:
        for _ in range(steps):
            counter.reset()
            tr.step()
            for phase in ("update", "score"):
                for k, v in zip(grpo_step.COUNTS, counter.step_counts(phase).tolist()):
                    totals[f"{k}_{phase}"] += v
    events = prof.events()
    secs = attribute(events)
    rate, n = max(before, W.gemm_gflops(cfg.model.dtype, torch.get_num_threads()))
    spans = label_ranges(events)
    rec = dict(system="megagrpo", nproc=1, warmup=warmup, steps=steps,
               threads=torch.get_num_threads(), gemm_gflops=round(rate, 1), gemm_n=n)
    for phase, sec in secs.items():
        per_step = {k: v / steps for k, v in sec.items()}
        flops, proc = totals[f"flops_{phase}"] / steps, totals[f"processed_{phase}"]
        rec[phase] = dict(
            seconds={k: round(v, 4) for k, v in per_step.items()},
            share={k: round(v / per_step["total"], 4) if per_step["total"] else None
                   for k, v in per_step.items() if k != "total"},
            padded_token_share=round(1 - totals[f"real_{phase}"] / proc, 4) if proc else None,
            achieved_gflops=round(flops / per_step["total"] / 1e9, 2) if per_step["total"]
            else None,
            mfu=round(flops / per_step["total"] / 1e9 / rate, 4) if per_step["total"] else None,
            kernels=kernel_breakdown(events, sec["total"], spans[f"phase_{phase}"], rate,
                                     steps))
    rec.update(shim=shim, loadavg_1m=round(os.getloadavg()[0], 2), cpu=cpu_name())
    print("RESULT " + json.dumps(rec), flush=True)
    os._exit(0)  # skip vLLM's shutdown hooks


def table(rec: dict) -> str:
    """The readable per-phase table."""
    lines = [f"{rec['workload']} {rec['dtype']}: {rec['steps']} profiled step(s), "
             f"{rec['threads']} thread(s), torch.mm {rec['gemm_gflops']} GFLOP/s "
             f"(n={rec['gemm_n']})",
             f"{'':14}" + "".join(f"{p:>22}" for p in ("update", "score"))]
    for row in (*ROWS, "total"):
        cells = []
        for p in ("update", "score"):
            s, sh = rec[p]["seconds"][row], rec[p]["share"].get(row)
            cells.append(f"{s:>10.3f} s" + (f" {100 * sh:>6.1f}%" if sh is not None else " " * 8))
        lines.append(f"{row:14}" + "".join(f"{c:>22}" for c in cells))
    for key, fmt in (("padded_token_share", "{:.1%}"), ("achieved_gflops", "{} GFLOP/s"),
                     ("mfu", "{:.1%}")):
        vals = [rec[p][key] for p in ("update", "score")]
        lines.append(f"{key:14}" + "".join(
            f"{(fmt.format(v) if v is not None else '-'):>22}" for v in vals))
    lines.append("by kernel")
    for row in KERNEL_ROWS:
        cells = []
        for p in ("update", "score"):
            k = rec[p].get("kernels", {})
            s, sh = k.get("seconds", {}).get(row, 0.0), k.get("share", {}).get(row)
            cells.append(f"{s:>10.3f} s" + (f" {100 * sh:>6.1f}%" if sh is not None else " " * 8))
        lines.append(f"{row:14}" + "".join(f"{c:>22}" for c in cells))
    vals = [rec[p].get("kernels", {}).get("gemm_rate_frac") for p in ("update", "score")]
    lines.append(f"{'gemm rate':14}" + "".join(
        f"{(f'{v:.1%} of mm' if v is not None else '-'):>22}" for v in vals))
    for p in ("update", "score"):
        for g in rec[p].get("kernels", {}).get("top_gemms", []):
            lines.append(f"  {p:6} {g['op']:12} {str(g['shapes']):44} x{g['calls']:<5} "
                         f"{g['seconds']:.3f} s {g['gflops']} GFLOP/s")
        lines.append("  " + p + " other ops: " + ", ".join(
            f"{g['op']} {g['seconds']:.3f} s x{g['calls']}"
            for g in rec[p].get("kernels", {}).get("top_other", [])))
    if rec.get("shim"):
        sh = rec["shim"]
        lines.append(f"CPU shim (megagrpo.runtime.cpu_compat): {sh['calls_per_step']} calls a "
                     f"step x {sh['us_per_call']} us = {sh['seconds_per_step']:.3f} s a step")
    return "\n".join(lines)


def _compiled_label(rec: dict) -> str:
    """', layers compiled' / ', eager' where the profile set compute.compile_layers."""
    for kv in rec.get("overrides", []):
        if kv.startswith("compute.compile_layers="):
            return ", layers compiled" if kv.endswith("=true") else ", eager"
    return ""


def markdown(recs: list[dict]) -> str:
    """The docs table of saved profiles (`--table FILE ...`): per workload and phase the
    share of each kernel row, the GEMMs' rate, the floor fraction under the profiler, and
    the GEMM bound (the floor fraction if everything but the GEMMs took no time: mfu over the
    GEMM share)."""
    head = ("| workload | phase | seconds | GEMM | GEMM rate (of torch.mm) | attention | copy | "
            "element-wise | overhead | floor fraction | GEMM bound |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for rec in recs:
        for phase in ("score", "update"):
            k, ph = rec[phase]["kernels"], rec[phase]
            if not ph["seconds"]["total"] or k["gemm_rate_frac"] is None:
                continue  # no such pass (smollm2 at beta 0 scores nothing)
            sh = k["share"]
            bound = ph["mfu"] / sh["gemm"] if sh["gemm"] else None
            cells = [f"{rec['workload']} {rec['dtype']}{_compiled_label(rec)}", phase,
                     f"{ph['seconds']['total']:.3f}", f"{100 * sh['gemm']:.0f}%",
                     f"{100 * k['gemm_rate_frac']:.0f}%",
                     *(f"{100 * sh[r]:.0f}%" for r in KERNEL_ROWS[1:]),
                     f"{100 * ph['mfu']:.0f}%", f"{100 * bound:.0f}%" if bound else "-"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = parser(__doc__)
    W.add_step_args(ap, warmup=1, steps=2)
    ap.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS (default: all cores)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default="", help="write the JSON line to this file")
    ap.add_argument("--table", nargs="+", metavar="FILE",
                    help="print the markdown table of saved profiles and exit")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--recipe", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.table:
        print(markdown([json.loads(Path(f).read_text()) for f in args.table]))
        return
    if args.worker:
        worker(args.recipe, args.set, args.warmup, args.steps, args.out_dir)
        return
    w, dtype = W.get_workload(args.workload), W.check_dtype(args.dtype)
    if why := W.missing_model(w):
        print(why, file=sys.stderr)
        print(json.dumps(dict(workload=w.name, dtype=dtype, skipped=why)))
        return
    t0 = time.perf_counter()
    rec = grpo_step.launch(1, str(W.ROOT / w.recipe), W.overrides(w, dtype, args.set),
                           args.warmup, args.steps, args.threads, script=__file__)
    rec = dict(workload=w.name, dtype=dtype, overrides=list(args.set), **rec,
               wall_s=round(time.perf_counter() - t0, 1))
    print(table(rec), flush=True)
    line = json.dumps(rec)
    print(line, flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(line + "\n")


if __name__ == "__main__":
    main()
