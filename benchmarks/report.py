"""The throughput tables of docs/performance.md from benchmarks/results/throughput_cpu.jsonl.

    .venv/bin/python benchmarks/report.py [benchmarks/results/throughput_cpu.jsonl] [--json]

Reads the JSON lines grpo_step.py (system "megagrpo") and trl_grpo_baseline.py (system "trl")
wrote; per (workload, dtype): each system's best line by generated tokens/s (megagrpo over its
rank counts, TRL over its thread settings: each system at its best setting), the wall ratio
megagrpo / TRL, the per-CPU-second ratio (each system's best gen tokens per CPU second), and the
padded-token share and, per phase (rollout, score, update) and for the step, the fraction of the
FLOP floor megagrpo's best line achieved (grpo_step.py: useful FLOPs at torch.mm's best measured
rate; records from before the rollout floor existed show score and update only). Then the
targets: ahead of TRL at its best setting (>= 1x tokens/s, wall and per CPU second), >= 90% of
the floor in each phase, and padded tokens <= 10% on the variable-length workload (varlen); a
missed target says by how much. Lines marked "skipped" (a workload whose model is absent) are
listed as such.
`--json` prints one summary object per (workload, dtype) instead of markdown.
`--sp` reads grpo_step.py lines of one workload run with and without
`parallel.sequence_parallel` (e.g. benchmarks/results/moe_sp_epyc_cpu.jsonl) and prints their
A/B table (`sp_table`).
`--compile` reads grpo_step.py --compile-ab lines (compiled and eager steps alternated in one
process, e.g. benchmarks/results/compile_ab_cpu.jsonl) and prints their table
(`compile_table`).
"""
from __future__ import annotations

import json
from pathlib import Path

from _common import markdown_table, parser
from _common import records as read_records  # the name targets.py and the tests use

ORDER = ("demo", "varlen", "midsize", "moe", "smollm2")
FLOOR_PHASES = ("rollout", "score", "update")
TARGETS = dict(ratio=1.0, ratio_cpu=1.0, floor_rollout=0.9, floor_score=0.9, floor_update=0.9,
               padded_share=0.10)
PADDING_WORKLOAD = "varlen"


def _best(rows: list[dict], key: str) -> dict | None:
    return max(rows, key=lambda r: r[key]) if rows else None


def _lines(records: list[dict], workload: str, dtype: str, system: str) -> list[dict]:
    """`system`'s measured lines (not "skipped") for (workload, dtype)."""
    return [r for r in records if (r.get("workload", "demo"), r.get("dtype", "float32"))
            == (workload, dtype) and r.get("system") == system and "skipped" not in r]


def best_lines(records: list[dict], workload: str, dtype: str) -> tuple[dict | None, dict | None]:
    """megagrpo's and TRL's best line for (workload, dtype) by generated tokens/s: each system
    at its best setting (None where a system has no measured line)."""
    return tuple(_best(_lines(records, workload, dtype, sys_), "gen_tokens_per_s")
                 for sys_ in ("megagrpo", "trl"))


def summarize(records: list[dict]) -> list[dict]:
    """One summary per (workload, dtype), in ORDER then float32 before bfloat16."""
    keys = sorted({(r.get("workload", "demo"), r.get("dtype", "float32")) for r in records},
                  key=lambda k: (ORDER.index(k[0]) if k[0] in ORDER else len(ORDER), k[0],
                                 k[1] != "float32"))
    out = []
    for wl, dt in keys:
        skipped = [r["skipped"] for r in records if "skipped" in r
                   and (r.get("workload", "demo"), r.get("dtype", "float32")) == (wl, dt)]
        mg, trl = _lines(records, wl, dt, "megagrpo"), _lines(records, wl, dt, "trl")
        m, t = _best(mg, "gen_tokens_per_s"), _best(trl, "gen_tokens_per_s")
        s = dict(workload=wl, dtype=dt, skipped=skipped[0] if skipped and not mg else None,
                 megagrpo_tok_s=m and m["gen_tokens_per_s"], megagrpo_nproc=m and m["nproc"],
                 trl_tok_s=t and t["gen_tokens_per_s"], trl_threads=t and t["threads"],
                 padded_share=m and m.get("padded_token_share"),
                 **{f"floor_{p}": m and m.get(f"floor_frac_{p}", m.get(f"mfu_{p}"))
                    for p in (*FLOOR_PHASES, "step")},
                 loadavg_max=max((r.get("loadavg_1m") or 0.0 for r in mg + trl), default=None),
                 # equal work: both systems' mean completion over their measured steps
                 len_megagrpo=m and m.get("completion_len_mean"),
                 len_trl=t and t.get("completion_len_mean"))
        s["ratio"] = m["gen_tokens_per_s"] / t["gen_tokens_per_s"] if m and t else None
        s["ratio_cpu"] = (max(r["gen_tokens_per_cpu_s"] for r in mg)
                          / max(r["gen_tokens_per_cpu_s"] for r in trl)) if m and t else None
        s["met"] = verdicts(s)
        out.append(s)
    return out


def verdicts(s: dict) -> dict[str, bool | None]:
    """Per target: True met, False not met, None not measured / not applicable."""
    v = {k: (None if s[k] is None else s[k] >= TARGETS[k])
         for k in ("ratio", "ratio_cpu", *(f"floor_{p}" for p in FLOOR_PHASES))}
    pad = s["padded_share"]
    v["padded_share"] = (None if pad is None or s["workload"] != PADDING_WORKLOAD
                         else pad <= TARGETS["padded_share"])
    return v


def _num(x, fmt: str) -> str:
    return "-" if x is None else fmt.format(x)


def _verdict(s: dict, key: str, fmt: str) -> str:
    """'met (2.31x)' / 'not met (1.16x; 42% short)' / '-'."""
    ok, value, target = s["met"][key], s[key], TARGETS[key]
    if ok is None:
        return "-"
    shown = fmt.format(value)
    if ok:
        return f"met ({shown})"
    gap = (value - target) / target if key == "padded_share" else (target - value) / target
    return f"not met ({shown}; {gap:.0%} {'over' if key == 'padded_share' else 'short'})"


def markdown(summary: list[dict]) -> str:
    """Two markdown tables: the figures, then the targets."""
    head = ("| workload | dtype | megagrpo best | TRL best | ratio (tok/s) | per CPU-s "
            "| padded share | floor: rollout | score | update | step | max load "
            "| completion mean (mg / TRL) |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for s in summary:
        if s["skipped"]:
            lines.append(f"| {s['workload']} | {s['dtype']} | skipped: {s['skipped']} "
                         "| | | | | | | | | | |")
            continue
        mg = (f"{s['megagrpo_tok_s']:.0f} tok/s ({s['megagrpo_nproc']} rank"
              f"{'s' if s['megagrpo_nproc'] != 1 else ''})" if s["megagrpo_tok_s"] else "-")
        trl = (f"{s['trl_tok_s']:.0f} tok/s ({s['trl_threads']} thread"
               f"{'s' if s['trl_threads'] != 1 else ''})" if s["trl_tok_s"] else "-")
        lines.append(f"| {s['workload']} | {s['dtype']} | {mg} | {trl} "
                     f"| {_num(s['ratio'], '{:.2f}x')} | {_num(s['ratio_cpu'], '{:.2f}x')} "
                     f"| {_num(s['padded_share'], '{:.1%}')} "
                     + "".join(f"| {_num(s[f'floor_{p}'], '{:.1%}')} "
                               for p in (*FLOOR_PHASES, "step"))
                     + f"| {_num(s['loadavg_max'], '{:.2f}')} "
                     f"| {_num(s['len_megagrpo'], '{:.1f}')} / {_num(s['len_trl'], '{:.1f}')} |")
    lines += ["", "| workload | dtype | >= 1x TRL tok/s | >= 1x per CPU-s | rollout >= 90% "
              "of floor | score >= 90% | update >= 90% | padding <= 10% (varlen) |",
              "|---|---|---|---|---|---|---|---|"]
    for s in summary:
        if not s["skipped"]:
            lines.append(f"| {s['workload']} | {s['dtype']} | {_verdict(s, 'ratio', '{:.2f}x')} "
                         f"| {_verdict(s, 'ratio_cpu', '{:.2f}x')} "
                         + "".join(f"| {_verdict(s, f'floor_{p}', '{:.1%}')} "
                                   for p in FLOOR_PHASES)
                         + f"| {_verdict(s, 'padded_share', '{:.1%}')} |")
    return "\n".join(lines)


def _sp_setting(r: dict) -> str:
    """'on' / 'off' from a grpo_step.py line's --set overrides (unset: 'auto')."""
    for o in r.get("overrides", []):
        if o.startswith("parallel.sequence_parallel="):
            return "on" if o.split("=", 1)[1].lower() == "true" else "off"
    return "auto"


def sp_table(records: list[dict]) -> str:
    """Runs of one workload with sequence parallelism on and off (grpo_step.py lines), one row
    per setting: how many runs, the mean and range of the step and of each phase, generated
    tokens/s and the update's achieved fraction of its FLOP floor (mean), the highest 1-minute
    load any run started under, then the on / off ratio of the mean step."""
    groups: dict[str, list[dict]] = {}
    for r in records:
        if r.get("system") == "megagrpo" and "skipped" not in r:
            groups.setdefault(_sp_setting(r), []).append(r)

    def stat(rows, key, fmt="{:.2f}"):
        vals = [r[key] for r in rows]
        mean = sum(vals) / len(vals)
        return (fmt.format(mean) if len(vals) == 1 else
                f"{fmt.format(mean)} ({fmt.format(min(vals))}-{fmt.format(max(vals))})")

    lines = ["| sequence parallelism | layout | runs | step s | rollout s | score s | update s "
             "| gen tok/s | update floor | max load |", "|---|---|---|---|---|---|---|---|---|---|"]
    means = {}
    for name in ("on", "off", "auto"):
        rows = groups.get(name)
        if not rows:
            continue
        r0 = rows[0]
        means[name] = sum(r["step_s"] for r in rows) / len(rows)
        lines.append(
            f"| {name} | {r0['workload']} {r0['dtype']}, TP={r0.get('tp', 1)} x "
            f"DP={r0.get('dp', 1)} | {len(rows)} | {stat(rows, 'step_s')} "
            f"| {stat(rows, 'time_rollout_s')} | {stat(rows, 'time_score_s')} "
            f"| {stat(rows, 'time_update_s')} | {stat(rows, 'gen_tokens_per_s', '{:.0f}')} "
            f"| {stat(rows, 'floor_frac_update', '{:.1%}')} "
            f"| {max(r.get('loadavg_1m') or 0.0 for r in rows):.2f} |")
    if "on" in means and "off" in means:
        lines.append(f"\nMean step with sequence parallelism / without: "
                     f"{means['on'] / means['off']:.3f}.")
    return "\n".join(lines)


def auto_work_step(rec: dict) -> float:
    """The token passes a layer of one GRPO step of a --compile-ab line's run, as
    compute.compile_layers=auto prices them (`megagrpo.config.compile.run_work` on the
    workload's config), the prompts' mean length taken from the tokens the update processed."""
    import sys

    from megagrpo.config.compile import run_work

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _workloads as W

    cfg = W.base_config(W.get_workload(rec["workload"]), rec["dtype"], rec["overrides"])
    prompt = (rec["processed_tokens_update"] / (rec["batch_prompts"] * rec["group_size"])
              - rec["completion_len_mean"])
    return run_work(cfg, rec["dp"], prompt).grpo_step


def saved_per_unit(rec: dict) -> float:
    """Score + update seconds a --compile-ab line's compiled step saved per token pass, layer
    and unit of hidden_size (`auto_work_step`): what 'auto' calls AUTO_SAVED_S."""
    m = rec["model"]
    saved = sum(rec["eager"][f"time_{p}_s"] - rec[f"time_{p}_s"] for p in ("score", "update"))
    return saved / (auto_work_step(rec) * m["layers"] * m["hidden"])


def compile_table(records: list[dict]) -> str:
    """grpo_step.py --compile-ab lines, one row each: the model, the eager and the compiled
    steps' score, update and step seconds (means of the alternated steps of one process), the
    compiled / eager ratio of score + update (the passes the compile touches; the rollout
    varies with what was sampled), the seconds saved per token pass, layer and unit of hidden
    size (`saved_per_unit`), the compile seconds the first steps paid and the steps a run
    needs to repay them from the score + update saved; the load and the CPU."""
    rows = []
    for r in records:
        if not r.get("compile_ab") or "skipped" in r:
            continue
        e, m = r["eager"], r["model"]
        eager, compiled = (x["time_score_s"] + x["time_update_s"] for x in (e, r))
        repay = f"{r['compile_s'] / (eager - compiled):.0f}" if compiled < eager else "never"
        file_data = ", prompts from a file" if "data.task=file" in r["overrides"] else ""
        rows.append([
            f"{r['workload']}{file_data}",
            f"{r['nproc']} x {r['batch_prompts']} x {r['group_size']}",
            f"{m['hidden']} x {m['layers']}, {m['vocab']}", r["steps"],
            f"{e['time_score_s']:.3f} -> {r['time_score_s']:.3f}",
            f"{e['time_update_s']:.3f} -> {r['time_update_s']:.3f}",
            f"{e['step_s']:.3f} -> {r['step_s']:.3f}", f"{compiled / eager:.2f}",
            f"{saved_per_unit(r):.1e}", f"{r['compile_s']:.1f}", repay, f"{r['loadavg_1m']:.2f}",
            r["cpu"]])
    return markdown_table(
        ["workload", "ranks x prompts x G", "model (hidden x layers, vocab)", "steps each",
         "score s, eager -> compiled", "update s", "step s",
         "compiled / eager, score + update", "saved s / (token pass x layer x hidden)",
         "compile s (first steps)", "steps to repay", "load", "CPU"], rows)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("path", nargs="?", default="benchmarks/results/throughput_cpu.jsonl")
    ap.add_argument("--json", action="store_true", help="one JSON summary line per workload")
    ap.add_argument("--sp", action="store_true",
                    help="the sequence-parallel A/B table of PATH (grpo_step.py lines)")
    ap.add_argument("--compile", action="store_true",
                    help="the compiled-vs-eager table of PATH (grpo_step.py --compile-ab lines)")
    args = ap.parse_args()
    if not Path(args.path).exists():
        raise SystemExit(f"{args.path} does not exist: run `bash benchmarks/throughput.sh` "
                         "first (or give the JSONL to read)")
    if args.sp:
        print(sp_table(read_records(args.path)))
        return
    if args.compile:
        print(compile_table(read_records(args.path)))
        return
    summary = summarize(read_records(args.path))
    if args.json:
        print("\n".join(json.dumps(s) for s in summary))
    else:
        print(markdown(summary))


if __name__ == "__main__":
    main()
