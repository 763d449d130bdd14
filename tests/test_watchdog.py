"""No hangs: the stall watchdog names a frozen rank or a stalled phase and ends the run, and the
collective timeout is a setting that reaches every process group.

The checks of `Watchdog.tick` run on a fake clock over an in-process store; the end-to-end
ones launch 2 real ranks under torchrun (tests/_watchdog_worker.py) and freeze one with SIGSTOP.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from megagrpo.config.model import ModelConfig, ParallelConfig
from megagrpo.config.run import WatchdogConfig
from megagrpo.runtime.watchdog import EXIT_STALLED, Watchdog, WatchdogSettings
from tests.support.launch import alive, torchrun_command, worker_env

WORKER = os.path.join(os.path.dirname(__file__), "_watchdog_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def pair(settings: WatchdogSettings) -> tuple[FakeClock, Watchdog, Watchdog]:
    """The fake clock, and rank 0 and rank 1 of a 2-rank job sharing one in-process store and
    that clock (not started: each `tick` returns what it would report)."""
    clock, store = FakeClock(), dist.HashStore()
    w0, w1 = (Watchdog(settings, rank=r, world_size=2, store_factory=lambda: store,
                       on_stall=lambda message: None, clock=clock, key_prefix="job")
              for r in range(2))
    return clock, w0, w1


def quiet_seconds(clock: FakeClock, seconds: int, *watchdogs: Watchdog) -> None:
    """`seconds` one-second ticks of `watchdogs` (in that order): none of them reports."""
    for _ in range(seconds):
        clock.now += 1
        for w in watchdogs:
            assert w.tick() == (None, None)


def test_frozen_peer_is_named_with_its_last_phase():
    clock, w0, w1 = pair(WatchdogSettings(interval_s=1, peer_timeout_s=5, stall_timeout_s=0))
    w0.set_phase("update", 3)
    w1.set_phase("update", 3)
    quiet_seconds(clock, 20, w1, w0)  # both beating: rank 1's long phase is not a frozen rank
    quiet_seconds(clock, 5, w0)  # rank 1 stops beating: within the timeout nothing fires
    clock.now += 1
    message, frozen = w0.tick()
    assert frozen is not None and frozen.rank == 1 and frozen.pid == os.getpid()
    assert "on rank 0: rank 1 (pid" in message and "no heartbeat for 6.0 s" in message
    assert "phase 'update' of step 3" in message and "heartbeat_timeout_s=5" in message


def test_frozen_rollout_rank_is_named_as_one():
    """Separate placement: a rollout rank's beats say what it is, so the training rank
    watching it names a frozen rollout rank as one, in the batch it was drawing."""
    clock, w0, w1 = pair(WatchdogSettings(interval_s=1, peer_timeout_s=5, stall_timeout_s=0))
    w1.role = "rollout"
    w0.set_phase("rollout", 2)
    w1.set_phase("rollout", 3)
    quiet_seconds(clock, 3, w1, w0)
    quiet_seconds(clock, 5, w0)
    clock.now += 1
    message, frozen = w0.tick()
    assert frozen is not None and frozen.role == "rollout"
    assert "megagrpo watchdog on rank 0: rollout rank 1 (pid" in message
    assert "phase 'rollout' of batch 3" in message


def test_a_finished_peer_is_not_frozen():
    clock, w0, w1 = pair(WatchdogSettings(interval_s=1, peer_timeout_s=3, stall_timeout_s=0))
    w1.tick()
    w0.tick()
    w1.stop()  # publishes its last beat, marked done
    quiet_seconds(clock, 10, w0)


def test_stalled_phase_names_the_phase_and_every_rank_phase():
    clock, w0, w1 = pair(WatchdogSettings(interval_s=1, peer_timeout_s=0, stall_timeout_s=10))
    w0.set_phase("score", 2)
    w1.set_phase("update", 2)
    quiet_seconds(clock, 10, w1, w0)
    w1.set_phase("update", 2)  # rank 1 moves on; rank 0's phase goes past the limit
    clock.now += 1
    w1.tick()
    message, frozen = w0.tick()
    assert frozen is None
    assert "phase 'score' of step 2 has run 11.0 s > watchdog.stall_timeout_s=10" in message
    assert "rank 0 in 'score' of step 2" in message and "rank 1 in 'update' of step 2" in message


def test_thread_fires_on_a_stalled_phase_and_stops_cleanly():
    fired = []
    wd = Watchdog(WatchdogSettings(interval_s=0.05, peer_timeout_s=0, stall_timeout_s=0.3),
                  rank=0, world_size=1, on_stall=fired.append).start()
    wd.set_phase("rollout", 1)
    time.sleep(0.1)
    assert not fired  # a short phase is fine
    wd.set_phase("update", 1)
    deadline = time.monotonic() + 5
    while not fired and time.monotonic() < deadline:
        time.sleep(0.05)
    wd.stop()
    assert len(fired) == 1 and "phase 'update' of step 1" in fired[0]
    assert wd._thread is None


@pytest.mark.parametrize("override, field", [
    (dict(heartbeat_interval_s=0.0), "watchdog.heartbeat_interval_s"),
    (dict(heartbeat_interval_s=float("nan")), "watchdog.heartbeat_interval_s"),
    (dict(heartbeat_timeout_s=10.0), "watchdog.heartbeat_timeout_s"),  # < 3 beats of 5 s
    (dict(stall_timeout_s=-1.0), "watchdog.stall_timeout_s"),
    (dict(stall_timeout_s=float("inf")), "watchdog.stall_timeout_s"),
])
def test_watchdog_settings_are_range_checked(override, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        WatchdogConfig(**override).validate()
    WatchdogConfig(stall_timeout_s=0.0, heartbeat_timeout_s=0.0).validate()  # both off is valid


@pytest.mark.parametrize("value", [0.0, -5.0, float("nan"), float("inf")])
def test_collective_timeout_is_range_checked(value):
    with pytest.raises(ValueError, match=r"parallel\.collective_timeout_s"):
        ParallelConfig(collective_timeout_s=value).validate(ModelConfig())


# ------------------------------------------------------------------------- real processes
def launch(work: Path, scenario: str, timeout: float) -> tuple[int, str, float]:
    """torchrun, 2 ranks of the worker: (return code, output, seconds from the stall to the
    end of torchrun). Whatever happens, no rank is left behind: a stopped one is continued
    and every one is killed."""
    cmd = torchrun_command(2, WORKER, "--work", str(work), "--scenario", scenario)
    p = subprocess.Popen(cmd, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        out += f"\n[test: torchrun killed after {timeout} s]"
    finally:
        left = _reap_ranks(work)
    assert not left, f"ranks left running after torchrun ended: {left}\n{out[-4000:]}"
    stalled = work / "stalled_at"
    seconds = time.time() - float(stalled.read_text()) if stalled.exists() else float("nan")
    return p.returncode, out, seconds


def _reap_ranks(work: Path) -> list[int]:
    """Kills every rank that is still alive (SIGCONT first for a stopped one); returns them."""
    alive = []
    for f in work.glob("pid_rank*"):
        pid = int(f.read_text())
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


def test_frozen_rank_stops_the_run_naming_rank_and_phase(tmp_path):
    # heartbeat timeout 6 s, stall timeout 60 s, gloo timeout 300 s: only the heartbeat check
    # can end this run in time, and only the SIGKILL of the stopped rank ends it before
    # torchrun's own 30 s SIGTERM grace would (the bound leaves room for a loaded machine)
    rc, out, seconds = launch(tmp_path, "freeze", timeout=200)
    assert rc != 0, out[-4000:]
    # the last heartbeat may precede the stall marker by up to one interval (0.5 s)
    assert 6 - 0.5 <= seconds < 30, (seconds, out[-4000:])
    assert "megagrpo watchdog on rank 0: rank 1 (pid" in out, out[-4000:]
    assert "its last: phase 'update' of step 3" in out
    assert "sent SIGKILL to stopped rank 1" in out
    assert f"exitcode  : {EXIT_STALLED}" in out  # torchrun's report of rank 0
    assert "finished without the watchdog firing" not in out


def test_stalled_phase_stops_the_run_naming_the_phase(tmp_path):
    rc, out, seconds = launch(tmp_path, "slow", timeout=200)  # rank 0 would sleep 120 s
    assert rc != 0, out[-4000:]
    assert 3 < seconds < 30, (seconds, out[-4000:])
    assert "phase 'score' of step 2 has run" in out, out[-4000:]
    assert "watchdog.stall_timeout_s=3" in out, out[-4000:]
    assert "ranks 0-1 in 'score' of step 2" in out  # both alive, both in the stalled phase
    assert "finished without the watchdog firing" not in out


def test_collective_timeout_reaches_world_and_megatron_groups(tmp_path):
    rc, out, _ = launch(tmp_path, "collective", timeout=300)
    assert rc == 0, out[-4000:]
    r0 = json.loads((tmp_path / "collective_rank0.json").read_text())
    for group in ("world", "megatron_tp"):
        # rank 1 arrives 4 s late: with parallel.collective_timeout_s=2 rank 0 gives up at ~2 s
        # (a timeout that did not reach the group would wait the 4 s and succeed)
        assert "Timed out" in r0[group]["error"], (group, r0)
        assert 1.8 < r0[group]["waited_s"] < 3.5, (group, r0)


@pytest.mark.parametrize("placement", [
    "colocated", pytest.param("separate", marks=pytest.mark.heavy)])  # separate: ~1 min more
def test_frozen_rank_in_a_real_run_is_named(tmp_path, placement):
    """End to end: `python -m megagrpo train --nproc 2` (megatron + vLLM per rank); once step 1
    is logged, rank 1 stops itself inside a reward call of the next step's rollout. Separate
    placement (1 training rank + 1 rollout rank, issue 47): rank 1 is the rollout rank, which
    scores its samples; the training rank names it as a rollout rank, in the batch it drew."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import resume_stress as stress  # the tiny 2-rank run and its launch helpers

    separate = placement == "separate"
    flag, out, log = tmp_path / "freeze", tmp_path / "run", tmp_path / "run.log"
    proc = stress.launch(out, 20, log, *(stress.MODES["separate"] if separate else ()),
                         "checkpoint.every=0", "checkpoint.at_end=false",
                         f"reward.terms=[{{name: 'tests._watchdog_rewards:freeze_when_flagged', "
                         f"kwargs: {{flag: '{flag}'}}}}]",
                         "watchdog.heartbeat_interval_s=1", "watchdog.heartbeat_timeout_s=8")
    below: set[int] = set()
    try:
        stress.wait_for_step(proc, out, 1, timeout=400)
        below = stress.descendants(proc.pid)  # torchrun and the ranks
        flag.touch()
        rc = proc.wait(timeout=200)
        ended = time.time()
        left = [p for p in below if alive(p)]
    finally:
        for pid in [proc.pid, *below]:  # a stopped rank ignores all but SIGKILL; SIGCONT in case
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        proc.wait()
    text = log.read_text()
    seconds = ended - float(Path(f"{flag}.stalled_at").read_text())
    assert rc != 0, text[-4000:]
    assert seconds < 40, (seconds, text[-4000:])
    who, unit = ("rollout rank", "batch") if separate else ("rank", "step")
    assert f"megagrpo watchdog on rank 0: {who} 1 (pid" in text, text[-4000:]
    assert f"its last: phase 'rollout' of {unit} " in text, text[-4000:]
    assert "sent SIGKILL to stopped rank 1" in text, text[-4000:]
    assert len(below) >= 3 and not left, (below, left)  # torchrun + 2 ranks, all gone



def test_a_restart_says_which_rank_of_the_attempt_before_was_killed():
    """After a torchrun restart, rank 0 reads the attempt before's last heartbeats: a rank
    that left through Python published `done` (an error, or its end); the others were killed
    (the rollout rank SIGKILLed here), each named with its pid and last phase."""
    from megagrpo.runtime.watchdog import Beat, how_attempt_ended

    beats = [Beat(rank=0, seq=9, step=3, phase="weight_sync", phase_s=0.1, pid=11, host="h",
                  start_ticks=1, done=True),
             Beat(rank=1, seq=7, step=4, phase="rollout", phase_s=0.2, pid=12, host="h",
                  start_ticks=1, role="rollout")]
    line = how_attempt_ended(beats, 0)
    killed, left = line.split("left through an error or its end: ")
    assert line.startswith("attempt 0 of the job ended: killed without a word")
    assert "rollout rank 1 (pid 12 on h, last in phase 'rollout' of batch 4)" in killed
    assert left == "rank 0 (pid 11 on h, last in phase 'weight_sync' of step 3)"
    assert "no heartbeat" in how_attempt_ended([], 2)
