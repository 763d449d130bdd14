"""Peak memory of one update pass (forward + backward) with compute.recompute none / selective /
full, at context parallelism 1 or 2 (TP=1), CPU.

    .venv/bin/python benchmarks/recompute_memory.py [--seq 1024[,2048...]] [--batch 2]
        [--attention sdpa,megatron] [--recompute none,selective,full] [--cp 1[,2]]
        [--model small|midsize] [--threads 2] [--max-gib 12]
        [--out benchmarks/results/recompute_cpu.jsonl]
    .venv/bin/python benchmarks/recompute_memory.py \
        --table benchmarks/results/recompute_cp_cpu.jsonl

Each (cp, seq, attention, recompute) setting runs in fresh child processes (the peak RSS is a
process's high-water mark), one per CP rank (CP=2: two processes over gloo, threads / cp torch
threads each): build the model (`--model small`: hidden 384, 6 layers, 6 heads x 64, 2 KV
groups, FFN 1024, vocab 1024; `midsize`: benchmarks/_workloads.py's midsize Llama, hidden 512,
4 layers, 8 heads x 64, 4 KV groups, FFN 1536, vocab 19 padded to 128; random init, fp32),
then one forward + backward of a per-token CE loss on [b, S] random tokens in training mode
(under CP each rank runs its 2 load-balanced chunks of the row, RoPE at their global positions,
megagrpo's CP attention: `megagrpo/parallel/context_parallel.py`). One JSON line per setting, each
memory figure the maximum over the CP ranks:
  step_peak_mib   peak RSS during the step minus the RSS just before it (what the step's
                  activations and gradients add)
  peak_rss_mib    the process's peak RSS
  step_s          wall time of the step
  layer_forwards  forward calls of layer 0 in the step (2 under full: recomputed)
  saved_mib       bytes autograd saved for backward in the transformer layers' forward
                  (distinct storages, parameters and their views left out; rows before
                  recompute_cp_cpu.jsonl left out only Parameter objects, so they count a
                  transposed weight a matmul saves): the activations the planner
                  estimates, without the backward's own working set and the allocator's cached
                  blocks that the RSS peak also holds (under full recomputation: the kept layer
                  inputs only, the recomputed chunk exists in backward)
  planner_mib     `megagrpo plan`'s figure for the same step: its activation estimate
                  (`megagrpo.plan.activation_bytes`, recompute and attention as run) + the
                  fp32 gradients of every parameter + the logits path (megatron's output layer
                  and cross-entropy: `logits_bytes` with the fused output layer off)
  planner_error   (planner_mib - step_peak_mib) / step_peak_mib
  planner_act_mib the planner's activation estimate alone; planner_act_error its error
                  against saved_mib
  rank_step_peak_mib  step_peak_mib of each CP rank
  loadavg_1m, cpu  the machine's 1-minute load average before the setting, and its CPU
A setting whose peak, extrapolated linearly in S from the same setting's smaller measured sizes
(before any: 3 x the planner's figure), would pass --max-gib per process is not run; its row
says `skipped` and why. `--table` prints the markdown table of a results file: the measured
rows with the planner's figures at the current megagrpo/plan/memory.py, and per setting the linear
fit peak = a + c x S (least squares over the measured sizes) and the longest S whose fitted
peak fits 20 GiB (step peak + the process's RSS before the step; at cp > 1 the CP attention's
causal masks, quadratic in S, are added at their exact size (`mask_mib`) rather than fitted).
Selective recomputes megatron's core attention only, which holds the [b, heads, S, S] scores with
megatron's DotProductAttention and nothing that large with torch's SDPA (megagrpo's default).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from contextlib import nullcontext
from functools import partial

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _common import print_table  # noqa: E402  (benchmarks/ is on sys.path: run as a script)

MODELS = {
    "small": dict(vocab_size=1024, hidden_size=384, ffn_hidden_size=1024, num_layers=6,
                  num_attention_heads=6, num_query_groups=2, head_dim=64),
    # benchmarks/_workloads.py's midsize (the arithmetic tokenizer's vocab, 19)
    "midsize": dict(vocab_size=19, hidden_size=512, ffn_hidden_size=1536, num_layers=4,
                    num_attention_heads=8, num_query_groups=4, head_dim=64),
}
FIT_GIB = 20  # the longest sequence whose fitted peak fits this (the budget)
CP_ATTN = "blocks"
"""The CP attention a cp > 1 row ran (its `cp_attn`): "blocks", the unmasked and causal blocks
merged by log-sum-exp (`megagrpo.parallel.context_parallel.causal_chunk_attention`); "mask", the
bool mask [S/cp, S] given to SDPA before it (rows measured before the change)."""


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(recompute: str, attention: str, seq: int, batch: int, threads: int, model: str,
          cp: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from megagrpo.config.model import ModelConfig, ParallelConfig
    from megagrpo.parallel.context_parallel import chunk_columns, padded_width
    from megagrpo.runtime.distributed import init_distributed
    from megagrpo.model.gpt import build_model
    from megagrpo.parallel.positions import RotaryPositions

    shape = MODELS[model]
    mcfg = ModelConfig(**shape, max_position_embeddings=seq)
    par = ParallelConfig(attention_impl=attention, make_vocab_size_divisible_by=128, cp=cp)
    info = init_distributed(par, mcfg)
    gpt = build_model(mcfg, par, seed=0, recompute=(recompute, 1)).train()
    calls = [0]
    gpt.decoder.layers[0].register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape["vocab_size"], (batch, seq), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    # this CP rank's 2 load-balanced chunks of every row (all columns at cp = 1)
    cols = chunk_columns(padded_width(seq, cp), cp, info.cp_rank) if cp > 1 else torch.arange(seq)
    ids, labels = ids[:, cols], labels[:, cols]
    pos = cols.expand_as(ids)
    rope = RotaryPositions.of(gpt).at(cols) if cp > 1 else nullcontext()
    saved: dict[int, int] = {}
    before = rss_mib()
    t0 = time.perf_counter()
    weights = {w.untyped_storage().data_ptr() for w in gpt.parameters()}
    hooks = torch.autograd.graph.saved_tensors_hooks(partial(_note_saved, saved, weights),
                                                     lambda t: t)
    gpt.decoder.register_forward_pre_hook(lambda *_: hooks.__enter__())
    gpt.decoder.register_forward_hook(lambda *_: hooks.__exit__(None, None, None))
    with rope:
        gpt(ids, pos, None, labels=labels).float().mean().backward()
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB
    return {"model": model, "cp": cp, "recompute": recompute, "attention": attention,
            "seq": seq, "batch": batch, "threads": threads,
            "rss_before_mib": round(before, 1),
            "step_peak_mib": round(peak - before, 1), "peak_rss_mib": round(peak, 1),
            "step_s": round(wall, 2), "layer_forwards": calls[0],
            "saved_mib": round(sum(saved.values()) / 2**20, 1),
            **({"cp_attn": CP_ATTN} if cp > 1 else {})}


def _note_saved(saved: dict, weights: set, t):
    """saved_tensors_hooks pack: records each saved storage once (views of one tensor share
    it), leaving out the parameters' storages (a matmul saves its weight as a transposed view,
    not a Parameter); returns the tensor itself (nothing is copied)."""
    import torch

    if isinstance(t, torch.Tensor):
        st = t.untyped_storage()
        if st.data_ptr() not in weights:
            saved.setdefault(st.data_ptr(), st.nbytes())
    return t


def planner_mib(recompute: str, attention: str, seq: int, batch: int, model: str = "small",
                cp: int = 1) -> tuple[float, float]:
    """The planner's estimate of the step's peak on one rank and its activation term (see the
    module docstring), MiB."""
    from megagrpo.config.train import load_config
    from megagrpo.plan import activation_bytes, logits_bytes, total_params

    cfg = load_config(None, [f"model.{k}={v}" for k, v in MODELS[model].items()] + [
        "model.dtype=float32", f"model.max_position_embeddings={seq}",
        f"rollout.max_model_len={seq}", f"compute.micro_batch_size={batch}",
        f"compute.recompute={recompute}", f"parallel.attention_impl={attention}",
        "parallel.transformer_impl=local", "parallel.make_vocab_size_divisible_by=128",
        f"parallel.cp={cp}", "compute.fused_output_layer=false",
        "compute.inplace_backward=false"])
    m = cfg.model
    act = activation_bytes(cfg, m, 1, 1)
    total = act + logits_bytes(cfg, m, 1, cfg.parallel)[0] + 4 * total_params(m)
    return total / 2**20, act / 2**20


def loadavg() -> float:
    return os.getloadavg()[0]


def run_setting(args, model: str, cp: int, seq: int, attention: str, recompute: str) -> dict:
    """One setting in cp fresh child processes (CP ranks over gloo); the ranks' maxima."""
    from megagrpo.cli import free_port

    threads = max(1, args.threads // cp)
    port = str(free_port())
    procs = []
    for rank in range(cp):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank),
                   WORLD_SIZE=str(cp), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(cp),
                   OMP_NUM_THREADS=str(threads))
        procs.append(subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child", f"{recompute}:{attention}",
             "--seq", str(seq), "--batch", str(args.batch), "--threads", str(threads),
             "--model", model, "--cp", str(cp)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    recs = []
    for p in procs:
        out, err = p.communicate()
        if p.returncode:
            raise RuntimeError(f"child failed (rc={p.returncode}):\n{err[-3000:]}")
        recs.append(json.loads(out.strip().splitlines()[-1]))
    rec = dict(recs[0])
    for key in ("rss_before_mib", "step_peak_mib", "peak_rss_mib", "step_s", "saved_mib"):
        rec[key] = max(r[key] for r in recs)
    rec["rank_step_peak_mib"] = [r["step_peak_mib"] for r in recs]
    est, act = planner_mib(recompute, attention, seq, args.batch, model, cp)
    rec.update(planner_mib=round(est, 1),
               planner_error=round((est - rec["step_peak_mib"]) / rec["step_peak_mib"], 3),
               planner_act_mib=round(act, 1),
               planner_act_error=round((act - rec["saved_mib"]) / rec["saved_mib"], 3))
    return rec


def predicted_mib(done: list[dict], seq: int, planner: float) -> float:
    """The step peak at `seq` extrapolated linearly in S from the same setting's measured
    rows (through the origin from the largest), or 3 x the planner's figure before any."""
    if not done:
        return 3 * planner
    last = max(done, key=lambda r: r["seq"])
    return last["rss_before_mib"] + last["step_peak_mib"] * seq / last["seq"]


def mask_mib(row: dict, seq: int) -> float:
    """The causal masks the CP attention of a `cp_attn` "mask" row kept for backward: per layer
    one [S/cp, S] mask, which SDPA converts from bool to the fp32 model's dtype and saves;
    under selective or full recomputation the recomputed layer's only. Quadratic in S, so the
    fit takes it as known rather than fitted. 0 at cp = 1 (is_causal needs none) and for the
    "blocks" attention (no mask)."""
    if row["cp"] == 1 or row.get("cp_attn") != "mask":
        return 0.0
    layers = MODELS[row["model"]]["num_layers"] if row["recompute"] == "none" else 1
    return layers * (seq // row["cp"]) * seq * 4 / 2**20


def fit(rows: list[dict]) -> tuple[float, float, int]:
    """(a MiB, c MiB per token, longest S) of the least-squares line
    process peak - masks = a + c x S over a setting's measured rows (process peak = RSS before
    the step + the step's peak; masks: `mask_mib`), and the longest S (multiple of 2 x cp)
    whose fitted peak a + c x S + masks stays under FIT_GIB."""
    xs = [r["seq"] for r in rows]
    ys = [r["rss_before_mib"] + r["step_peak_mib"] - mask_mib(r, r["seq"]) for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    c = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - c * mx
    q = 2 * rows[0]["cp"]
    lo, hi = 0, q
    while a + c * hi + mask_mib(rows[0], hi) <= FIT_GIB * 1024:
        lo, hi = hi, 2 * hi
    while hi - lo > q:
        mid = (lo + hi) // 2 // q * q
        lo, hi = (mid, hi) if a + c * mid + mask_mib(rows[0], mid) <= FIT_GIB * 1024 else (lo, mid)
    return a, c, lo


def table(path: str) -> str:
    """Markdown for docs: the measured rows with the planner's figures, then per setting the
    fit and the longest sequence fitting FIT_GIB."""
    rows = [json.loads(ln) for ln in open(path) if ln.strip()]
    done = [r for r in rows if "skipped" not in r]
    pct = lambda e: f"{e * 100:+.0f}%"  # noqa: E731
    out = ["| CP | CP attention | recompute | S | step peak (RSS, max over ranks) MiB | "
           "planner MiB | error | saved activations MiB | planner activations MiB | error | "
           "step s | load |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in done:  # the planner's figures at the current megagrpo/plan/memory.py
        if r.get("cp_attn") != "mask":
            est, act = planner_mib(r["recompute"], r["attention"], r["seq"], r["batch"],
                                   r["model"], r["cp"])
            planner = (f"{est:.1f} | {pct((est - r['step_peak_mib']) / r['step_peak_mib'])} | "
                       f"{r['saved_mib']} | {act:.1f} | "
                       f"{pct((act - r['saved_mib']) / r['saved_mib'])}")
        else:
            planner = f"n/a | | {r['saved_mib']} | n/a |"
        out.append(f"| {r['cp']} | {_attn(r)} | {r['recompute']} | {r['seq']} | "
                   f"{r['step_peak_mib']} | {planner} | {r['step_s']} | "
                   f"{r['loadavg_1m']:.1f} |")
    for r in rows:
        if "skipped" in r:
            out.append(f"| {r['cp']} | {_attn(r)} | {r['recompute']} | {r['seq']} | skipped: "
                       f"{r['skipped']} | | | | | | | |")
    out += ["", f"| CP | CP attention | recompute | fit: process peak MiB = a + c x S (+ masks) "
            f"| longest S in {FIT_GIB} GiB (fit) | planner's longest S (its step figure + RSS "
            "before the step) |", "|---|---|---|---|---|---|"]
    order = ["none", "selective", "full"]
    settings = sorted({(r["cp"], _attn(r), r["recompute"]) for r in done},
                      key=lambda k: (k[0], k[1], order.index(k[2])))
    for cp, attn, rc in settings:
        mine = sorted((r for r in done if (r["cp"], _attn(r), r["recompute"]) == (cp, attn, rc)),
                      key=lambda r: r["seq"])
        if len(mine) < 2:
            continue
        a, c, longest = fit(mine)
        base = max(r["rss_before_mib"] for r in mine)  # what the planner's step figure omits
        planner = ("n/a" if attn == "mask" else
                   planner_longest(mine[0], FIT_GIB * 1024 - base))
        out.append(f"| {cp} | {attn} | {rc} | {a:.0f} + {c * 1024:.1f} x S/1024 | {longest} | "
                   f"{planner} |")
    return "\n".join(out)


def _attn(row: dict) -> str:
    """A row's CP attention (`CP_ATTN`), '-' at cp = 1."""
    return row.get("cp_attn", "-") if row["cp"] > 1 else "-"


def plan_table(path: str) -> str:
    """Markdown for docs/performance.md: one-process rows (`--model small` unless a row names
    its model) with the planner's figures at the current megagrpo/plan/memory.py."""
    rows = [json.loads(ln) for ln in open(path) if ln.strip()]
    pct = lambda e: f"{e * 100:+.0f}%"  # noqa: E731
    out = ["| attention | recompute | step peak (RSS) MiB | planner MiB | error | saved "
           "activations MiB | planner activations MiB | error | step s |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        est, act = planner_mib(r["recompute"], r["attention"], r["seq"], r["batch"],
                               r.get("model", "small"), r.get("cp", 1))
        out.append(f"| {r['attention']} | {r['recompute']} | {r['step_peak_mib']} | {est:.1f} | "
                   f"{pct((est - r['step_peak_mib']) / r['step_peak_mib'])} | "
                   f"{r['saved_mib']} | {act:.1f} | {pct((act - r['saved_mib']) / r['saved_mib'])}"
                   f" | {r['step_s']} |")
    return "\n".join(out)


def planner_longest(row: dict, budget_mib: float) -> int:
    """The longest S (multiple of 2 x cp, 1024-token steps then bisected) whose planner
    figure for the step fits `budget_mib` (the budget less the fit's S-independent part)."""
    est = partial(planner_mib, row["recompute"], row["attention"], batch=row["batch"],
                  model=row["model"], cp=row["cp"])
    q = 2 * row["cp"]
    lo, hi = q, q
    while est(seq=hi)[0] <= budget_mib:
        lo, hi = hi, hi * 2
    while hi - lo > q:
        mid = (lo + hi) // 2 // q * q
        lo, hi = (mid, hi) if est(seq=mid)[0] <= budget_mib else (lo, mid)
    return lo


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", default="1024", help="comma-separated sequence lengths")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--attention", default="sdpa,megatron")
    ap.add_argument("--threads", type=int, default=2, help="torch threads in all (/ cp a rank)")
    ap.add_argument("--recompute", default="none,selective,full")
    ap.add_argument("--cp", default="1", help="comma-separated context-parallel sizes")
    ap.add_argument("--model", default="small", choices=sorted(MODELS))
    ap.add_argument("--max-gib", type=float, default=12.0,
                    help="skip a setting predicted to pass this per process")
    ap.add_argument("--out", default=None)
    ap.add_argument("--table", default=None, help="only print docs' markdown from this file")
    ap.add_argument("--plan-table", default=None,
                    help="only print docs/performance.md's planner table from this file")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if print_table(args, table=table, plan_table=plan_table):
        return
    if args.child:
        recompute, attention = args.child.split(":")
        print(json.dumps(child(recompute, attention, int(args.seq), args.batch, args.threads,
                               args.model, int(args.cp))))
        return
    from benchmarks._harness import emit
    from megagrpo.runtime.machine import cpu_name

    cpu = cpu_name()
    done: dict[tuple, list[dict]] = {}
    for cp in map(int, args.cp.split(",")):
        for seq in sorted(map(int, args.seq.split(","))):
            for attention in args.attention.split(","):
                for recompute in args.recompute.split(","):
                    key = (cp, attention, recompute)
                    head = {"model": args.model, "cp": cp, "recompute": recompute,
                            "attention": attention, "seq": seq, "batch": args.batch,
                            "loadavg_1m": loadavg(), "cpu": cpu}
                    plan = planner_mib(recompute, attention, seq, args.batch, args.model, cp)[0]
                    guess = predicted_mib(done.get(key, []), seq, plan)
                    if guess > args.max_gib * 1024:
                        emit({**head, "skipped": f"predicted {guess / 1024:.1f} GiB per "
                              f"process > --max-gib {args.max_gib:g}"}, args.out)
                        continue
                    rec = run_setting(args, args.model, cp, seq, attention, recompute)
                    rec = {**head, **rec}
                    done.setdefault(key, []).append(rec)
                    emit(rec, args.out)


if __name__ == "__main__":
    main()
