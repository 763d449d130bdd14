"""Issue 33's speed targets against benchmarks/results/: docs/performance.md's targets table.

    .venv/bin/python benchmarks/targets.py [--results benchmarks/results] [--json]

One row per target and workload / dtype: the measured value, met or not, the results file and
CPU it comes from, and for a miss its measured cause, as figures read from the files that split
the time (the per-phase profiles of profile_step.py, the unprofiled layer split of
layer_split.py, the bandwidth-aware rollout floor of grpo_step.py / rollout_floor.py, vLLM's
rollout alone from rollout_settings.py, the refit's repack split from weight_sync.py). A target
no file measures says "not measured" and the command that would measure it. The targets:

- score and update >= 85% of their FLOP floor on midsize and smollm2, >= 70% on varlen and moe
  (fp32): report.py's best megagrpo line of the megagrpo-vs-TRL comparison;
- rollout >= 70% of its bandwidth-aware floor on midsize and smollm2 (fp32): the newest
  grpo_step.py record that holds its rollouts' costs;
- ahead of TRL in tokens/s on every workload at both dtypes, the demo >= 1.5x (report.py's
  ratio, each system at its best setting);
- refit >= 3x faster than the disk round trip and <= 2x a memcpy of the same bytes, 100M model.

The records carry no CPU name: each results file is named with the CPU it was measured on
(docs/performance.md says when and how), and where several CPUs measured a workload / dtype the
first file of THROUGHPUT holding it (the newest run) gives the row.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report  # noqa: E402

# results file -> the CPU it was measured on; THROUGHPUT newest run first
THROUGHPUT = (("throughput_epyc_f25_cpu.jsonl", "AMD EPYC family 25"),
              ("throughput_epyc_cpu.jsonl", "AMD EPYC"),
              ("throughput_cpu.jsonl", "Intel Xeon, AMX"))
ROLLOUT_FLOOR = ("rollout_floor_epyc_cpu.jsonl", "AMD EPYC")
ROLLOUT_ALONE = ("rollout_settings_epyc_cpu.jsonl", "AMD EPYC")
PROFILE = ("profile_{}_epyc_cpu.json", "AMD EPYC")
LAYER_SPLIT = ("layer_split_cpu.jsonl", "Intel Xeon, AMX")
REFIT = ("weight_sync_repack_cpu.jsonl", "AMD EPYC")

FLOOR = {"midsize": 0.85, "smollm2": 0.85, "varlen": 0.70, "moe": 0.70}
ROLLOUT_FLOOR_WORKLOADS, ROLLOUT_BOUND = ("midsize", "smollm2"), 0.70
DTYPES = ("float32", "bfloat16")
DEMO_RATIO, REFIT_SIZE, REFIT_DISK, REFIT_MEMCPY = 1.5, "100m", 3.0, 2.0


@dataclass(frozen=True)
class Target:
    what: str  # as the table prints it
    bound: float
    at_most: bool = False  # the value must be <= bound (else >= bound)
    percent: bool = True  # shown as a percentage with one decimal, else as "1.23x"
    places: int = 2  # decimals of a ratio

    def met(self, value: float) -> bool:
        return value <= self.bound if self.at_most else value >= self.bound

    def shown(self, value: float) -> str:
        """`value` rounded as report.py rounds it, except where that would cross the bound: a
        miss never reads as the bound itself (1.499x against 1.5x shows 1.49x, not 1.50x)."""
        k, scale = (3, 100) if self.percent else (self.places, 1)
        text = f"{value:.1%}" if self.percent else f"{value:.{k}f}x"
        if self.met(float(text[:-1]) / scale) == self.met(value):
            return text
        x = value * 10**k
        x = (math.ceil(x) if self.at_most else math.floor(x)) / 10**k
        return f"{x:.1%}" if self.percent else f"{x:.{k}f}x"


def verdict(value: float | None, t: Target) -> bool | None:
    """True met, False not met, None nothing measured."""
    return None if value is None else t.met(value)


def _jsonl(path: Path) -> list[dict]:
    return report.read_records(path) if path.exists() else []


def _src(name: str, cpu: str) -> str:
    return f"{name}, {cpu}"


def _n(k: int, unit: str) -> str:
    return f"{k} {unit}{'s' if k != 1 else ''}"


def _row(t: Target, workload: str, dtype: str, value: float | None, source: str,
         cause: str) -> dict:
    """One table row; `cause` is kept for a miss and for a target nothing measured."""
    met = verdict(value, t)
    return dict(target=t.what, workload=workload, dtype=dtype, value=value,
                shown="-" if value is None else t.shown(value), met=met,
                source=source if value is not None else "-", cause="" if met else cause)


def _newest(runs: list, workload: str, dtype: str, need: str) -> tuple | None:
    """(summary, megagrpo line, TRL line, file, CPU) of the first results file whose
    report.py summary for (workload, dtype) has `need` measured, else None."""
    for name, cpu, recs in runs:
        for s in report.summarize(recs):
            if (s["workload"], s["dtype"]) == (workload, dtype) and s[need] is not None:
                return (s, *report.best_lines(recs, workload, dtype), name, cpu)
    return None


def phase_cause(results: Path, workload: str, phase: str) -> str:
    """Where a phase's time goes: the profiled kernel split of the phase and, for the update
    (a forward + backward), the unprofiled layer split at 2 threads on a quiet machine."""
    parts = []
    prof = results / PROFILE[0].format(workload)
    if prof.exists():
        rec = json.loads(prof.read_text())
        k = rec[phase]["kernels"]
        if k["gemm_rate_frac"] is not None:
            sh = k["share"]
            parts.append(f"profiled {phase}: GEMM {sh['gemm']:.0%} of the phase at "
                         f"{k['gemm_rate_frac']:.0%} of torch.mm, attention "
                         f"{sh['attention']:.0%}, copies {sh['copy']:.0%}, element-wise "
                         f"{sh['elementwise']:.0%}, overhead {sh['overhead']:.0%} "
                         f"({_src(prof.name, rec.get('cpu', PROFILE[1]))})")
    split = [r for r in _jsonl(results / LAYER_SPLIT[0]) if r["preset"] == workload
             and r["threads"] == 2 and not r["neighbour_threads"] and not r.get("compiled")]
    if phase == "update" and split:
        x = split[-1]
        parts.append(f"unprofiled layer forward + backward ({x['tokens']} tokens, 2 threads, "
                     f"quiet): GEMMs {x['gemm_share']:.0%} at {x['gemm_rate_frac']:.0%} of "
                     f"torch.mm, attention {x['attention_share']:.0%} at "
                     f"{x['attention_rate_frac']:.0%}, the rest (element-wise, copies, "
                     f"overhead) {x['rest_share']:.0%}; {x['floor_frac']:.1%} of the floor "
                     f"({_src(LAYER_SPLIT[0], LAYER_SPLIT[1])})")
    return "; ".join(parts) or (
        f"no split measured on any CPU: `python benchmarks/profile_step.py --workload "
        f"{workload} --out benchmarks/results/{PROFILE[0].format(workload)}` measures it")


def floor_rows(results: Path, runs: list) -> list[dict]:
    """Score and update against their FLOP floor (fp32)."""
    out = []
    for wl, bound in FLOOR.items():
        for phase in ("score", "update"):
            t = Target(f"{phase} >= {bound:.0%} of its FLOP floor", bound)
            found = _newest(runs, wl, "float32", "megagrpo_tok_s")
            if found is None:
                out.append(_row(t, wl, "float32", None, "", (
                    f"not measured: `OUT=benchmarks/results/{THROUGHPUT[0][0]} "
                    f"RUNS=\"{wl}:float32\" bash benchmarks/throughput.sh`")))
                continue
            s, m, _, name, cpu = found
            row = _row(t, wl, "float32", s[f"floor_{phase}"], _src(name, cpu),
                       phase_cause(results, wl, phase))
            if s[f"floor_{phase}"] is None:
                row.update(met=None, cause=f"no {phase} pass: the best line counts "
                           f"{m[f'flops_{phase}']:.0f} FLOPs for it "
                           f"({m[f'time_{phase}_s']} s a step)", source=_src(name, cpu))
            out.append(row)
    return out


def rollout_cause(r: dict, alone: list[dict], source: str) -> str:
    """The trainer's rollout against its floor and, if measured, vLLM's rollout of the same
    workload alone (its newest default-settings row)."""
    import rollout_floor as RF  # here: it imports torch, which the other rows never need

    per_step = r["rollout_decode_steps"] / r["steps"]
    above = (r["time_rollout_s"] - r["floor_rollout_s"]) / per_step
    text = (f"rollout {r['time_rollout_s']:.3f} s a step against a floor of "
            f"{r['floor_rollout_s']:.3f} s; decode {r['rollout_decode_flop_s']:.3f} s at the "
            f"GEMM rate vs {r['rollout_decode_byte_s']:.3f} s at the read bandwidth, the "
            f"limit: {RF.binding(r)}; {above * 1e3:.1f} ms a decode step above the floor, load "
            f"{r['loadavg_1m']:.2f} ({source})")
    rows = [x for x in alone if x["workload"] == r["workload"] and x["variant"] == "default"]
    if rows:
        x = rows[-1]
        text += (f"; vLLM alone, the same rollout: best {x['best_s']:.3f} s, "
                 f"{x['floor_frac']:.1%} of its floor, "
                 f"{(x['best_s'] - x['floor_s']) / x['decode_steps'] * 1e3:.1f} ms a decode "
                 f"step above it ({x['bandwidth_bound_steps']} of {x['decode_steps']} steps "
                 f"bandwidth-bound), load {x['loadavg_1m']:.2f} ({_src(*ROLLOUT_ALONE)})")
    return text


def _rollout_record(runs: list, floor_recs: list[dict], workload: str) -> tuple | None:
    """(record, source) pricing the workload's rollout bytes: the best megagrpo line of the
    newest throughput file that has one, else the newest rollout-floor rerun; None if neither."""
    for name, cpu, run in runs:
        m = report.best_lines(run, workload, "float32")[0]
        if m is not None and "mem_read_gbs" in m:
            return m, _src(name, cpu)
    mine = [r for r in floor_recs if r["workload"] == workload]
    return (mine[-1], _src(*ROLLOUT_FLOOR)) if mine else None


def rollout_rows(results: Path, runs: list) -> list[dict]:
    """The rollout against its bandwidth-aware floor (fp32)."""
    recs = [r for r in _jsonl(results / ROLLOUT_FLOOR[0]) if r.get("system") == "megagrpo"
            and "mem_read_gbs" in r and r["dtype"] == "float32"]
    alone = _jsonl(results / ROLLOUT_ALONE[0])
    out = []
    for wl in ROLLOUT_FLOOR_WORKLOADS:
        t = Target(f"rollout >= {ROLLOUT_BOUND:.0%} of its bandwidth-aware floor", ROLLOUT_BOUND)
        if found := _rollout_record(runs, recs, wl):
            r, source = found
            out.append(_row(t, wl, "float32", r["floor_frac_rollout"], source,
                            rollout_cause(r, alone, source)))
            continue
        cause = (f"not measured: `python benchmarks/grpo_step.py --workload {wl} --nprocs 1 "
                 f"--warmup 1 --steps 3 --out benchmarks/results/{ROLLOUT_FLOOR[0]} --append`")
        found = _newest(runs, wl, "float32", "floor_rollout")
        if found:
            cause += (f"; the throughput run's rollout reached {found[0]['floor_rollout']:.1%} "
                      f"of its FLOP-only floor ({_src(found[3], found[4])}), so at least that "
                      "of its bandwidth-aware floor, which is never below the FLOP floor")
        out.append(_row(t, wl, "float32", None, "", cause))
    return out


def trl_cause(m: dict, t: dict) -> str:
    """Each phase's seconds a step, megagrpo's best line against TRL's."""
    return (f"seconds a step, megagrpo ({_n(m['nproc'], 'rank')}) vs TRL "
            f"({_n(t['threads'], 'thread')}): rollout {m['time_rollout_s']:.3f} vs "
            f"{t['time_rollout_s']:.3f}, score {m['time_score_s']:.3f} vs "
            f"{t['time_score_s']:.3f}, update "
            f"{m['time_update_s']:.3f} vs {t['time_update_s']:.3f}, weight sync "
            f"{m['time_weight_sync_s']:.3f} (TRL none); completion mean "
            f"{m['completion_len_mean']:.1f} vs {t['completion_len_mean']:.1f} tokens")


def trl_rows(runs: list) -> list[dict]:
    """megagrpo's tokens/s over TRL's, each at its best setting."""
    out = []
    for wl in report.ORDER:
        for dt in DTYPES:
            for bound in (1.0, DEMO_RATIO) if wl == "demo" else (1.0,):
                t = Target(f">= {bound:g}x TRL tokens/s", bound, percent=False)
                found = _newest(runs, wl, dt, "ratio")
                if found is None:
                    out.append(_row(t, wl, dt, None, "", (
                        f"not measured: `OUT=benchmarks/results/{THROUGHPUT[0][0]} "
                        f"RUNS=\"{wl}:{dt}\" bash benchmarks/throughput.sh`")))
                    continue
                s, m, trl, name, cpu = found
                out.append(_row(t, wl, dt, s["ratio"], _src(name, cpu), trl_cause(m, trl)))
    return out


def refit_rows(results: Path) -> list[dict]:
    """The 100M refit against the disk round trip and against memcpy."""
    recs = [r for r in _jsonl(results / REFIT[0]) if r.get("size") == REFIT_SIZE]
    targets = (Target(f"refit >= {REFIT_DISK:g}x faster than the disk round trip", REFIT_DISK,
                      percent=False),
               Target(f"refit <= {REFIT_MEMCPY:g}x memcpy", REFIT_MEMCPY, at_most=True,
                      percent=False, places=1))
    if not recs:
        cause = (f"not measured: `python benchmarks/weight_sync.py --sizes {REFIT_SIZE} "
                 f"--repeats 3 --out benchmarks/results/{REFIT[0]}`")
        return [_row(t, REFIT_SIZE, "float32", None, "", cause) for t in targets]
    r = recs[-1]
    cause = (f"engine load {r['engine_load_s']:.3f} s of the {r['sync_s']:.3f} s sync (gather "
             f"and convert {r['gather_convert_s']:.3f} s); vLLM's repacking of every linear "
             f"alone {r['repack_s']:.3f} s = {r['repack_s'] / r['memcpy_s']:.1f}x memcpy, a "
             f"plain copy of the same tensors {r['plain_copy_s']:.3f} s = "
             f"{r['plain_copy_s'] / r['memcpy_s']:.1f}x; decode on plain weights "
             f"{r['decode_plain_s'] / r['decode_packed_s']:.2f}x slower than on packed ones")
    disk = (f"the disk round trip {r['disk_total_s']:.3f} s (write {r['disk_write_s']:.3f} s, "
            f"read + the same engine load {r['disk_read_load_s']:.3f} s); ")
    return [_row(targets[0], REFIT_SIZE, "float32", r["disk_total_s"] / r["sync_s"],
                 _src(*REFIT), disk + cause),
            _row(targets[1], REFIT_SIZE, "float32", r["sync_s"] / r["memcpy_s"], _src(*REFIT),
                 cause)]


def rows(results: Path) -> list[dict]:
    """Every target's rows, from the files in `results`."""
    runs = [(name, cpu, _jsonl(results / name)) for name, cpu in THROUGHPUT]
    return [*floor_rows(results, runs), *rollout_rows(results, runs), *trl_rows(runs),
            *refit_rows(results)]


def markdown(rs: list[dict]) -> str:
    lines = ["| target | workload | dtype | measured | verdict | from (file, CPU) "
             "| measured cause of a miss |", "|---|---|---|---|---|---|---|"]
    words = {True: "met", False: "not met"}
    for r in rs:
        word = words.get(r["met"], "not measured" if r["cause"].startswith("not measured")
                         else "-")
        lines.append(f"| {r['target']} | {r['workload']} | {r['dtype']} | {r['shown']} "
                     f"| {word} | {r['source']} | {r['cause'] or '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default="benchmarks/results", type=Path)
    ap.add_argument("--json", action="store_true", help="one JSON line per row")
    args = ap.parse_args(argv)
    rs = rows(args.results)
    print("\n".join(json.dumps(r) for r in rs) if args.json else markdown(rs))


if __name__ == "__main__":
    main()
