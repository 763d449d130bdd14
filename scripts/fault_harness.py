"""Fault injection: runs a tiny GRPO job (2 ranks, DP=2, fp32, scripts/resume_stress.py's
recipe) once undisturbed per configuration, then once per fault, planted at a random moment,
and checks that each disturbed run ends with the undisturbed run's checkpointed state (final
policy, reference and optimizer tensors, every rank's random streams and pending batch,
trainer_state.json, the metrics history but timings: scripts/resume_stress.py's `compare`)
and that no process of it is left (a /proc scan for its out_dir in command lines, i.e. ps).

    python scripts/fault_harness.py [--faults launcher,rank,env,sandbox,disk] [--seed 1]
        [--work /tmp/megagrpo-faults] [--out benchmarks/results/fault_harness_cpu.json]
    python scripts/fault_harness.py --table benchmarks/results/fault_harness_cpu.json

Faults (each at a random step + delay drawn from --seed):
- launcher: SIGKILL of `python -m megagrpo train` alone; torchrun and the ranks must follow
  it (PR_SET_PDEATHSIG); the same command run again resumes from the newest intact checkpoint.
- rank: the job runs under torchrun's elastic agent (`train --max-restarts 1`); one training
  rank, chosen at random, is SIGKILLed; the agent restarts the job, which resumes on its own.
- env: a multi-turn run whose environment (tests/_agent_env.py:Flaky) raises in 10% of turns
  and hangs in 1% (agent.env_retries 2, agent.env_timeout_s 2: the trajectories are dropped);
  the whole run is SIGKILLed at a random moment and resumed. Compared with the undisturbed run
  of the same environment (which meets the same failures: they are fixed by prompt and turn).
- sandbox: a multi-turn run whose environment (tests/_agent_env.py:Sandboxed) computes each
  answer in a tool's kernel-sandboxed child; children are SIGKILLed at random moments during
  the run; the environment raises, the runner asks again, the run trains what it would have.
- writer: under `train --max-restarts 1`, rank 0's checkpoint writer process (the one megatron
  forks to write the policy of the planted step's checkpoint) is SIGKILLed the planted seconds
  after its fork (tests/_fault_hooks.py); the rank must stop the save within seconds naming the
  writer, and the restart resume from the checkpoint before.
- disk, disk-first: out_dir on a tmpfs mounted for the run (root only: refused otherwise,
  never faked); the harness fills it, leaving half a checkpoint free, at the planted moment
  (disk) or before the start (disk-first); the checkpoint being written runs out of space
  mid-write (the kernel's ENOSPC; a fill before a save begins meets megagrpo's free-space
  check instead) and the run must stop on every rank with "no space left on device"; the
  filler removed, the same command resumes.

Results (one record per fault, with the CPU and load) go to --out; `--table` prints the
markdown table docs/resume.md holds (tests/test_fault_harness.py checks it is current).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
import resume_stress as stress  # noqa: E402 - one harness for kills and comparisons

ROOT = stress.ROOT
STEPS = 6
MODE = ("optim.distributed_optimizer=true", "run.async_rollout=true")  # the most state
FLAKY = ("agent.environment=tests._agent_env:Flaky", "agent.max_turns=3",
         "rollout.max_tokens=10", "agent.env_retries=2", "agent.env_timeout_s=2")
SANDBOX = ("agent.environment=tests._agent_env:Sandboxed", "agent.max_turns=3",
           "rollout.max_tokens=10", "data.batch_size=4")
EVERY = ("checkpoint.every=1",)  # most kills then land after a complete checkpoint
CONFIGS = {"launcher": (*MODE, *EVERY), "rank": (*MODE, *EVERY), "disk": (*MODE, *EVERY),
           "disk-first": (*MODE, *EVERY),
           "env": (*FLAKY, *MODE[1:], *EVERY), "sandbox": (*SANDBOX, *EVERY),
           "writer": (*MODE, *EVERY)}
"""The recipe's extra overrides per fault; faults of one configuration share its reference."""
COUNTED = {"sandbox": ("env_retries",)}
"""Metrics a fault changes by design, left out of the comparison (and said so): a killed
sandbox child makes its environment call fail and be asked again, which `env_retries` counts;
what the run trains is the same."""
DISK_MIB = 64


def undisturbed(work: Path, fault: str) -> Path:
    """The configuration's undisturbed run (made once per --work)."""
    extra = CONFIGS[fault]
    name = "ref_" + {CONFIGS["rank"]: "plain", CONFIGS["env"]: "env",
                     CONFIGS["sandbox"]: "sandbox"}[extra]
    out = work / name
    if not (out / "summary.json").exists():
        log = work / f"{name}.log"
        stress.finish(stress.launch(out, STEPS, log, "run.overwrite=true", *extra), log)
    return out


def ranks_of(proc: subprocess.Popen) -> dict[int, int]:
    """{torchrun rank: pid} of a run's ranks: the torchrun agent's own children (read from
    /proc; the processes a rank forks, e.g. megatron's checkpoint writers, share its command
    line and RANK, and a kill meant for the rank must not hit one of them)."""
    out = {}
    for pid in stress.descendants(proc.pid):
        try:
            env = dict(kv.split("=", 1) for kv in
                       Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            parent = Path(f"/proc/{ppid}/cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if "RANK" in env and b"torch.distributed.run" in parent:
            out[int(env["RANK"])] = pid
    return out


def wait_gone(needle: str, timeout: float = 60) -> list[int]:
    """Waits until no process names `needle`; returns those left after `timeout` s."""
    t0 = time.monotonic()
    while (left := stress.leftovers(needle)) and time.monotonic() - t0 < timeout:
        time.sleep(0.2)
    return left


def fault_launcher(out: Path, step: int, delay: float, pick: random.Random) -> dict:
    log = out.parent / f"{out.name}.log"
    proc = stress.launch(out, STEPS, log, *CONFIGS["launcher"])
    stress.wait_for_step(proc, out, step)
    time.sleep(delay)
    os.kill(proc.pid, signal.SIGKILL)  # the launcher alone
    proc.wait()
    left = wait_gone(str(out))
    return {"left_after_fault": len(left), **_resume(out, "launcher")}


def fault_rank(out: Path, step: int, delay: float, pick: random.Random) -> dict:
    log = out.parent / f"{out.name}.log"
    proc = stress.launch(out, STEPS, log, *CONFIGS["rank"], "--max-restarts", "1")
    stress.wait_for_step(proc, out, step)
    time.sleep(delay)
    ranks = ranks_of(proc)
    return kill_rank(proc, log, out, ranks, pick.choice(sorted(ranks)))


def kill_rank(proc, log: Path, out: Path, ranks: dict[int, int], victim: int) -> dict:
    """SIGKILLs rank `victim` (`ranks`: rank -> pid) of a run under `--max-restarts 1`, lets
    torchrun restart the job and the run finish; what the restart resumed from."""
    os.kill(ranks[victim], signal.SIGKILL)
    stress.finish(proc, log)
    return {"victim_rank": victim, **restarted(out)}


def restarted(out: Path) -> dict:
    """How many times torchrun restarted a run and where the restart resumed."""
    marks = stress.restarts(out)
    at = marks[0]["resumed_from_step"] if marks else None
    return {"restarts": len(marks),
            "resumed": f"step {at} (torchrun restart)" if at is not None
            else "fresh start (torchrun restart, no intact checkpoint)"}


def fault_writer(out: Path, step: int, delay: float, pick: random.Random) -> dict:
    """Rank 0's writer of step `step`'s policy checkpoint SIGKILLed `delay` s after its fork,
    under --max-restarts 1: whether the console named it (pid, signal), and the restart."""
    from megagrpo.runtime.run_dir import checkpoint_root
    from tests._fault_hooks import KILL_WRITER_ENV

    log, pidfile = out.parent / f"{out.name}.log", out / "killed_writer.pid"
    tmp = checkpoint_root(out) / f"step_{step:06d}" / "policy.tmp"
    proc = stress.launch(out, STEPS, log, *CONFIGS["writer"], "--max-restarts", "1",
                         env={KILL_WRITER_ENV: f"0:{delay}:{tmp}:{pidfile}"})
    stopped = rank_stopped_after(proc, pidfile, delay)
    stress.finish(proc, log)
    said = pidfile.exists() and f"pid {pidfile.read_text()} was killed by signal SIGKILL" in \
        log.read_text()
    return {"said_writer_died": said, "rank_stopped_after_kill_s": stopped, **restarted(out)}


def rank_stopped_after(proc: subprocess.Popen, pidfile: Path, delay: float) -> float | None:
    """Seconds from the writer's kill (its fork, when it wrote `pidfile`, + `delay`) until
    rank 0 of that attempt had exited (polled every 0.05 s), or None if it never did."""
    while not pidfile.exists() and proc.poll() is None:
        time.sleep(0.01)
    rank0 = ranks_of(proc).get(0)
    if rank0 is None:
        return None
    from tests.support.launch import alive

    while alive(rank0) and proc.poll() is None:
        time.sleep(0.05)
    return round(time.time() - pidfile.stat().st_mtime - delay, 2)


def fault_env(out: Path, step: int, delay: float, pick: random.Random) -> dict:
    text = stress.interrupted_run(out, STEPS, step, *CONFIGS["env"], delay=delay)
    return {"resumed": _where(text), **agent_figures(out)}


def agent_figures(out: Path) -> dict:
    """The run's environment calls asked again per trajectory and share of trajectories
    dropped, means over its steps (docs/agentic.md)."""
    h = [r for r in stress.history(out) if "reward_mean" in r]
    return {key: round(sum(r.get(metric, 0) for r in h) / len(h), 4) for key, metric in
            (("env_retries_per_trajectory", "env_retries"), ("dropped_frac", "dropped_frac"))}


def fault_sandbox(out: Path, step: int, delay: float, pick: random.Random) -> dict:
    log = out.parent / f"{out.name}.log"
    proc = stress.launch(out, STEPS, log, *CONFIGS["sandbox"])
    stress.wait_for_step(proc, out, step)
    time.sleep(delay)
    killed = kill_sandbox_children(proc, pick)
    stress.finish(proc, log)
    return {"children_killed": killed, **agent_figures(out)}


def kill_sandbox_children(proc: subprocess.Popen, pick: random.Random) -> int:
    """SIGKILLs up to 3 of the run's sandboxed tool children, 0.5-2 s apart, within 20 s;
    returns how many."""
    killed, t_end = 0, time.monotonic() + 20
    while proc.poll() is None and time.monotonic() < t_end and killed < 3:
        children = [p for p in stress.leftovers("sandbox_child.py")
                    if p in stress.descendants(proc.pid)]
        if children:
            os.kill(pick.choice(children), signal.SIGKILL)
            killed += 1
            time.sleep(pick.uniform(0.5, 2.0))
        else:
            time.sleep(0.02)
    return killed


def fault_disk(out: Path, step: int, delay: float, pick: random.Random, *,
               first: bool = False) -> dict:
    """`first`: the tmpfs is filled before the run starts, so its first checkpoint runs out of
    space mid-write (the kernel's ENOSPC); else after `step` + `delay` (the planted moment)."""
    disk = out.parent  # the tmpfs: out_dir and the filler beside it
    disk.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_MIB}m", "tmpfs", str(disk)],
                   check=True)
    try:
        log = disk.parent / f"{disk.name}.log"
        ckpt = checkpoint_bytes(undisturbed(disk.parent, "disk"))
        filler = disk / "filler"
        if first:
            fill(filler, leave=ckpt // 2 + (256 << 10))  # and 256 KiB for logs and metrics
        proc = stress.launch(out, STEPS, log, *CONFIGS["disk"], "run.overwrite=true")
        if not first:
            stress.wait_for_step(proc, out, step)
            time.sleep(delay)
            fill(filler, leave=ckpt // 2)
        try:
            rc = proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            stress.kill_tree(proc)
            rc = None
        said = "no space left on device" in log.read_text()
        left = wait_gone(str(out))
        filler.unlink()
        result = {"stopped_rc": rc, "said_no_space": said, "left_after_fault": len(left),
                  "stopped_at": f"checkpoint {max([0, *stress.logged_steps(out)])}"}
        result.update(_resume(out, "disk"))
        return result
    finally:  # run_fault unmounts the tmpfs once the run is compared
        for pid in stress.leftovers(str(out)):
            os.kill(pid, signal.SIGKILL)


def checkpoint_bytes(out: Path) -> int:
    """Bytes of a run's newest complete checkpoint (its manifest's count)."""
    from megagrpo.runtime.run_dir import checkpoint_root, manifest_bytes, newest_intact

    ckpt, _ = newest_intact(checkpoint_root(out))
    return manifest_bytes(ckpt) if ckpt is not None else 0


def fill(path: Path, leave: int) -> None:
    """Writes zeros into `path` until its filesystem has `leave` bytes free (real pages: a
    tmpfs allocates on write, so a sparse file would take nothing)."""
    todo = max(0, shutil.disk_usage(path.parent).free - leave)
    block = bytes(1 << 20)
    with path.open("wb") as f:
        while todo > 0:
            try:
                todo -= f.write(block[:min(todo, len(block))])
                f.flush()
            except OSError:  # the run wrote meanwhile: the disk is full already
                return


def _resume(out: Path, fault: str) -> dict:
    """Runs the same command again (resumes from the newest intact checkpoint; with none, a
    fresh start: run.overwrite, which resume wins over) and records where it resumed."""
    log = out.parent / f"{out.name}.resumed.log"
    if fault.startswith("disk"):
        log = out.parent.parent / f"{out.parent.name}.resumed.log"
    stress.finish(stress.launch(out, STEPS, log, *CONFIGS[fault], "run.overwrite=true"), log)
    return {"resumed": _where(log.read_text())}


def _where(text: str) -> str:
    """Where a resumed run's console says it resumed."""
    where = [ln for ln in text.splitlines() if "resumed from" in ln]
    return ("step " + where[-1].split(" at step ", 1)[1].split(";")[0].strip() if where
            else "fresh start (no intact checkpoint)")


# --modes: kill -9 of random processes at random moments in the four configurations of issue
# 47; each run goes under torchrun's elastic agent (--max-restarts 1), so a killed rank
# restarts the job, which resumes on its own; a kill of every process is followed by the same
# command again
SEPARATE = ("rollout.placement=separate", "rollout.rollout_ranks=1", "rollout.max_staleness=1")


@dataclass(frozen=True)
class Mode:
    extra: tuple[str, ...]
    """The recipe's overrides (on top of scripts/resume_stress.py's tiny one)."""
    bitwise: bool
    """Checked bitwise (every tensor, random stream, queued batch, trainer state and metric);
    else the prompt sequence: each step's `prompt_digest`, and the trainer state."""
    victims: tuple[str, ...]
    """What may be killed: 'all' (launcher, torchrun and ranks), 'training' / 'rollout' (one
    rank of that side), 'env' (the environment's sandboxed tool children), 'engine' (the
    vLLM engine's child process of a rollout rank, rollout.engine_failure=continue)."""
    about: str
    nproc: int = 2


MODES = {
    "async2": Mode(("optim.distributed_optimizer=true", "rollout.max_staleness=2", *EVERY),
                   True, ("all", "training"),
                   "colocated, k = 2 (two batches drawn ahead), the distributed optimizer"),
    "separate-inflight": Mode(
        (*SEPARATE, "rollout.inflight_updates=true", *EVERY), False,
        ("all", "training", "rollout"),
        "separate placement (1 training + 1 rollout rank), k = 1, in-flight weight updates"),
    "separate-agent": Mode(
        (*SEPARATE, *SANDBOX, *EVERY), True, ("all", "training", "rollout", "env"),
        "separate, multi-turn: each answer computed by a tool's sandboxed child "
        "(`tests/_agent_env.py:Sandboxed`)"),
    "separate-lora": Mode(
        (*SEPARATE, "lora.rank=4", "lora.alpha=8", "lora.refit=adapter", *EVERY), True,
        ("all", "training", "rollout"),
        "separate, LoRA (adapter-only sync; a merge at each reference reset, every 3 steps)"),
    "separate-failover": Mode(
        ("rollout.placement=separate", "rollout.rollout_ranks=2", "rollout.max_staleness=1",
         "rollout.engine_failure=continue", *SANDBOX, "lora.rank=4", "lora.alpha=8",
         "lora.refit=adapter", "checkpoint.every=4"), False, ("engine",),
        "separate, 1 training + 2 rollout ranks, k = 1, multi-turn with the sandboxed tool, "
        "LoRA adapters, rollout.engine_failure=continue: one engine killed, the other rollout "
        "rank draws its share until the checkpoint, then a restart", nproc=3),
}
ALL = ("async2", "separate-inflight", "separate-agent", "separate-lora")
"""`--modes all`: the issue's four modes (the 20-kill table); separate-failover runs by name."""
RESTARTS = ("--max-restarts", "1")


def plan_modes(modes: list[str], kills: int, seed: int) -> list[tuple[str, str, int, float]]:
    """(mode, victim, after step, + seconds) for `kills` kills spread round-robin over `modes`;
    each mode goes through its victims in turn; moments random, reproducible from `seed`."""
    pick = random.Random(seed)
    return [(mode, MODES[mode].victims[(i // len(modes)) % len(MODES[mode].victims)],
             pick.randrange(1, STEPS - 1), round(pick.uniform(0.0, 1.5), 2))
            for i, mode in ((i, modes[i % len(modes)]) for i in range(kills))]


def mode_reference(work: Path, mode: str) -> Path:
    """The mode's uninterrupted run (made once per --work)."""
    out = work / f"ref_{mode}"
    if not (out / "summary.json").exists():
        log = work / f"ref_{mode}.log"
        stress.finish(stress.launch(out, STEPS, log, "run.overwrite=true", *MODES[mode].extra,
                                    nproc=MODES[mode].nproc), log)
    return out


def kill_in_mode(out: Path, mode: str, victim: str, step: int, delay: float,
                 pick: random.Random) -> dict:
    """Starts the mode's run under --max-restarts 1, kills `victim` after `step` + `delay` s,
    and lets the run end (restarted by torchrun, or run again after a kill of everything)."""
    m, log = MODES[mode], out.parent / f"{out.name}.log"
    proc = stress.launch(out, STEPS, log, *m.extra, *RESTARTS, nproc=m.nproc)
    stress.wait_for_step(proc, out, step)
    time.sleep(delay)
    if victim == "engine":
        return kill_engine(proc, log, out, pick)
    if victim == "all":
        stress.kill_tree(proc)
        left = wait_gone(str(out))
        rerun = out.parent / f"{out.name}.resumed.log"
        stress.finish(stress.launch(out, STEPS, rerun, *m.extra, *RESTARTS,
                                    "run.overwrite=true", nproc=m.nproc), rerun)
        return {"left_after_fault": len(left), "resumed": _where(rerun.read_text())}
    if victim == "env":
        killed = kill_sandbox_children(proc, pick)
        stress.finish(proc, log)
        return {"children_killed": killed, "restarts": len(stress.restarts(out))}
    ranks = ranks_of(proc)
    training = len(ranks) - (1 if "rollout.placement=separate" in m.extra else 0)
    chosen = pick.choice(sorted(r for r in ranks if (r < training) == (victim == "training")))
    return kill_rank(proc, log, out, ranks, chosen)


def kill_engine(proc: subprocess.Popen, log: Path, out: Path, pick: random.Random) -> dict:
    """SIGKILLs the vLLM engine (child process) of a random rollout rank and lets the run end:
    it goes on with the other rollout ranks until its next checkpoint, then torchrun restarts
    it with all of them."""
    pids = {int(f.parent.name.removeprefix("rank")): int(f.read_text())
            for f in (out / "engine").glob("rank*/engine.pid")}
    rank = pick.choice(sorted(pids))
    os.kill(pids[rank], signal.SIGKILL)
    stress.finish(proc, log, timeout=900)
    degraded = [r["step"] for r in stress.history(out) if r.get("rollout_ranks_out")]
    return {"victim_rank": rank, "engine_pid": pids[rank], "degraded_steps": degraded,
            "makeups": sum(r.get("rollout_makeups", 0) for r in stress.history(out)),
            "restarts": len(stress.restarts(out))}


def same_prompts(reference: Path, resumed: Path) -> list[str]:
    """What differs in the prompt sequence: each step's `prompt_digest` and data epoch, once
    per step, and the final trainer state (data position, counters, reference schedule)."""
    def seq(out: Path) -> list[tuple]:
        return [(r["step"], r["epoch"], r["prompt_digest"]) for r in stress.history(out)
                if "reward_mean" in r]

    a, b = seq(reference), seq(resumed)
    diffs = [] if a == b else [f"prompt sequence (step, epoch, prompt_digest): {a} != {b}"]
    sa, sb = stress.trainer_state(reference), stress.trainer_state(resumed)
    return diffs + [f"trainer_state.json {k}: {sa.get(k)} != {sb.get(k)}"
                    for k in sorted(sa.keys() | sb.keys()) if sa.get(k) != sb.get(k)]


def run_kill(work: Path, index: int, mode: str, victim: str, step: int, delay: float,
             seed: int) -> dict:
    out = work / f"{mode}_{index}"
    if out.exists():
        shutil.rmtree(out)
    t0 = time.monotonic()
    record = {"mode": mode, "victim": victim, "after_step": step, "delay_s": delay,
              "check": "bitwise" if MODES[mode].bitwise else "prompt sequence"}
    try:
        ref = mode_reference(work, mode)
        record.update(kill_in_mode(out, mode, victim, step, delay,
                                   random.Random(f"{seed}:{index}")))
        record.update(check_kill(ref, out, mode, victim))
    except Exception as e:  # noqa: BLE001 - one kill's failure is its record, not the end
        record.update(equal=False, error=f"{type(e).__name__}: {e}"[:2000])
    finally:
        record["left_at_end"] = len(wait_gone(str(out), timeout=30))
    record["seconds"] = round(time.monotonic() - t0, 1)
    return record


def check_kill(ref: Path, out: Path, mode: str, victim: str) -> dict:
    """The kill's check against the mode's uninterrupted run: bitwise (but what depends on
    timing or is counted by design, named in `not_compared`) or the prompt sequence."""
    if not MODES[mode].bitwise:
        diffs, left_out = same_prompts(ref, out), []
    else:  # separate placement: how many batches were ready when asked depends on timing
        left_out = (["env_retries"] if victim == "env" else []) + (
            list(stress.NEAR["separate"]) if "rollout.placement=separate" in MODES[mode].extra
            else [])
        diffs = stress.compare(ref, out, {k: float("inf") for k in left_out})
    return {"equal": not diffs, "differs": [d[:300] for d in diffs[:3]],
            **({"not_compared": left_out} if left_out else {})}


def recheck(results: dict, work: Path) -> dict:
    """The checks of a --modes results file made again from the runs kept in `work` (after a
    change of what is compared; the runs are not repeated)."""
    for r in results["runs"]:
        if "error" not in r:
            r.pop("not_compared", None)
            r.update(check_kill(work / f"ref_{r['mode']}", work / f"{r['mode']}_{r['index']}",
                                r["mode"], r["victim"]))
    return results


def modes_table(results: dict) -> str:
    """The markdown table of a --modes results file (docs/resume.md holds it)."""
    rows = ["| mode | killed | planted | checked | outcome | resumed | processes left |",
            "|---|---|---|---|---|---|---|"]
    for r in results["runs"]:
        who = {"all": "every process", "env": f"{r.get('children_killed', 0)} tool children",
               "training": f"training rank {r.get('victim_rank', '?')}",
               "rollout": f"rollout rank {r.get('victim_rank', '?')}",
               "engine": f"the engine of rollout rank {r.get('victim_rank', '?')} "
                         f"(degraded steps {r.get('degraded_steps')}, "
                         f"{r.get('makeups', 0):.0f} shares made up)"}[r["victim"]]
        if "restarts" in r:
            who += f" (restarts {r['restarts']})"
        skipped = ", ".join(f"`{k}`" for k in r.get("not_compared", ()))
        outcome = (f"equal ({skipped} not compared)" if skipped else "equal") \
            if r.get("equal") else "DIFFERS: " + " ".join(
                "; ".join(r.get("differs") or [r.get("error", "?")]).split())[:200]
        left = r.get("left_after_fault", 0) + r["left_at_end"]
        rows.append(f"| {r['mode']} | {who} | after step {r['after_step']} + "
                    f"{r['delay_s']:.2f} s | {r['check']} | {outcome} | "
                    f"{r.get('resumed', '-')} | {left} |")
    m, n = results["machine"], len(results["runs"])
    ok = sum(bool(r.get("equal")) for r in results["runs"])
    rows.append("")
    rows.append(f"{ok} of {n} kills ended as the uninterrupted run. {m['cpu']} ({m['cores']} "
                f"cores, {m['cpu_capability']}), torch {m['torch']}, load average "
                f"{results['load_before']} before, {results['load_after']} after; --seed "
                f"{results['seed']}, {STEPS} steps, {results['seconds']:.0f} s in all")
    return "\n".join(rows)


FAULTS = {"launcher": fault_launcher, "rank": fault_rank, "env": fault_env,
          "sandbox": fault_sandbox, "disk": fault_disk,
          "disk-first": partial(fault_disk, first=True), "writer": fault_writer}


def plan(faults: list[str], seed: int) -> list[tuple[str, int, float]]:
    """(fault, after step, + seconds) for each fault: random, reproducible from `seed`."""
    pick = random.Random(seed)
    return [(f, pick.randrange(1, STEPS - 1), round(pick.uniform(0.0, 1.5), 2)) for f in faults]


def run_fault(work: Path, fault: str, step: int, delay: float, seed: int) -> dict:
    ref = undisturbed(work, fault)
    top = work / f"fault_{fault}"
    out = top / "run" if fault.startswith("disk") else top  # disk: out_dir inside the tmpfs
    if top.exists():
        subprocess.run(["umount", "-l", str(top)], check=False, capture_output=True)
        shutil.rmtree(top)
    t0 = time.monotonic()
    record = {"fault": fault, "after_step": step, "delay_s": delay}
    try:
        record.update(FAULTS[fault](out, step, delay, random.Random(f"{seed}:{fault}")))
        diffs = stress.compare(ref, out, {k: float("inf") for k in COUNTED.get(fault, ())})
        record["equal"] = not diffs
        record["differs"] = [d[:300] for d in diffs[:3]]
        if fault in COUNTED:
            record["not_compared"] = list(COUNTED[fault])
    except Exception as e:  # noqa: BLE001 - one fault's failure is its record, not the end
        record.update(equal=False, error=f"{type(e).__name__}: {e}"[:2000])
    finally:
        record["left_at_end"] = len(wait_gone(str(out), timeout=30))
        if os.path.ismount(top):  # the disk faults' tmpfs
            subprocess.run(["umount", "-l", str(top)], check=False)
    record["seconds"] = round(time.monotonic() - t0, 1)
    return record


def machine() -> dict:
    import torch

    model = next((ln.split(":", 1)[1].strip() for ln in
                  Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name")),
                 "unknown")
    return {"cpu": model, "cores": os.cpu_count(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__}


def table(results: dict) -> str:
    """The markdown table of a results file (docs/resume.md holds it)."""
    rows = ["| fault | planted | outcome | resumed | processes left |",
            "|---|---|---|---|---|"]
    for r in results["runs"]:
        extra = {k: v for k, v in r.items() if k in (
            "victim_rank", "restarts", "env_retries_per_trajectory", "dropped_frac",
            "children_killed", "said_no_space", "stopped_at", "said_writer_died",
            "rank_stopped_after_kill_s")}
        planted = ("filled before the start" if r["fault"] == "disk-first" else
                   f"after step {r['after_step']} + {r['delay_s']:.2f} s") + (
            "; " + ", ".join(f"{k} {v}" for k, v in extra.items()) if extra else "")
        outcome = ("bitwise equal" + "".join(f" but `{k}`" for k in r.get("not_compared", ())))\
            if r.get("equal") else \
            "DIFFERS: " + "; ".join(r.get("differs") or [r.get("error", "?")])[:200]
        left = r.get("left_after_fault", 0) + r["left_at_end"]
        rows.append(f"| {r['fault']} | {planted} | {outcome} | {r.get('resumed', '-')} | "
                    f"{left} |")
    m = results["machine"]
    rows.append("")
    rows.append(f"{m['cpu']} ({m['cores']} cores, {m['cpu_capability']}), torch {m['torch']}, "
                f"load average {results['load_before']} before, {results['load_after']} after;"
                f" --seed {results['seed']}, {STEPS} steps, {results['seconds']:.0f} s in all"
                + "".join(f"; rerun of {', '.join(r['faults'])}"
                          + (f" on {r['cpu']}" if r.get("cpu", m["cpu"]) != m["cpu"] else "")
                          + f": {r['seconds']:.0f} s, load {r['load_before']} -> "
                          f"{r['load_after']}" for r in results.get("reruns", [])))
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--work", default="/tmp/megagrpo-faults")
    ap.add_argument("--out", default=None, help="results JSON (default: print only)")
    ap.add_argument("--merge", action="store_true",
                    help="replace only these faults' records in the --out file (a rerun)")
    ap.add_argument("--table", default=None, metavar="RESULTS",
                    help="print the markdown table of a results file and exit")
    ap.add_argument("--plan", action="store_true", help="print the planted faults and exit")
    ap.add_argument("--modes", default=None, metavar="M1,M2|all",
                    help=f"kill -9 of random processes in these modes ({', '.join(MODES)}) "
                    "instead of --faults")
    ap.add_argument("--kills", type=int, default=20, help="--modes: kills in all")
    ap.add_argument("--recheck", default=None, metavar="RESULTS",
                    help="--modes results: check the kept runs in --work again, rewrite it")
    ap.add_argument("--only", default=None, metavar="M1,M2",
                    help="--modes: run only the planned kills of these modes or plan indices "
                    "(then --merge)")
    args = ap.parse_args()
    if args.table:
        results = json.loads(Path(args.table).read_text())
        print(modes_table(results) if "modes" in results else table(results))
        return 0
    if args.recheck:
        results = recheck(json.loads(Path(args.recheck).read_text()), Path(args.work))
        Path(args.recheck).write_text(json.dumps(results, indent=1) + "\n")
        print(modes_table(results))
        return 0
    if args.modes is not None:
        return main_modes(ap, args)
    faults = [f for f in args.faults.split(",") if f]
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        ap.error(f"--faults {unknown}: use some of {sorted(FAULTS)}")
    if any(f.startswith("disk") for f in faults) and os.geteuid() != 0:
        ap.error("--faults disk, disk-first mount a tmpfs: run as root, or leave them out")
    # each fault at its moment in the plan of them all, whichever are run (a --merge rerun)
    todo = [t for t in plan(list(FAULTS), args.seed) if t[0] in faults]
    if args.plan:
        for f, step, delay in todo:
            print(f"{f}: after step {step} + {delay:.2f} s")
        return 0
    work = Path(args.work)
    runs, part = run_each(work, [partial(run_fault, work, f, step, delay, args.seed)
                                 for f, step, delay in todo])
    results = {"machine": machine(), "seed": args.seed, "steps": STEPS, **part, "runs": runs}
    if args.merge and args.out and Path(args.out).exists():
        old = json.loads(Path(args.out).read_text())
        if old["seed"] != args.seed:
            ap.error(f"--merge: {args.out} was made with --seed {old['seed']}")
        rerun = {r["fault"]: r for r in runs}
        old["runs"] = [rerun.pop(r["fault"], r) for r in old["runs"]] + list(rerun.values())
        old.setdefault("reruns", []).append({k: results[k] for k in (
            "load_before", "load_after", "seconds")} | {"faults": sorted(f for f, *_ in todo),
                                                        "cpu": results["machine"]["cpu"]})
        results = old
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    ok = all(r.get("equal") and not r.get("left_after_fault") and not r["left_at_end"]
             for r in runs)
    return 0 if ok else 1


def _indexed_kill(work: Path, i: int, mode: str, victim: str, step: int, delay: float,
                  seed: int) -> dict:
    return {"index": i, **run_kill(work, i, mode, victim, step, delay, seed)}


def run_each(work: Path, jobs: list) -> tuple[list[dict], dict]:
    """Runs each job (a call returning its result line) in `work`, printing each line as it
    ends; (the lines, the load before and after and the seconds they took)."""
    work.mkdir(parents=True, exist_ok=True)
    t0, load = time.monotonic(), os.getloadavg()
    runs = []
    for job in jobs:
        runs.append(job())
        print(json.dumps(runs[-1]), flush=True)
    return runs, {"load_before": [round(x, 2) for x in load],
                  "load_after": [round(x, 2) for x in os.getloadavg()],
                  "seconds": round(time.monotonic() - t0, 1)}


def main_modes(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    modes = list(ALL) if args.modes == "all" else [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown or not modes:
        ap.error(f"--modes {unknown or args.modes!r}: use some of {list(MODES)}, or all")
    if args.kills < 1:
        ap.error(f"--kills {args.kills}: give at least 1")
    todo = list(enumerate(plan_modes(modes, args.kills, args.seed)))
    if args.only:  # a part of the plan (the rest run in other calls, merged with --merge)
        only = args.only.split(",")
        todo = [t for t in todo if t[1][0] in only or str(t[0]) in only]
    if args.plan:
        for i, (mode, victim, step, delay) in todo:
            print(f"{i}: {mode}: kill {victim} after step {step} + {delay:.2f} s")
        return 0
    work = Path(args.work)
    runs, part = run_each(work, [partial(_indexed_kill, work, i, *kill, args.seed)
                                 for i, kill in todo])
    results = {"machine": machine(), "seed": args.seed, "steps": STEPS, "modes": modes,
               "kills": args.kills, **part, "runs": runs}
    if args.merge and args.out and Path(args.out).exists():
        old = json.loads(Path(args.out).read_text())
        if (old["seed"], old["kills"], old["modes"]) != (args.seed, args.kills, modes):
            ap.error(f"--merge: {args.out} was planned with another --seed / --kills / --modes")
        new = {r["index"]: r for r in runs}
        kept = [r for r in old["runs"] if r["index"] not in new]
        results = dict(old, runs=sorted(kept + runs, key=lambda r: r["index"]),
                       seconds=round(old["seconds"] + part["seconds"], 1),
                       load_after=part["load_after"])
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(modes_table(results))
    return 0 if all(r.get("equal") and not r.get("left_after_fault") and not r["left_at_end"]
                    for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
