"""examples/iterative_study/study.py (issue 12): its --quick grid runs for real (a cold start,
then 3 one-rank megagrpo runs, all at once), and what it writes (table.md, runs.json, the PNGs,
REPORT.md) is checked against the metrics.jsonl / summary.json each run wrote, recomputed here
independently, both for those runs and for a copy of them given a second seed (the statistics
over seeds); plus the design of the full grid (every run gets the same compute)."""
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "iterative_study" / "study.py"


def _study():
    spec = importlib.util.spec_from_file_location("iterative_study", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["iterative_study"] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


# the --quick grid's real runs (~50 s on 2 cores) are heavy; the grid's design and the claim
# protocol are checked by default
@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    work = tmp_path_factory.mktemp("study")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--work", str(work), "--out",
                        str(work / "results"), "--jobs", "3"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    return work


@pytest.fixture(scope="module")
def two_seeds(quick, tmp_path_factory):
    """The quick study's runs with a second seed beside each (the seed's files with its held-out
    accuracies raised halfway to 1 and its KLs doubled: another seed's numbers, as far as the
    summaries go), summarised by the study in-process: its statistics over seeds (mean +- std,
    min - max, the runs' order in runs.json) get two different values to combine, without 3
    more runs."""
    study = _study()
    (seed,) = study.quick_grid().seeds
    work = tmp_path_factory.mktemp("study2")
    for part in ("runs", "cold_start"):
        shutil.copytree(quick / part, work / part)
    for run in work.glob(f"runs/*/*/*/seed{seed}"):
        seed2 = run.with_name(f"seed{seed + 1}")
        shutil.copytree(run, seed2)
        recs = _records(seed2)
        for r in recs:
            if "eval_accuracy" in r:
                r["eval_accuracy"] = (r["eval_accuracy"] + 1) / 2
            if "kl" in r:
                r["kl"] *= 2
        (seed2 / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        summary = json.loads((seed2 / "summary.json").read_text())
        summary["eval_accuracy_after"] = [r["eval_accuracy"] for r in recs
                                          if "eval_accuracy" in r][-1]
        (seed2 / "summary.json").write_text(json.dumps(summary))
    done = study.write_outputs(replace(study.quick_grid(), seeds=(seed, seed + 1)), work,
                               work / "results")
    assert done["runs"] == 6 and not done["missing"], done
    return work


def _records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _runs(work: Path) -> dict[tuple[str, str, str], list[Path]]:
    """Run dirs by (task, beta, variant), from the layout runs/<task>/beta<b>/<variant>/seed<s>."""
    out: dict[tuple[str, str, str], list[Path]] = {}
    for summary in sorted((work / "runs").glob("*/*/*/seed*/summary.json")):
        task, beta, variant = summary.parent.parts[-4:-1]
        out.setdefault((task, beta.removeprefix("beta"), variant), []).append(summary.parent)
    return out


def _table_rows(path: Path) -> list[list[str]]:
    lines = [x for x in path.read_text().splitlines() if x.startswith("|")][2:]
    return [[c.strip() for c in x.strip("|").split("|")] for x in lines]


@pytest.mark.heavy
def test_quick_grid_ran_every_run_from_the_shared_cold_start(quick):
    grid = _study().quick_grid()
    runs = _runs(quick)
    assert sum(len(v) for v in runs.values()) == len(_study().run_specs(grid)) == 3
    cold = json.loads((quick / "cold_start" / "easy" / "summary.json").read_text())
    for dirs in runs.values():
        for d in dirs:
            s = json.loads((d / "summary.json").read_text())
            assert s["steps"] == grid.steps
            # run.init is the cold start: greedy accuracy before GRPO is the cold start's
            assert s["eval_accuracy_before"] == cold["eval_accuracy_before"]


@pytest.mark.heavy
@pytest.mark.parametrize("study", ["quick", "two_seeds"])
def test_table_matches_the_runs_metrics(study, request):
    work = request.getfixturevalue(study)
    rows = _table_rows(work / "results" / "table.md")
    runs = _runs(work)
    labels = {v.name: v.label for v in _study().quick_grid().variants}
    assert len(rows) == len(runs) == 3
    for task, beta, variant in runs:
        row = next(r for r in rows if r[:3] == [task, beta, labels[variant]])
        finals, resets, kls = [], [], []
        for d in runs[task, beta, variant]:
            recs = _records(d)
            finals.append([r["eval_accuracy"] for r in recs if "eval_accuracy" in r][-1])
            steps = [r for r in recs if "reward_mean" in r]
            resets.append(sum(1 for r in steps if r.get("reference_sync")))
            kls.append(sum(r["kl"] for r in steps) / len(steps))
        assert len(finals) == (2 if study == "two_seeds" else 1)
        mean = sum(finals) / len(finals)
        std = math.sqrt(sum((x - mean) ** 2 for x in finals) / max(1, len(finals) - 1))
        assert row[3] == str(len(finals))
        assert row[4] == f"{mean:.3f} +- {std:.3f}"
        assert row[5] == f"{min(finals):.3f} - {max(finals):.3f}"
        assert abs(float(row[7]) - sum(kls) / len(kls)) < 1e-4
        assert float(row[8]) == sum(resets) / len(resets)


def _steps(run: Path) -> list[dict]:
    return [r for r in _records(run) if "reward_mean" in r]


@pytest.mark.heavy
def test_reset_schedules_in_the_metrics(quick):
    grid = _study().quick_grid()
    for (_, _, variant), dirs in _runs(quick).items():
        for d in dirs:
            steps = _steps(d)
            resets = [r["step"] for r in steps if r.get("reference_sync")]
            assert resets == (list(range(2, grid.steps + 1, 2)) if variant == "reset" else [])
            if variant == "no_ref":  # beta = 0 builds no reference
                assert all(r["kl"] == 0.0 for r in steps)
            # one minibatch per step: KL is measured before the step's update, so on the step
            # after a reset the policy is the reference and the KL is exactly zero
            for s in resets[:-1]:
                assert steps[s]["kl"] == 0.0, (d, s)


@pytest.mark.heavy
def test_treatments_share_rollouts_until_the_reference_differs(quick):
    """Same seed, same cold start: the treatments sample the same completions until their
    references differ (reset at K=2 -> the updates of step K+1 on), so the comparison is paired."""
    runs = _runs(quick)
    for i in range(len(_study().quick_grid().seeds)):
        frozen, reset = _steps(runs["easy", "0.04", "frozen"][i]), _steps(
            runs["easy", "0.04", "reset"][i])
        no_ref = _steps(runs["easy", "0", "no_ref"][i])
        assert [r["reward_mean"] for r in frozen[:3]] == [r["reward_mean"] for r in reset[:3]]
        assert [r["kl"] for r in frozen[:2]] == [r["kl"] for r in reset[:2]]
        assert frozen[0]["reward_mean"] == no_ref[0]["reward_mean"]


@pytest.mark.heavy
@pytest.mark.parametrize("study", ["quick", "two_seeds"])
def test_runs_json_figures_and_report(study, request):
    from matplotlib.image import imread

    work = request.getfixturevalue(study)
    res = work / "results"
    data = json.loads((res / "runs.json").read_text())
    runs = _runs(work)
    assert len(data["runs"]) == sum(len(v) for v in runs.values())
    for r in data["runs"]:
        (d,) = [x for x in runs[r["task"], f"{r['beta']:g}", r["variant"]]
                if x.name == f"seed{r['seed']}"]
        steps = [x for x in _records(d) if "reward_mean" in x]
        assert r["kl"] == [x["kl"] for x in steps]
        assert r["cpu_s"] > 0
    png = res / "curves_easy_beta0.04.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert imread(png).shape[0] > 100
    report = (res / "REPORT.md").read_text()
    assert (res / "table.md").read_text() in report and "curves_easy_beta0.04.png" in report
    assert report.count(" vs frozen ") == 2  # reset and no_ref, each against frozen


def test_full_grid_gives_every_run_the_same_compute():
    study = _study()
    grid = study.full_grid()
    specs = study.run_specs(grid)
    assert len(specs) == 2 * (5 * 2 + 1) * 3 == 66
    assert len(grid.seeds) >= 3 and 0.04 in grid.betas and max(grid.betas) > 0.04
    init = Path("/cold")
    for task in grid.tasks:
        mine = [s for s in specs if s.task == task]
        stripped = {tuple(o for o in study.run_overrides(grid, s, init)
                          if not o.startswith(("reference.", "algo.beta=", "run.seed=",
                                               "rollout.seed=", "data.seed=")))
                    for s in mine}
        assert len(stripped) == 1, stripped  # only the reference treatment and seed differ


def test_a_claimed_run_is_not_started_twice_and_can_be_released(tmp_path):
    study = _study()
    grid = study.quick_grid()
    spec = study.run_specs(grid)[0]
    out = study.run_dir(tmp_path, spec)
    claim = out.parent / f"{out.name}.log"
    claim.parent.mkdir(parents=True)
    claim.write_text("started by another study process\n")
    assert "skipped, claimed" in study.run_one(grid, spec, tmp_path, timeout_s=1)
    assert not out.exists()  # nothing was launched
    assert study.release_unfinished(grid, tmp_path) == [spec.key]
    assert not claim.exists()
