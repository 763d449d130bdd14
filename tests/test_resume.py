"""Resuming, failures and safe loading.

End to end (real `python -m megagrpo train` launches, 2 ranks, vLLM, see
scripts/resume_stress.py): a run whose launcher is SIGKILLed mid-step takes torchrun and its
ranks down with it; resumed (its newest checkpoint damaged, a crafted pickle planted) it falls
back to the older intact checkpoint, never unpickles the plant, and ends bitwise equal to the
uninterrupted run with one metrics history (with the distributed optimizer and async rollouts,
in fp32 and in bf16, the latter on CPUs with native bf16: tests.support.bf16; `-m heavy` adds
the plain synchronous run, multi-turn runs sync and async, and LoRA with the adapter refit,
the merged one, and the merged one in bf16); beside them the same job under
torchrun's elastic agent (`--max-restarts 1`), whose rank 1 SIGKILLs itself mid-run, is
restarted by the agent and resumes on its own, bitwise. Optimizer state reshards: saved at
TP=2, PP=2 or DP=2 and loaded at another layout, the moments are the saved ones and the next
step agrees with the uninterrupted run (tests/_layout_resume_worker.py). A
non-empty out_dir is refused before anything starts. Out of disk says so and leaves the earlier
checkpoint intact (a simulated full disk, tests/_resume_worker.py). The rest are unit tests of
the manifest, the pickle-free state files and the metrics rewind.

"""
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megagrpo.checkpoint import load_tree, save_tree
from megagrpo.runtime.metrics import rewind_history
from megagrpo.runtime.run_dir import (
    MANIFEST,
    Attempt,
    newest_intact,
    prepare_out_dir,
    restarts_own_run,
    verify,
    write_manifest,
)
from tests._fault_hooks import DIE_ENV
from tests.support.bf16 import needs_fast_bf16
from tests.support.cli import run_cli
from tests.support.launch import alive, run_ranks_results

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import resume_stress as stress  # noqa: E402 - the stress script shares its harness

STEPS = 6  # checkpoints at 2, 4, 6
# the kill-and-resume runs: a checkpoint every step, killed in step 4 once step 3's is complete,
# resumed from step 2 (step 3's damaged), so steps 3 and 4 run again; LoRA keeps 6 (its merges)
E2E = {"steps": 4, "kill_after": 3, "every": ("checkpoint.every=1",)}
E2E_LORA = {"steps": STEPS, "kill_after": 4, "every": ()}
# the default mode's fixture also runs the job under torchrun's elastic agent (--max-restarts 1)
# with rank 1 killing itself once step 2's checkpoint is complete
ELASTIC_MODE, ELASTIC_DIE_AFTER = "distopt+async", 2


class Plant:
    """Unpickling this creates `path`: proof that a pickle was executed."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def damage(cut: Path, marker: Path) -> tuple[Path, Path]:
    """Truncates a policy shard of the newest checkpoint and plants, in the one before, crafted
    pickles where older megagrpo kept optimizer state. Returns (newest, older): the two newest
    complete checkpoints (the kill can land while the next one is being written: that one has no
    manifest and is passed over on resume)."""
    done = [p for p in sorted((cut / "checkpoints").glob("step_*")) if (p / MANIFEST).exists()]
    newest, older = done[-2:][::-1]
    shard = next((newest / "policy").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-16])
    for rank in range(2):
        with (older / "optimizer" / f"rank{rank:05d}.pt").open("wb") as f:
            pickle.dump(Plant(str(marker)), f)
    return newest, older


def kill_run(proc: subprocess.Popen) -> tuple[set[int], list[int]]:
    """SIGKILLs a run's launcher alone (torchrun and its ranks must follow); returns (what ran
    below it, what of it is still alive after 60 s)."""
    below = stress.descendants(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    t0 = time.monotonic()
    while any(alive(p) for p in below) and time.monotonic() - t0 < 60:
        time.sleep(0.2)
    return below, [p for p in below if alive(p)]


@pytest.fixture(scope="module", params=[
    "distopt+async", pytest.param("distopt+async+bf16", marks=pytest.mark.heavy),
    pytest.param("sync", marks=pytest.mark.heavy),
    pytest.param("agent", marks=pytest.mark.heavy),
    pytest.param("agent+async", marks=pytest.mark.heavy),
    pytest.param("lora", marks=pytest.mark.heavy),
    pytest.param("lora+merged", marks=pytest.mark.heavy),
    pytest.param("lora+merged+bf16", marks=pytest.mark.heavy), "separate"])
def e2e(request, tmp_path_factory):
    """The uninterrupted run and the interrupted one run side by side (DP=2; by default with
    the distributed optimizer and async rollouts, the configuration with the most state: the
    sharded Adam moments, the batch drawn ahead on the side thread and its generator; `-m
    heavy` adds the same in bf16, the plain synchronous run and multi-turn runs, sync and
    async: killed inside a multi-turn step; tests/test_agent_resume.py checks their pending
    batch by default). The
    interrupted run's launcher is SIGKILLed once step 4's checkpoint is complete (in step 5);
    its checkpoints are damaged and it is resumed (from step 2: its checkpoint holds the async
    batch for step 3) while the uninterrupted run finishes: 4 steps, a checkpoint every step,
    killed in step 4 once step 3's checkpoint is complete. LoRA (6 steps, a checkpoint every
    step, a merge after steps 3 and 6): killed in step 5, resumed from step 3, whose
    checkpoint wrote the base, then killed again in step 6 and resumed from step 5, whose
    checkpoint names the base step 3 wrote."""
    if request.param.endswith("+bf16"):
        needs_fast_bf16()
    lora = request.param.startswith("lora")
    plan = E2E_LORA if lora else E2E
    extra, steps = (*stress.MODES[request.param], *plan["every"]), plan["steps"]
    work = tmp_path_factory.mktemp("resume")
    ref, cut, marker = work / "uninterrupted", work / "interrupted", work / "pickle_was_run"
    ref_proc = stress.launch(ref, steps, work / "uninterrupted.log", *extra)
    proc = stress.launch(cut, steps, work / "interrupted.log", *extra)
    elastic = elastic_proc = None
    if request.param == ELASTIC_MODE:  # beside them: a rank dies, torchrun restarts the job
        elastic = work / "elastic"
        die = elastic / "checkpoints" / f"step_{ELASTIC_DIE_AFTER:06d}" / "manifest.json"
        elastic_proc = stress.launch(elastic, steps, work / "elastic.log", *extra,
                                     "--max-restarts", "1", env={DIE_ENV: f"1:{die}"})
    below: set[int] = set()
    try:
        stress.wait_for_step(proc, cut, plan["kill_after"], checkpoint=True)
        below, orphans = kill_run(proc)
        newest, older = damage(cut, marker)
        last_log = work / "resumed.log"
        resumed = stress.launch(cut, steps, last_log, *extra)
        if lora:  # again, now from a checkpoint without the base
            stress.wait_for_step(resumed, cut, 5, checkpoint=True)
            again, left = kill_run(resumed)
            below, orphans = below | again, orphans + left
            last_log = work / "resumed_again.log"
            resumed = stress.launch(cut, steps, last_log, *extra)
        stress.finish(resumed, last_log)
        stress.finish(ref_proc, work / "uninterrupted.log")
        if elastic_proc is not None:
            stress.finish(elastic_proc, work / "elastic.log")
    finally:  # never leave processes behind, whatever failed
        for p in below:
            if alive(p):
                os.kill(p, signal.SIGKILL)
        for p in (ref_proc, elastic_proc):
            if p is not None and p.poll() is None:
                stress.kill_tree(p)
    return {"ref": ref, "cut": cut, "below": below, "orphans": orphans, "newest": newest,
            "older": older, "marker": marker, "log": (work / "resumed.log").read_text(),
            "mode": request.param, "steps": steps, "elastic": elastic}


def test_killed_launcher_takes_torchrun_and_ranks_down(e2e):
    assert len(e2e["below"]) >= 3, e2e["below"]  # torchrun and two ranks were running
    assert e2e["orphans"] == []


def test_resume_skips_damaged_checkpoint_and_never_unpickles(e2e):
    log, newest, older = e2e["log"], e2e["newest"], e2e["older"]
    assert f"checkpoint {newest} is broken" in log and "bytes, the manifest says" in log
    assert f"resumed from {older} at step {int(older.name[5:])}" in log
    assert not e2e["marker"].exists()


def test_resumed_run_is_bitwise_the_uninterrupted_run(e2e):
    ref, cut = e2e["ref"], e2e["cut"]
    assert stress.compare(ref, cut, stress.NEAR.get(e2e["mode"])) == []
    steps = [r["step"] for r in stress.history(cut) if "reward_mean" in r]
    assert steps == list(range(1, e2e["steps"] + 1))  # one history, no repeated steps
    assert int(e2e["older"].name[5:]) <= e2e["steps"] - 2  # resumed mid-run: 2+ steps again
    state = stress.final_state(cut)
    assert len(state) > 20  # policy, reference and optimizer tensors were compared
    # the reference model, or LoRA's frozen base (the reference is the adapters off)
    lora = e2e["mode"].startswith("lora")
    assert any(k.startswith("base." if lora else "reference.") for k in state)
    assert stress.trainer_state(cut)["step"] == e2e["steps"]  # and the trainer state
    assert any(".exp_avg_sq." in k for k in state) and any(k.startswith("rng.") for k in state)
    if e2e["mode"].endswith("+bf16"):  # bf16 weights, fp32 main copies and moments, bitwise
        dtypes = {k.split(".")[0]: v.dtype for k, v in state.items() if k.endswith("weight")}
        assert dtypes["base" if lora else "policy"] == torch.bfloat16, dtypes
        if lora:  # the policy part is the adapters
            assert {v.dtype for k, v in state.items() if k.startswith("policy.")} == {
                torch.bfloat16}
        assert {v.dtype for k, v in state.items() if ".exp_avg_sq." in k} == {torch.float32}
    if "run.async_rollout=true" in stress.MODES[e2e["mode"]]:  # the batch drawn ahead, too
        assert any(k.startswith("rollout.") and ".token_ids." in k for k in state)
    if e2e["mode"] == "separate":  # the rollout rank's sampler streams, from its checkpoint
        assert any(k.startswith("rollout_ranks.rank00000.rollout_ranks.0.rng.") for k in state)
    if e2e["mode"].startswith("agent"):  # multi-turn steps were run and resumed
        assert max(r["turns"] for r in stress.history(cut) if "reward_mean" in r) > 1
        if "run.async_rollout=true" in stress.MODES[e2e["mode"]]:  # environment tokens' holes
            assert any(k.startswith("rollout.") and ".loss_mask." in k for k in state)


@pytest.mark.parametrize("e2e", [ELASTIC_MODE], indirect=True)  # the same runs
def test_torchrun_restarts_a_killed_rank_and_the_run_resumes_bitwise(e2e):
    """`train --max-restarts 1` (torchrun's elastic agent): rank 1 SIGKILLs itself once step
    2's checkpoint is complete; the agent restarts both ranks with the same command, which
    resumes from the job's newest intact checkpoint on its own and finishes bitwise equal to
    the uninterrupted run, saying so on the console, in metrics.jsonl and in summary.json, and
    leaves no process behind."""
    run, log = e2e["elastic"], (e2e["elastic"].parent / "elastic.log").read_text()
    assert "failed (exitcode: -9) local_rank: 1" in log, log[-4000:]  # torchrun saw the kill
    said = [line for line in log.splitlines() if "torchrun restart 1 of at most 1 (job " in line]
    assert said and "resuming from its newest intact checkpoint" in said[0], log[-4000:]
    marks = stress.restarts(run)
    assert len(marks) == 1 and marks[0]["restart"] == 1, marks
    assert ELASTIC_DIE_AFTER <= marks[0]["resumed_from_step"] == marks[0]["step"] < e2e["steps"]
    assert json.loads((run / "summary.json").read_text())["restarts"] == 1
    assert stress.compare(e2e["ref"], run) == []
    steps = [r["step"] for r in stress.history(run) if "reward_mean" in r]
    assert steps == list(range(1, e2e["steps"] + 1))
    assert stress.leftovers(str(run)) == []


@pytest.mark.heavy  # the LoRA runs are heavy; the default run's mode has no base to check
@pytest.mark.parametrize("e2e", ["lora", "lora+merged", "lora+merged+bf16"],
                         indirect=True)  # the same runs
def test_lora_resumes_with_and_without_the_base(e2e):
    """LoRA: the base is in a checkpoint only after a merge (and in the first one); the run
    resumed bitwise (above) from step 3, whose checkpoint wrote the base, and from step 5,
    whose checkpoint names the one step 3 wrote; the kept checkpoints keep theirs."""
    from megagrpo.runtime.run_dir import refs_of

    root = e2e["cut"] / "checkpoints"
    assert "at step 3" in e2e["log"]
    again = (e2e["cut"].parent / "resumed_again.log").read_text()
    assert f"resumed from {root / 'step_000005'} at step 5" in again, again[-3000:]
    # keep_last=3: steps 4, 5 and 6; 4 and 5 name step 3's base, 6 wrote its own
    assert [p.name for p in sorted(root.iterdir())] == [
        "base_000001", "base_000002", "step_000004", "step_000005", "step_000006"]
    assert [refs_of(root / f"step_00000{s}") for s in (4, 5, 6)] == [
        {"base": "../base_000001"}] * 2 + [{"base": "../base_000002"}]
    adapters, base = (_dcp_tensors(root / f) for f in ("step_000005/policy", "base_000001"))
    assert adapters and all(".lora_" in k for k in adapters), sorted(adapters)[:4]
    assert base and not any(".lora_" in k for k in base), sorted(base)[:4]
    ref_root = e2e["ref"] / "checkpoints"
    assert sorted(p.name for p in ref_root.iterdir()) == sorted(p.name for p in root.iterdir())


def _train_cli(*overrides: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return run_cli("train", "--nproc", "2", *stress.tiny_overrides(Path("unused"), 2),
                   *overrides, cwd=ROOT, timeout=timeout)


def test_non_empty_out_dir_refused_before_anything_starts(tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    (old / "metrics.jsonl").write_text('{"step": 1}\n')
    p = _train_cli(f"run.out_dir={old}", "run.resume=false")
    assert p.returncode == 2, p.stderr[-3000:]
    assert "is not empty" in p.stderr and "run.overwrite=true" in p.stderr
    assert "torch.distributed.run" not in p.stderr and not (old / "engine").exists()
    assert (old / "metrics.jsonl").read_text() == '{"step": 1}\n'
    # resume=true with only a broken checkpoint: refused, naming it
    (old / "checkpoints" / "step_000004").mkdir(parents=True)
    p = _train_cli(f"run.out_dir={old}", "run.resume=true")
    assert p.returncode == 2 and "step_000004: no manifest.json" in p.stderr, p.stderr[-3000:]


def test_overwrite_clears_only_a_run_directory(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    prepare_out_dir(str(run), resume=False, overwrite=True, rank=1)  # not rank 0: no delete
    assert (run / "metrics.jsonl").exists()
    prepare_out_dir(str(run), resume=False, overwrite=True, rank=0)
    assert [p.name for p in run.iterdir()] == [".megagrpo-run"]
    prepare_out_dir(str(run), resume=False, overwrite=False)  # the marker alone is no run
    other = tmp_path / "notes"
    other.mkdir()
    (other / "thesis.tex").write_text("x")
    with pytest.raises(ValueError, match="not a megagrpo run directory"):
        prepare_out_dir(str(other), resume=False, overwrite=True)
    assert (other / "thesis.tex").exists()


def _fake_checkpoint(root: Path, step: int) -> Path:
    d = root / f"step_{step:06d}"
    (d / "policy").mkdir(parents=True)
    (d / "policy" / "__0_0.distcp").write_bytes(os.urandom(4096))
    (d / "trainer_state.json").write_text(json.dumps({"step": step}))
    write_manifest(d)
    return d


def test_manifest_finds_truncation_and_damaged_state(tmp_path):
    a, b, c = (_fake_checkpoint(tmp_path, s) for s in (2, 4, 6))
    assert newest_intact(tmp_path) == (c, [])
    state = c / "trainer_state.json"
    state.write_text("{" + "!" * (state.stat().st_size - 2) + "}")  # same size, not JSON
    shard = b / "policy" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    ckpt, broken = newest_intact(tmp_path)
    assert ckpt == a and [p for p, _ in broken] == [c, b]
    assert "trainer_state.json does not match its sha256" in broken[0][1]
    assert "has 100 bytes, the manifest says 4096" in broken[1][1]
    (a / "manifest.json").unlink()  # a save that did not finish
    assert "no manifest.json" in verify(a)


def test_state_files_round_trip_without_pickle(tmp_path):
    tree = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3)},
                      7: {"m": torch.arange(5, dtype=torch.int64)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 7],
                              "eps": float("inf"), "name": None, "flag": True}],
            "bf16": torch.randn(3).bfloat16(), "bytes": torch.get_rng_state()}
    tree["again"] = tree["bytes"]  # the same tensor twice is stored once
    save_tree(tmp_path / "s.safetensors", tree)
    back = load_tree(tmp_path / "s.safetensors")
    assert set(back["state"]) == {0, 7} and back["param_groups"][0]["betas"] == (0.9, 0.999)
    for key in ("bf16", "bytes", "again"):
        assert back[key].dtype == tree[key].dtype and torch.equal(back[key], tree[key])
    assert torch.equal(back["state"][0]["exp_avg"], tree["state"][0]["exp_avg"])
    assert {k: v for k, v in back["param_groups"][0].items()} == tree["param_groups"][0]
    # a crafted pickle where a state file should be is refused, not executed
    marker = tmp_path / "executed"
    (tmp_path / "evil.safetensors").write_bytes(pickle.dumps(Plant(str(marker))))
    with pytest.raises(Exception):
        load_tree(tmp_path / "evil.safetensors")
    assert not marker.exists()


def test_rewind_history_keeps_the_checkpoint_prefix(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n')
    size = path.stat().st_size
    with path.open("a") as f:
        f.write('{"step": 3}\n{"step": 4}\n')
    assert rewind_history(tmp_path, size) == 2
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    assert rewind_history(tmp_path, size) == 0


def test_out_of_disk_and_optimizer_state_on_real_megatron(layouts):
    """A full disk (simulated in tests/_resume_worker.py: no mount needed, so it runs
    everywhere): every rank's error says so and names the path, the checkpoint written before
    the disk filled up loads bitwise, a per-rank write failing on one rank fails on both. (Run
    in the layouts' launch, after them: `layouts` below.)"""
    work, results = layouts
    full, ranks = work / "full", results["full_disk"]
    for r in ranks:
        assert r["optimizer_bitwise"]
        e = r["save_model"]
        assert e["errno"] == 28 and "no space left on device" in e["msg"], e
        assert str(full / "policy") in e["msg"], e
        assert r["moved"] and r["earlier_intact"], r  # the failed save replaced nothing
    one, other = ranks[1]["per_rank"], ranks[0]["per_rank"]
    assert one["errno"] == 28 and "no space left on device" in one["msg"], one
    assert str(full) in one["msg"], one
    assert other["type"] == "RuntimeError" and "failed on another rank" in other["msg"], other


_LAUNCHER = ("import sys; from megagrpo.runtime.procs import run_child; "
             "raise SystemExit(run_child([sys.executable, '-c', sys.argv[1]], {}))")
_CHILD = ("import signal, sys, time, pathlib; p = pathlib.Path({path!r}); "
          "signal.signal(signal.SIGTERM, lambda *a: (p.write_text('TERM'), sys.exit(3))); "
          "p.write_text('up'); time.sleep(120)")


def _start_launcher(path: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _LAUNCHER, _CHILD.format(path=str(path))],
                            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    t0 = time.monotonic()
    while not path.exists() and time.monotonic() - t0 < 30:
        time.sleep(0.05)
    return proc


def test_launcher_forwards_signals_and_its_death_ends_the_child(tmp_path):
    forwarded = tmp_path / "forwarded"
    proc = _start_launcher(forwarded)
    proc.send_signal(signal.SIGTERM)  # forwarded: the child's handler runs, its code returns
    assert proc.wait(timeout=30) == 3 and forwarded.read_text() == "TERM"
    orphaned = tmp_path / "orphaned"
    proc = _start_launcher(orphaned)
    child = stress.descendants(proc.pid)
    proc.kill()  # SIGKILL: nothing can be forwarded; the kernel's death signal must do it
    proc.wait()
    t0 = time.monotonic()
    while any(alive(p) for p in child) and time.monotonic() - t0 < 30:
        time.sleep(0.05)
    assert len(child) == 1 and not any(alive(p) for p in child)
    assert orphaned.read_text() == "TERM"  # SIGTERM, so torchrun can still stop its ranks


_RANK = """
import sys, time

if __name__ == "__main__":  # spawned helpers import this file too: keep its top level bare
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megagrpo.runtime import procs
    from megagrpo import reward as rewards
    from megagrpo.config.data import RewardConfig

    if sys.argv[1] == "megagrpo":
        procs.watched_checkpoint_queue()
    filesystem_async._get_write_results_queue()  # what every torch_dist save calls
    scorer = rewards.RuleTerms(RewardConfig(terms=[{"name": "exact_match"}], isolation="process",
                                           num_workers=1))
    scorer.score_texts(["a"], ["a"])
    print(flush=True)
    time.sleep(300)
"""


@pytest.mark.parametrize("queue", ["megagrpo"])
def test_sigkilled_rank_leaves_no_helper_process(tmp_path, queue):
    """A rank killed with SIGKILL (the OOM killer, kill -9 of every process of a job) cannot
    stop the processes it spawned: the reward pool's workers and the queue server megatron's
    checkpoint writer starts on the first save. Stop 38 found that server (a ~270 MB spawned
    interpreter) asleep for good after each such kill; they must end with the rank.
    (queue="megatron", megatron's own server, fails this test.)"""
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    rank = subprocess.Popen([sys.executable, str(script), queue], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        rank.stdout.readline()  # the queue server and the reward worker are up
        helpers = stress.descendants(rank.pid)
        assert len(helpers) >= 2, helpers  # (and the resource tracker)
    finally:
        rank.kill()
        rank.wait()
    t0 = time.monotonic()
    while any(alive(p) for p in helpers) and time.monotonic() - t0 < 20:
        time.sleep(0.1)
    left = [p for p in helpers if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"{len(left)} of {len(helpers)} helper processes outlived the killed rank"


def test_resume_wins_over_overwrite_where_a_checkpoint_is_intact(tmp_path):
    """A recipe with run.overwrite (e.g. built on examples/demo.yaml) and checkpoints, rerun
    after a crash: its intact checkpoints are resumed, not deleted, and the console is told;
    with nothing intact to resume, overwrite clears as before."""
    run = tmp_path / "run"
    _fake_checkpoint(run / "checkpoints", 4)
    (run / "metrics.jsonl").write_text('{"step": 4}\n')
    said = prepare_out_dir(str(run), resume=True, overwrite=True, rank=0)
    assert "resuming from the intact checkpoint" in said and "step_000004" in said, said
    assert "run.resume=false to start over" in said
    assert (run / "metrics.jsonl").exists() and newest_intact(run / "checkpoints")[0] is not None
    assert prepare_out_dir(str(run), resume=False, overwrite=True, rank=0) == ""
    assert [p.name for p in run.iterdir()] == [".megagrpo-run"]
    (run / "metrics.jsonl").write_text('{"step": 1}\n')  # a run with no checkpoint at all
    assert prepare_out_dir(str(run), resume=True, overwrite=True, rank=0) == ""
    assert [p.name for p in run.iterdir()] == [".megagrpo-run"]


def test_torchrun_restart_resumes_or_starts_over_only_its_own_job(tmp_path):
    """What a rank restarted by torchrun's elastic agent (the same command, attempt N > 0)
    does with out_dir: the job that started the run there (the marker names it) resumes from
    its newest intact checkpoint whatever run.resume says, or starts over when none is
    complete yet; another job's run, or a job nothing identifies (torchrun's run id 'none'),
    is refused as before, the fix named."""
    run, job = tmp_path / "run", "torchrun:job-a"
    first = Attempt(number=0, max_restarts=1, job=job)
    assert prepare_out_dir(str(run), resume=False, overwrite=True, rank=0, attempt=first) == ""
    (run / "metrics.jsonl").write_text('{"step": 1}\n')  # killed before its first checkpoint
    again = Attempt(number=1, max_restarts=1, job=job)
    for other in (Attempt(number=1, max_restarts=1, job="torchrun:job-b"),
                  Attempt(number=1, max_restarts=1, job="")):
        with pytest.raises(ValueError, match="no intact checkpoint") as e:
            prepare_out_dir(str(run), resume=True, overwrite=False, rank=0, attempt=other)
        assert ("--rdzv-id" in str(e.value)) == (other.job == "")
    said = prepare_out_dir(str(run), resume=False, overwrite=False, rank=0, attempt=again)
    assert said == ("torchrun restart 1 of at most 1 (job torchrun:job-a): no checkpoint of it "
                    "is complete yet: starting over")
    assert [p.name for p in run.iterdir()] == [".megagrpo-run"]  # the marker stays
    _fake_checkpoint(run / "checkpoints", 2)
    (run / "metrics.jsonl").write_text('{"step": 2}\n')
    said = prepare_out_dir(str(run), resume=False, overwrite=True, rank=0, attempt=again)
    assert "resuming from its newest intact checkpoint" in said and "step_000002" in said
    assert (run / "metrics.jsonl").exists()  # nothing deleted
    assert restarts_own_run(str(run), again) and not restarts_own_run(str(run), first)


LAYOUT_WORKER = os.path.join(os.path.dirname(__file__), "_layout_resume_worker.py")


def _dcp_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a dist-checkpoint, whole (read with torch DCP, no process group)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    return {k: v for k, v in _load_state_dict_from_keys(checkpoint_id=str(path)).items()
            if isinstance(v, torch.Tensor)}


def _max_gap(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a, sorted(a.keys() ^ b.keys())[:4]
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """One 2-rank launch (tests/_layout_resume_worker.py): the plain and the distributed
    optimizer saved at TP=2, PP=2 and DP=2 and loaded at other layouts; then, in the same
    launch, tests/_resume_worker.py's optimizer round trip and full disk at WORK/full
    (results["full_disk"], one per rank)."""
    work = tmp_path_factory.mktemp("layouts")
    (work / "full").mkdir()
    # a launch of its own: the simulated full disk is installed before megagrpo is imported,
    # which a shared launch's earlier jobs would already have done
    return work, run_ranks_results(LAYOUT_WORKER, 2, work, "--full", str(work / "full"),
                                   timeout=420)


@pytest.mark.parametrize("case,dst", [("distopt_dp2", "dp2"), ("distopt_dp2", "tp2"),
                                      ("distopt_tp2", "dp2"), ("distopt_pp2", "dp2"),
                                      ("plain_tp2", "tp2"), ("plain_tp2", "dp2"),
                                      ("plain_tp2", "pp2")])
def test_optimizer_state_reshards_across_layouts(layouts, case, dst):
    """The Adam moments (and fp32 master weights) a layout loads are the saved ones, exactly;
    the next step's loss, grad norm and weights agree with the uninterrupted run: bitwise at
    the same layout, to float tolerance at another one (TP=2 -> TP=1 x DP=2, PP=2 -> PP=1)."""
    work, results = layouts
    src = case.split("_")[1]
    saved = _dcp_tensors(work / case / "ckpt" / "optimizer")
    assert any(".exp_avg_sq." in k for k in saved) and len(saved) > 10, sorted(saved)[:4]
    assert _max_gap(saved, _dcp_tensors(work / case / f"reloaded_{dst}" / "optimizer")) == 0.0
    a, b = results[f"{case}/{src}"], results[f"{case}/{dst}"]
    assert a["applied"] and b["applied"]
    ref = _dcp_tensors(work / case / "continued" / "policy")
    gap = _max_gap(ref, _dcp_tensors(work / case / f"continued_{dst}" / "policy"))
    if src == dst:
        assert a == b and gap == 0.0
    else:
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6)
        assert gap < 1e-6, gap


def test_distributed_optimizer_steps_equal_the_plain_ones(layouts):
    """Three steps at DP=2 (TP=2: DP=1) with the distributed optimizer (Adam state sharded over
    DP, shards all-gathered) give the plain optimizer's weights and moments."""
    work, results = layouts
    for layout in ("dp2", "tp2"):
        dist_ = _dcp_tensors(work / f"distopt_{layout}" / "continued" / "policy")
        plain = _dcp_tensors(work / f"plain_{layout}" / "continued" / "policy")
        assert _max_gap(dist_, plain) < 1e-6, layout
        assert results[f"distopt_{layout}/{layout}"]["grad_norm"] == pytest.approx(
            results[f"plain_{layout}/{layout}"]["grad_norm"], rel=1e-6)
    dist_, plain = (_dcp_tensors(work / f"{o}_dp2" / "continued" / "optimizer")
                    for o in ("distopt", "plain"))
    moments = {k for k in plain if ".exp_avg" in k}  # the distributed one also keeps "param"
    assert moments and moments <= dist_.keys()
    assert _max_gap({k: dist_[k] for k in moments}, {k: plain[k] for k in moments}) < 1e-6


def test_weights_without_the_optimizer_state_do_not_continue_the_run(layouts):
    """The control for the test above: the same weights with Adam restarted take a step that
    is far from the uninterrupted one (so the agreement above comes from the moments)."""
    work, _ = layouts
    ref = _dcp_tensors(work / "distopt_tp2" / "continued" / "policy")
    assert _max_gap(ref, _dcp_tensors(work / "distopt_tp2" / "continued_fresh_adam" /
                                      "policy")) > 1e-4


@pytest.mark.heavy  # ~80 s; tests/_layout_resume_worker.py covers every layout in the default run
def test_resume_at_another_layout_from_the_command_line(tmp_path):
    """As a user would: a run checkpointed at TP=2 (distributed optimizer, async rollouts)
    resumes at TP=1 x DP=2 with its optimizer state, says once what does not carry over, and
    draws the batch that was drawn ahead again rather than skipping its prompts (the numerics
    of the reshard are tested above, at the level of the optimizer)."""
    out = tmp_path / "run"
    extra = ("model.num_query_groups=2", "optim.distributed_optimizer=true",
             "run.async_rollout=true")
    stress.finish(stress.launch(out, 2, tmp_path / "tp2.log", "parallel.tp=2", *extra),
                  tmp_path / "tp2.log")
    state = json.loads((out / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert state["layout"]["tp"] == 2 and state["pending_loader"] == {**state["loader"],
                                                                      "index": 2}
    stress.finish(stress.launch(out, 3, tmp_path / "dp2.log", "parallel.tp=1", *extra),
                  tmp_path / "dp2.log")
    log = (tmp_path / "dp2.log").read_text()
    assert "resume at another layout (saved at tp=2 x pp=1 x dp=1 x rollout_tp=1, now tp=1 x " \
           "pp=1 x dp=2 x rollout_tp=1)" in log, log[-3000:]
    assert "and the async batch drawn for the next step" in log
    assert log.count("resume at another layout") == 1 and "Adam moments restart" not in log
    assert stress.logged_steps(out) == [1, 2, 3]
    final = json.loads((out / "checkpoints" / "step_000003" / "trainer_state.json").read_text())
    assert final["loader"]["index"] == state["loader"]["index"] + 1  # no batch skipped


# ---------------------------------------------------------------------- issue 30: k = 2 stream
@pytest.mark.heavy  # ~2-3 min on 2 cores: two 2-rank runs; tests/test_stream.py checks the
# prompt accounting of every resume path by default, without ranks
def test_k2_stream_killed_resumes_bitwise_without_losing_a_prompt(tmp_path):
    """rollout.max_staleness=2: a run SIGKILLed whole (launcher, torchrun, ranks) inside step 4,
    its checkpoint of step 2 holding the two batches drawn ahead (their prompts and this rank's
    samples), resumes and ends bitwise the uninterrupted run: every tensor, random stream and
    queued batch, the loader position and the metrics history (rewards per step) agree, so no
    prompt was lost or trained twice."""
    extra = stress.MODES["async2"]
    ref, cut = tmp_path / "uninterrupted", tmp_path / "interrupted"
    ref_proc = stress.launch(ref, STEPS, tmp_path / "uninterrupted.log", *extra)
    try:
        log = stress.interrupted_run(cut, STEPS, 3, *extra, delay=0.3)
        stress.finish(ref_proc, tmp_path / "uninterrupted.log")
    finally:
        if ref_proc.poll() is None:
            stress.kill_tree(ref_proc)
    assert "resumed from" in log and "step_000002" in log, log[-3000:]
    assert stress.compare(ref, cut) == []
    assert stress.logged_steps(cut) == list(range(1, STEPS + 1))
    state, final = stress.trainer_state(cut), stress.final_state(cut)
    assert len(state["ahead_loaders"]) == 2  # two batches drawn ahead at the end, too
    queued = {k.split(".")[3] for k in final if k.startswith("rollout.rank00000.queue.")}
    assert queued == {"0", "1"}, sorted(queued)
    lags = [r["staleness_max"] for r in stress.history(cut) if "reward_mean" in r]
    assert lags == [0, 1] + [2] * (STEPS - 2), lags


TOOLS_LORA_SEPARATE = ROOT / "examples" / "tools-lora-separate-cpu.yaml"


@pytest.mark.heavy  # ~2-3 min: two launches of 4 ranks (2 training, an engine of TP 2)
def test_tools_lora_separate_recipe_killed_and_rerun(tmp_path):
    """As a new user (issue 46): examples/tools-lora-separate-cpu.yaml (multi-turn calculator
    tools, LoRA served by a TP 2 engine on 2 rollout ranks, 2 training ranks at TP 2, dynamic
    sampling, a checkpoint every step here) through `megagrpo train --nproc 4`; every process
    SIGKILLed once step 2's checkpoint is complete, then the same command run again: it says
    where it resumed, trains steps 3-4 and finishes, one history of steps 1-4 (no step lost or
    trained twice), the rollout ranks' in-flight state in the checkpoint, no process left.
    Smaller than the recipe (a 2-layer model, 4 prompts x G 4, no cold start) to fit the
    suite."""
    out = tmp_path / "run"
    small = ["model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_layers=2",
             "data.batch_size=4", "algo.group_size=4", "algo.num_minibatches=1",
             "cold_start.steps=0", "eval.every=0", "arithmetic.num_eval=4",
             "arithmetic.num_train=64", "compute.micro_batch_size=16", "run.steps=4",
             "checkpoint.every=1", "log.tensorboard=false", f"run.out_dir={out}",
             f"arithmetic.tokenizer_dir={tmp_path}/tok"]
    cmd = [sys.executable, "-m", "megagrpo", "train", "--nproc", "4", "--config",
           str(TOOLS_LORA_SEPARATE), *small]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    logs = [tmp_path / "first.log", tmp_path / "rerun.log"]
    with logs[0].open("wb") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        stress.wait_for_step(proc, out, 2, checkpoint=True, timeout=600)
        stress.kill_tree(proc)  # the launcher, torchrun and all 4 ranks at once
        assert stress.leftovers(str(out)) == []
        with logs[1].open("wb") as f:
            rerun = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        stress.finish(rerun, logs[1])
    finally:
        for p in (proc, locals().get("rerun")):
            if p is not None and p.poll() is None:
                stress.kill_tree(p)
    console = logs[1].read_text()
    assert "placement: separate; training ranks 0-1 (megatron-core tp=2 x pp=1 x dp=1), " \
           "rollout ranks 2-3 (1 vLLM engine(s) of TP 2" in console
    assert "vLLM serves the adapters (LoRA request per rollout)" in console
    done = sorted(int(p.name[5:]) for p in (out / "checkpoints").glob("step_*"))
    assert re.search(r"resumed from \S+step_00000([2-4]) at step \1", console), console[-4000:]
    steps = [r for r in stress.history(out) if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]  # one history: none lost, none twice
    assert max(r["turns"] for r in steps) > 1  # multi-turn steps ran
    assert all(r["logp_gap_vllm_mean"] < 1e-5 for r in steps), steps  # k = 0, adapters served
    assert done and done[-1] == 4
    state = load_tree(out / "checkpoints" / "step_000004" / "rollout_ranks" /
                      "rank00000.safetensors")
    assert len(state["rollout_ranks"]) == 2  # both engine ranks' in-flight state
    assert stress.leftovers(str(out)) == []
