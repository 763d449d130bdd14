"""Does iterative GRPO help? DeepSeekMath (arXiv 2402.03300, section 5.2.1, Figure 6) in
miniature, with megagrpo's own runs.

From one deliberately weak supervised cold start per task, every run gets the same steps, batch
and evaluation (the same compute) and differs only in what happens to the KL reference:

  frozen   the reference stays the cold-start model (a plain GRPO run)
  reset    ref <- policy every K steps (alpha = 1, DeepSeekMath's iterations)
  mix      ref <- 0.6 * policy + 0.4 * ref every K steps
  kl       ref <- policy whenever the step's mean KL exceeds a threshold
  epoch    ref <- policy at the start of every data epoch
  no_ref   beta = 0: no reference at all (one run per seed, shared by both beta columns)

at the paper's beta = 0.04 and a larger beta, on the easy task (2-digit addition) and a harder
one (3-digit addition), over several seeds (sampling and data order; the cold start is shared).

    python examples/iterative_study/study.py           # the full grid: 66 runs, ~3400 CPU s
                                                       # (~30 min on 2 quiet cores, --jobs 2)
    python examples/iterative_study/study.py --quick   # a small grid in a few minutes (tests)
    python examples/iterative_study/study.py --report-only   # tables/figures from finished runs

Runs go to --work (default runs/iterative_study; each a normal megagrpo out_dir, skipped when its
summary.json exists, so an interrupted study continues); the outputs to --out (default
examples/iterative_study/results): `table.md` (final held-out accuracy, mean +- std and min-max
over seeds, KL, resets), `curves_<task>_beta<b>.png` (held-out accuracy and KL against step,
resets marked), `runs.json` (every run's curves, from which both are drawn) and `REPORT.md`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RECIPE = HERE / "study.yaml"
COST_FILE = "study_cost.json"


@dataclass(frozen=True, kw_only=True)
class Task:
    """One arithmetic task and its cold start."""

    name: str
    """Short name used in paths and tables."""
    label: str
    """What the task is, for the write-up."""
    digits: int
    """arithmetic.digits."""
    sft_steps: int
    """Supervised cold-start steps: few enough that the start is weak."""


@dataclass(frozen=True, kw_only=True)
class Variant:
    """A reference treatment: the overrides it adds to every run."""

    name: str
    """Short name used in paths and tables."""
    label: str
    """What it does, for the write-up."""
    overrides: tuple[str, ...] = ()
    """reference.* settings (key=value)."""
    uses_beta: bool = True
    """False for beta = 0 (no reference): one run per seed, not one per beta."""


@dataclass(frozen=True, kw_only=True)
class Grid:
    """The whole study: tasks x betas x variants x seeds, and the shared run settings."""

    tasks: tuple[Task, ...]
    """Tasks, each with its own cold start."""
    betas: tuple[float, ...]
    """KL coefficients compared (algo.beta)."""
    variants: tuple[Variant, ...]
    """Reference treatments compared."""
    seeds: tuple[int, ...]
    """Seeds of sampling and data order (run.seed, rollout.seed, data.seed)."""
    steps: int
    """GRPO steps per run (the same for every run: the compute budget)."""
    eval_every: int
    """Held-out greedy accuracy every this many steps."""
    num_eval: int = 200
    """Held-out problems (arithmetic.num_eval): accuracy moves in steps of 1 / num_eval."""
    extra: tuple[str, ...] = ()
    """Overrides for every run and cold start (smaller batches in quick mode)."""


def variants(k: int, kl_threshold: float) -> tuple[Variant, ...]:
    """The six treatments of the issue, with reset period `k` and the KL threshold."""
    return (
        Variant(name="frozen", label="frozen reference (the cold start)"),
        Variant(name="reset", label=f"reset every {k} steps (alpha=1)",
                overrides=(f"reference.sync_every_steps={k}", "reference.alpha=1.0")),
        Variant(name="mix", label=f"mix alpha=0.6 every {k} steps",
                overrides=(f"reference.sync_every_steps={k}", "reference.alpha=0.6")),
        Variant(name="kl", label=f"reset when KL > {kl_threshold:g}",
                overrides=(f"reference.sync_kl_threshold={kl_threshold}",)),
        Variant(name="epoch", label="reset every data epoch",
                overrides=("reference.sync_every_epoch=true",)),
        Variant(name="no_ref", label="no reference (beta=0)", uses_beta=False),
    )


def full_grid() -> Grid:
    """The issue's grid: 2 tasks x (5 treatments x 2 betas + beta=0) x 3 seeds = 66 runs."""
    tasks = (Task(name="easy", label="2-digit addition", digits=2, sft_steps=400),
             Task(name="hard", label="3-digit addition", digits=3, sft_steps=1000))
    return Grid(tasks=tasks, betas=(0.04, 0.2), variants=variants(8, 0.2),
                seeds=(1, 2, 3), steps=30, eval_every=5)


def quick_grid() -> Grid:
    """A minute or two (the tests): the easy task, one beta, three treatments, 4 short steps,
    one seed: 2, whose samples earn rewards from this weak start on the CPUs measured (seed 1's
    all scored 0, so nothing was learned and every KL stayed 0)."""
    task = Task(name="easy", label="2-digit addition", digits=2, sft_steps=30)
    pick = {"frozen", "reset", "no_ref"}
    return Grid(tasks=(task,), betas=(0.04,),
                variants=tuple(v for v in variants(2, 0.1) if v.name in pick),
                seeds=(2,), steps=4, eval_every=2, num_eval=24,
                extra=("data.batch_size=8", "algo.group_size=4", "algo.num_minibatches=1",
                       "arithmetic.num_train=24"))


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One GRPO run of the grid."""

    task: Task
    """Its task (and so its cold start)."""
    variant: Variant
    """Its reference treatment."""
    beta: float
    """algo.beta (0 for no_ref)."""
    seed: int
    """Seed of sampling and data order."""

    @property
    def key(self) -> str:
        return f"{self.task.name}/beta{self.beta:g}/{self.variant.name}/seed{self.seed}"


def run_specs(grid: Grid) -> list[RunSpec]:
    """Every run of the grid, task by task and within a task seed by seed (a study cut short
    has whole tasks, then whole seeds); the beta=0 treatment once per task and seed."""
    out = []
    for task in grid.tasks:
        for s in grid.seeds:
            for v in grid.variants:
                out += [RunSpec(task=task, variant=v, beta=beta, seed=s)
                        for beta in (grid.betas if v.uses_beta else (0.0,))]
    return out


# ---------------------------------------------------------------------------- running
@dataclass
class Launch:
    """What running one megagrpo command cost."""

    out_dir: Path
    returncode: int
    wall_s: float
    cpu_s: float


def _megagrpo(overrides: list[str], out_dir: Path, log_path: Path, timeout_s: float) -> Launch:
    """`python -m megagrpo train --config study.yaml ...` in a subprocess on one thread (two
    runs at once use the two cores better than one 2-rank run: no gradient all-reduce, no
    second vLLM engine per run). Its CPU seconds come from wait4 (this child only)."""
    cmd = [sys.executable, "-m", "megagrpo", "train", "--config", str(RECIPE),
           f"run.out_dir={out_dir}", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)  # the torch loss path runs on CPU anyway
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with log_path.open("w") as log:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        killer = threading.Timer(timeout_s, p.kill)  # a hung run must not stall the study
        killer.start()
        _, status, usage = os.wait4(p.pid, 0)  # reaps it with its own CPU time
        killer.cancel()
    p.returncode = os.waitstatus_to_exitcode(status)
    return Launch(out_dir=out_dir, returncode=p.returncode, wall_s=time.perf_counter() - t0,
                  cpu_s=usage.ru_utime + usage.ru_stime)


def cold_start_dir(work: Path, task: Task) -> Path:
    return work / "cold_start" / task.name


def run_cold_start(grid: Grid, task: Task, work: Path, timeout_s: float) -> Path:
    """The task's supervised cold start (no GRPO step), saved as a checkpoint every run of the
    task starts from (run.init). Reused when it already exists."""
    out = cold_start_dir(work, task)
    policy = out / "checkpoints" / "step_000000" / "policy"
    if (out / "summary.json").exists() and policy.is_dir():
        return policy
    overrides = [f"arithmetic.digits={task.digits}", f"arithmetic.num_eval={grid.num_eval}",
                 f"cold_start.steps={task.sft_steps}",
                 "run.steps=0", "checkpoint.at_end=true", "algo.beta=0", *grid.extra]
    res = _megagrpo(overrides, out, out.parent / f"{task.name}.log", timeout_s)
    if res.returncode != 0 or not policy.is_dir():
        raise SystemExit(f"cold start of task {task.name} failed (rc={res.returncode}); see "
                         f"{out.parent / (task.name + '.log')}")
    _write_cost(out, res)
    return policy


def run_dir(work: Path, spec: RunSpec) -> Path:
    return work / "runs" / spec.key


def run_overrides(grid: Grid, spec: RunSpec, init: Path) -> list[str]:
    """The key=value overrides of one run: task, start, budget, seed, beta, reference."""
    s = spec.seed
    return [f"arithmetic.digits={spec.task.digits}", f"arithmetic.num_eval={grid.num_eval}",
            f"run.init={init}",
            f"run.steps={grid.steps}", f"eval.every={grid.eval_every}",
            f"run.seed={s}", f"rollout.seed={s}", f"data.seed={s}", f"algo.beta={spec.beta}",
            *spec.variant.overrides, *grid.extra]


def run_one(grid: Grid, spec: RunSpec, work: Path, timeout_s: float) -> str:
    """Runs `spec` unless its summary exists; returns a one-line status."""
    out = run_dir(work, spec)
    if (out / "summary.json").exists():
        return f"{spec.key}: done earlier"
    init = cold_start_dir(work, spec.task) / "checkpoints" / "step_000000" / "policy"
    # the console log lies beside out_dir (megagrpo refuses an out_dir holding foreign files)
    # and claims the run: several study processes can share a grid without running one twice
    log = out.parent / f"{out.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        log.open("x").close()
    except FileExistsError:
        return f"{spec.key}: skipped, claimed by {log} (--rerun-unfinished to run it again)"
    res = _megagrpo(run_overrides(grid, spec, init), out, log, timeout_s)
    if res.returncode != 0:
        return f"{spec.key}: FAILED rc={res.returncode} (see {log})"
    _write_cost(out, res)
    return f"{spec.key}: ok in {res.wall_s:.0f} s wall, {res.cpu_s:.0f} s CPU"


def _write_cost(out: Path, res: Launch) -> None:
    (out / COST_FILE).write_text(json.dumps({"wall_s": res.wall_s, "cpu_s": res.cpu_s}))


def release_unfinished(grid: Grid, work: Path) -> list[str]:
    """Removes the claims (console logs) of runs that have no summary: a failed or interrupted
    run then runs again. Only while no other study process works on `work`."""
    released = []
    for spec in run_specs(grid):
        out = run_dir(work, spec)
        log = out.parent / f"{out.name}.log"
        if log.exists() and not (out / "summary.json").exists():
            log.unlink()
            released.append(spec.key)
    return released


def run_grid(grid: Grid, work: Path, jobs: int, timeout_s: float) -> None:
    """Cold starts first (one per task, in parallel), then every run, `jobs` at a time."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(lambda t: run_cold_start(grid, t, work, timeout_s), grid.tasks))
        print(f"cold starts ready after {time.perf_counter() - t0:.0f} s", flush=True)
        specs = run_specs(grid)
        for i, line in enumerate(pool.map(lambda s: run_one(grid, s, work, timeout_s), specs)):
            print(f"[{i + 1}/{len(specs)}] {line}", flush=True)
    print(f"grid finished in {time.perf_counter() - t0:.0f} s", flush=True)


# ---------------------------------------------------------------------------- reading runs
@dataclass
class RunResult:
    """What one finished run recorded in its metrics.jsonl and summary.json."""

    key: str
    task: str
    beta: float
    variant: str
    seed: int
    accuracy_before: float
    accuracy_after: float
    eval_steps: list[int] = field(default_factory=list)
    eval_accuracy: list[float] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    reward: list[float] = field(default_factory=list)
    resets: list[int] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float = 0.0


def read_run(spec: RunSpec, out: Path) -> RunResult:
    """The curves of one run: held-out accuracy per evaluation, KL and reward per step, and the
    steps after which the reference was re-initialised (`reference_sync` non-empty)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    summary = json.loads((out / "summary.json").read_text())
    cost = json.loads((out / COST_FILE).read_text()) if (out / COST_FILE).exists() else {}
    steps = [r for r in records if "reward_mean" in r]
    evals = [r for r in records if "eval_accuracy" in r]
    return RunResult(
        key=spec.key, task=spec.task.name, beta=spec.beta, variant=spec.variant.name,
        seed=spec.seed, accuracy_before=summary["eval_accuracy_before"],
        accuracy_after=summary["eval_accuracy_after"],
        eval_steps=[r["step"] for r in evals], eval_accuracy=[r["eval_accuracy"] for r in evals],
        steps=[r["step"] for r in steps], kl=[r["kl"] for r in steps],
        reward=[r["reward_mean"] for r in steps],
        resets=[r["step"] for r in steps if r.get("reference_sync")],
        wall_s=cost.get("wall_s", summary["wall_seconds"]), cpu_s=cost.get("cpu_s", 0.0))


def read_results(grid: Grid, work: Path) -> tuple[list[RunResult], list[str]]:
    """Every finished run of the grid, and the keys of those that did not finish."""
    done, missing = [], []
    for spec in run_specs(grid):
        out = run_dir(work, spec)
        if (out / "summary.json").exists():
            done.append(read_run(spec, out))
        else:
            missing.append(spec.key)
    return done, missing


# ---------------------------------------------------------------------------- summarising
@dataclass
class Cell:
    """One (task, beta, treatment) over its seeds."""

    task: str
    beta: float
    variant: str
    n: int
    acc_mean: float
    acc_std: float
    acc_min: float
    acc_max: float
    start_mean: float
    kl_mean: float
    resets_mean: float


def _std(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def cells(results: list[RunResult]) -> list[Cell]:
    """Final held-out accuracy (mean, sample std, min, max over seeds), the accuracy before
    GRPO, the mean per-step KL to the reference and the number of resets, per cell; in the
    order the runs were listed."""
    groups: dict[tuple[str, float, str], list[RunResult]] = {}
    for r in results:
        groups.setdefault((r.task, r.beta, r.variant), []).append(r)
    out = []
    for (task, beta, variant), rs in groups.items():
        acc = [r.accuracy_after for r in rs]
        out.append(Cell(
            task=task, beta=beta, variant=variant, n=len(rs), acc_mean=statistics.fmean(acc),
            acc_std=_std(acc), acc_min=min(acc), acc_max=max(acc),
            start_mean=statistics.fmean(r.accuracy_before for r in rs),
            kl_mean=statistics.fmean(statistics.fmean(r.kl) if r.kl else 0.0 for r in rs),
            resets_mean=statistics.fmean(len(r.resets) for r in rs)))
    return out


def comparisons(table: list[Cell], results: list[RunResult], num_eval: int) -> list[str]:
    """Each treatment against the frozen reference at the same task and beta (no_ref against
    both betas' frozen runs). A difference counts only when it exceeds the larger of the two
    cells' seed std and one held-out problem (1 / num_eval: the accuracy's resolution);
    otherwise it is reported as within the spread. The per-seed (paired)
    differences are listed too: a seed's runs share the cold start and, until their references
    differ, the same rollouts."""
    final = {(r.task, r.beta, r.variant, r.seed): r.accuracy_after for r in results}
    lines = []
    frozen = {(c.task, c.beta): c for c in table if c.variant == "frozen"}
    for c in table:
        if c.variant == "frozen":
            continue
        refs = [f for (t, b), f in frozen.items() if t == c.task and (b == c.beta or c.beta == 0)]
        for f in refs:
            diff, spread = c.acc_mean - f.acc_mean, max(c.acc_std, f.acc_std, 1 / num_eval)
            verdict = ("higher" if diff > 0 else "lower") if abs(diff) > spread else \
                "no difference beyond the spread"
            paired = [final[c.task, c.beta, c.variant, s] - final[f.task, f.beta, "frozen", s]
                      for s in sorted({k[3] for k in final})
                      if (c.task, c.beta, c.variant, s) in final
                      and (f.task, f.beta, "frozen", s) in final]
            lines.append(f"{c.task}, {c.variant} (beta={c.beta:g}) vs frozen (beta={f.beta:g}): "
                         f"{diff:+.3f} accuracy (spread {spread:.3f}): {verdict}; per seed "
                         + ", ".join(f"{d:+.3f}" for d in paired))
    return lines


def table_markdown(table: list[Cell], labels: dict[str, str]) -> str:
    """The results table: one row per cell."""
    head = ("| task | beta | reference | seeds | held-out accuracy after (mean +- std) | min - max "
            "| before GRPO | mean KL | resets |\n|---|---|---|---|---|---|---|---|---|\n")
    rows = [f"| {c.task} | {c.beta:g} | {labels.get(c.variant, c.variant)} | {c.n} | "
            f"{c.acc_mean:.3f} +- {c.acc_std:.3f} | {c.acc_min:.3f} - {c.acc_max:.3f} | "
            f"{c.start_mean:.3f} | {c.kl_mean:.4f} | {c.resets_mean:g} |" for c in table]
    return head + "\n".join(rows) + "\n"


def _mean_curve(runs: list[RunResult], xs: str, ys: str) -> tuple[list[int], list[float],
                                                                     list[float], list[float]]:
    """Steps, mean, min and max over the runs of one curve (the runs share their steps)."""
    steps = getattr(runs[0], xs)
    cols = list(zip(*(getattr(r, ys) for r in runs)))
    return (steps, [statistics.fmean(c) for c in cols], [min(c) for c in cols],
            [max(c) for c in cols])


def plot_cell_group(results: list[RunResult], task: str, beta: float, path: Path) -> None:
    """Held-out accuracy (mean over seeds, min-max band) and KL to the reference (mean over
    seeds) against step for every treatment at (task, beta); the beta=0 runs join both betas.
    A marker on a KL curve is a step after which some seed re-initialised its reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_kl) = plt.subplots(1, 2, figsize=(12, 4.2))
    names = dict.fromkeys(r.variant for r in results)
    for i, name in enumerate(names):
        runs = [r for r in results if r.task == task and r.variant == name
                and (r.beta == beta or r.beta == 0.0)]
        if not runs:
            continue
        color = f"C{i}"
        s, m, lo, hi = _mean_curve(runs, "eval_steps", "eval_accuracy")
        ax_acc.plot(s, m, color=color, marker=".", label=name)
        ax_acc.fill_between(s, lo, hi, color=color, alpha=0.15)
        if runs[0].beta == 0.0:
            continue  # no reference: no KL
        s, m, _, _ = _mean_curve(runs, "steps", "kl")
        ax_kl.plot(s, m, color=color, lw=1.2, label=name)
        resets = sorted({x for r in runs for x in r.resets})
        ax_kl.plot(resets, [m[s.index(x)] for x in resets], "v", color=color, ms=5)
    ax_acc.set(title=f"{task}, beta={beta:g}: held-out greedy accuracy (band: seeds min-max)",
               xlabel="GRPO step", ylabel="accuracy")
    ax_kl.set(title="KL to the reference (mean over seeds; v = reset)", xlabel="GRPO step",
              ylabel="per-token KL (k3)")
    ax_kl.set_yscale("symlog", linthresh=1e-3)
    for ax in (ax_acc, ax_kl):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a task whose runs did not finish has none
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(grid: Grid, work: Path, out: Path) -> dict:
    """runs.json, table.md, the figures and REPORT.md from the finished runs in `work`."""
    results, missing = read_results(grid, work)
    if not results:
        raise SystemExit(f"no finished run under {work}/runs: run the study first")
    out.mkdir(parents=True, exist_ok=True)
    labels = {v.name: v.label for v in grid.variants}
    table = cells(results)
    colds = {t.name: _cold_summary(work, t) for t in grid.tasks}
    (out / "runs.json").write_text(json.dumps(
        {"grid": asdict(grid), "cold_starts": colds, "missing": missing,
         "runs": [asdict(r) for r in results]}, indent=1))
    (out / "table.md").write_text(table_markdown(table, labels))
    figures = []
    for task in grid.tasks:
        for beta in grid.betas:
            path = out / f"curves_{task.name}_beta{beta:g}.png"
            plot_cell_group(results, task.name, beta, path)
            figures.append(path.name)
    report = _report(grid, table, labels, colds, results, missing, figures)
    (out / "REPORT.md").write_text(report)
    return {"runs": len(results), "missing": missing, "figures": figures}


def _cold_summary(work: Path, task: Task) -> dict:
    d = cold_start_dir(work, task)
    summary = json.loads((d / "summary.json").read_text())
    cost = json.loads((d / COST_FILE).read_text()) if (d / COST_FILE).exists() else {}
    return {"label": task.label, "sft_steps": task.sft_steps,
            "accuracy": summary["eval_accuracy_before"], "cpu_s": cost.get("cpu_s")}


def _report(grid: Grid, table: list[Cell], labels: dict[str, str], colds: dict,
            results: list[RunResult], missing: list[str], figures: list[str]) -> str:
    """The generated write-up: what ran, at what cost, the table, the figures, and each
    treatment against the frozen reference by the spread rule of `comparisons`."""
    cpu = sum(r.cpu_s for r in results)
    cold_cpu = [c["cpu_s"] for c in colds.values()]
    cold_note = (f"cold starts {sum(cold_cpu):.0f} CPU s" if None not in cold_cpu else
                 "cold starts not measured: run before this study process")
    lines = [
        "# Iterative GRPO study (generated by examples/iterative_study/study.py)", "",
        f"{len(results)} runs finished, {len(missing)} missing"
        + (f" ({', '.join(missing)})" if missing else "") + f"; {grid.steps} GRPO steps per "
        f"run, held-out greedy accuracy every {grid.eval_every} steps; seeds {list(grid.seeds)}; "
        f"GRPO runs {cpu:.0f} CPU s in all, {cold_note}.", "",
        "Cold starts (shared by every run of their task):", ""]
    lines += [f"- {name}: {c['label']}, {c['sft_steps']} supervised steps, held-out accuracy "
              f"{c['accuracy']:.3f}" for name, c in colds.items()]
    lines += ["", "Reference treatments:", ""]
    lines += [f"- `{v.name}`: {v.label}" for v in grid.variants]
    lines += ["", table_markdown(table, labels), ""]
    lines += [f"![{f}]({f})" for f in figures]
    lines += ["", "Against the frozen reference (a difference counts only beyond the larger "
              f"seed std of the two cells and one held-out problem, 1/{grid.num_eval}):", ""]
    lines += [f"- {c}" for c in comparisons(table, results, grid.num_eval)]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the small grid (a few minutes)")
    ap.add_argument("--work", type=Path, default=None,
                    help="where the runs go (default runs/iterative_study[_quick])")
    ap.add_argument("--out", type=Path, default=None,
                    help="tables, figures, report (default examples/iterative_study/results, "
                         "or WORK/results with --quick)")
    ap.add_argument("--jobs", type=int, default=2,
                    help="runs at once, one thread each (default: one per core of 2)")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="limit per run")
    ap.add_argument("--rerun-unfinished", action="store_true",
                    help="run again the runs an earlier study process started but did not "
                         "finish (only when no other study process is running on WORK)")
    ap.add_argument("--report-only", action="store_true",
                    help="only summarise the runs already finished in WORK")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error(f"--jobs={args.jobs}: need >= 1")
    grid = quick_grid() if args.quick else full_grid()
    work = (args.work or ROOT / "runs" / ("iterative_study_quick" if args.quick
                                          else "iterative_study")).resolve()
    out = (args.out or (work / "results" if args.quick else HERE / "results")).resolve()
    if args.rerun_unfinished:
        print(f"released {len(release_unfinished(grid, work))} unfinished runs")
    if not args.report_only:
        run_grid(grid, work, args.jobs, args.timeout_s)
    done = write_outputs(grid, work, out)
    print(f"{done['runs']} runs summarised in {out} ({len(done['missing'])} missing)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
