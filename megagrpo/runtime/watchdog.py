"""Stall watchdog: a frozen rank or a stalled phase ends the whole run with one line naming it.

Without it, a rank that freezes (SIGSTOP, a debugger, a host swapping to death) leaves the
others blocked in their next collective, silently, until the collective timeout.

Every rank runs a daemon thread that, every `interval_s`:
1. publishes a heartbeat (sequence number, step, phase, phase age, pid, host; also at once
   when the phase changes, so a rank that freezes mid-phase is reported in it) under its rank's
   key in the job's c10d store (torchrun's agent store at MASTER_ADDR:MASTER_PORT, reached over
   a connection of its own so it never shares a socket with the main thread);
2. reads the heartbeat of the next rank (a ring: rank r watches r+1 mod world, so the store
   serves O(world) requests per interval). When that sequence number has not moved for
   `peer_timeout_s`, the peer is frozen or dead;
3. checks its own phase: one that has run longer than `stall_timeout_s` is a stalled step.
On either it prints one line naming the rank(s) and phase, SIGKILLs a frozen peer that is a
stopped process on this host (a stopped process ignores torchrun's SIGTERM, which costs 30 s),
and exits the process with EXIT_STALLED; torchrun then tears the job down. gloo and NCCL waits
release the GIL, so the thread runs while the main thread is blocked in a collective, and a
SIGSTOPped rank's thread stops with it. Timing uses each rank's own monotonic clock only (the
peer's sequence number is compared, not its timestamps), so clock skew between nodes is
harmless.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch.distributed as dist

from megagrpo.config.run import WatchdogConfig

EXIT_STALLED = 124
"""Exit code of a rank the watchdog stops (as coreutils `timeout` uses)."""
KEY_PREFIX = "megagrpo/heartbeat"
MAX_LISTED_RANKS = 256
"""Above this world size a stalled-phase report reads no heartbeats but the watched peer's."""


@dataclass(frozen=True)
class WatchdogSettings:
    """How often to beat and when to give up (seconds; 0 turns a check off)."""

    interval_s: float
    """Heartbeat period."""
    peer_timeout_s: float
    """A watched peer whose heartbeat has not moved for this long is frozen or dead."""
    stall_timeout_s: float
    """A phase running longer than this is a stalled step."""


@dataclass(frozen=True)
class Beat:
    """One published heartbeat."""

    rank: int
    seq: int
    """Increases by one per beat: the only thing a watcher compares."""
    step: int
    phase: str
    phase_s: float
    """How long the phase had been running when the beat was sent."""
    pid: int
    host: str
    start_ticks: int
    """The process's start time in /proc clock ticks (-1 when unknown): tells a reused pid."""
    done: bool = False
    """The rank finished its run and stopped beating on purpose."""
    role: str = ""
    """'rollout': a rollout rank of separate placement (its steps are the batches it draws);
    '': a training rank."""

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def decode(raw: bytes) -> Beat:
        return Beat(**json.loads(raw))


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of a local process, None when unreadable."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # the command name may hold spaces and ')'
    return fields[0], int(fields[19])


def _kill_if_stopped(beat: Beat) -> bool:
    """SIGKILL the peer if it is a stopped process on this host (same pid and start time)."""
    if beat.host != socket.gethostname():
        return False
    stat = _proc_stat(beat.pid)
    if stat is None or stat[0] not in "Tt" or stat[1] != beat.start_ticks:
        return False
    os.kill(beat.pid, signal.SIGKILL)
    return True


def _exit_process(message: str) -> None:
    """The default reaction: the line is already printed; leave now, from this thread."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_STALLED)


def _rank_ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(out)


def _ranks(ranks: list[int]) -> str:
    """'rank 3' or 'ranks 0-2,5'."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_rank_ranges(ranks)}"


def job_key_prefix(attempt: int | None = None) -> str:
    """Store keys unique to this job attempt (torchrun restarts reuse the agent's store);
    `attempt`: another attempt's (None: this one's)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", os.environ.get("MASTER_PORT", "local"))
    if attempt is None:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    return f"{KEY_PREFIX}/{run}/{attempt}"


def last_beats(store: dist.Store, attempt: int, world_size: int) -> list[Beat]:
    """The last heartbeat each rank of job attempt `attempt` published (ranks that published
    none are left out)."""
    keys = [f"{job_key_prefix(attempt)}/{r}" for r in range(world_size)]
    return [Beat.decode(store.get(k)) for k in keys if store.check([k])]


def how_attempt_ended(beats: list[Beat], attempt: int) -> str:
    """One console line on how a job attempt's ranks ended, read from their last heartbeats:
    a rank that left through Python (an error, or the end of its work) said so (`done`); one
    that did not was killed: SIGKILL, the OOM killer or a crash, or torchrun's SIGTERM once
    another rank had failed (torchrun's own line above gives each one's exit code)."""
    def who(b: Beat) -> str:
        unit = "batch" if b.role == "rollout" else "step"
        return (f"{'rollout rank' if b.role == 'rollout' else 'rank'} {b.rank} (pid {b.pid} on "
                f"{b.host}, last in phase '{b.phase}' of {unit} {b.step})")

    killed = [who(b) for b in beats if not b.done]
    left = [who(b) for b in beats if b.done]
    if not beats:
        return f"attempt {attempt} of the job left no heartbeat to tell how it ended"
    return (f"attempt {attempt} of the job ended: "
            + "; ".join(filter(None, [
                f"killed without a word (SIGKILL, the OOM killer, a crash, or torchrun "
                f"stopping it after another rank failed): {', '.join(killed)}" if killed else "",
                f"left through an error or its end: {', '.join(left)}" if left else ""])))


def describe_previous_attempt(world_size: int, timeout_s: float = 10.0) -> str:
    """`how_attempt_ended` for the attempt before this torchrun restart ('' outside torchrun,
    on a first attempt, or when the store cannot be read: it only informs)."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if attempt == 0 or "MASTER_PORT" not in os.environ:
        return ""
    try:
        store = connect_job_store(timeout_s)
        return how_attempt_ended(last_beats(store, attempt - 1, world_size), attempt - 1)
    except Exception as e:  # noqa: BLE001 - a report must not fail the restart
        return f"attempt {attempt - 1}'s heartbeats could not be read ({type(e).__name__}: {e})"


def connect_job_store(timeout_s: float) -> dist.Store:
    """A fresh client of the job's TCPStore at MASTER_ADDR:MASTER_PORT (torchrun's agent store;
    without torchrun, the one rank 0's init_process_group serves)."""
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ["MASTER_PORT"])
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


class Watchdog:
    """Heartbeat + stall checks for one rank; `start()` it, mark phases, `stop()` it.

    store_factory makes the store connection (called on the watchdog thread, retried each
    interval until it succeeds); None = world size 1, no peers to watch. on_stall gets the
    message after it is printed; the default exits the process with EXIT_STALLED."""

    def __init__(self, settings: WatchdogSettings, *, rank: int, world_size: int,
                 store_factory: Callable[[], dist.Store] | None = None,
                 on_stall: Callable[[str], None] = _exit_process,
                 clock: Callable[[], float] = time.monotonic,
                 key_prefix: str | None = None) -> None:
        self.settings = settings
        self.rank, self.world_size = rank, world_size
        self.store_factory = store_factory if world_size > 1 else None
        self.on_stall = on_stall
        self.clock = clock
        self.prefix = key_prefix if key_prefix is not None else job_key_prefix()
        self.peer = (rank + 1) % world_size if world_size > 1 else None
        """The rank this one watches."""
        self.store: dist.Store | None = None
        self.state: tuple[str, int, float] = ("setup", 0, clock())
        """(phase, step, monotonic start of the phase); replaced whole, so reads are atomic."""
        self.seq = 0
        self.peer_seen: tuple[int, float] = (-1, clock())
        """(the watched peer's last sequence number, when it last changed)."""
        self.peer_beat: Beat | None = None
        self.peer_done = False
        self.store_error = ""
        self.role = ""
        """What this rank is, published with its beats (`Beat.role`; `serve_rollouts` sets
        'rollout'), so a watcher names a frozen rollout rank as one."""
        stat = _proc_stat(os.getpid())
        self.identity = (os.getpid(), socket.gethostname(), stat[1] if stat else -1)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the main thread's side
    def set_phase(self, phase: str, step: int | None = None) -> None:
        """Marks the start of `phase` (of `step`; None keeps the current step)."""
        _, old_step, _ = self.state
        self.state = (phase, old_step if step is None else step, self.clock())
        self._wake.set()  # publish now: a rank that freezes in this phase is reported in it

    def start(self) -> Watchdog:
        """Starts the thread (not needed, so not started, with one rank and no stall check)."""
        if self._thread is None and (self.settings.stall_timeout_s or self.store_factory):
            self._thread = threading.Thread(target=self._loop, name="megagrpo-watchdog",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Ends the thread after telling the watching rank that this one is done."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.store is not None:
            with contextlib.suppress(Exception):  # best effort: the job may be going down
                self._publish(done=True)

    # ------------------------------------------------------------------ the watchdog thread
    def _loop(self) -> None:
        while True:
            self._wake.wait(self.settings.interval_s)  # a beat per interval and phase change
            self._wake.clear()
            if self._stop.is_set():
                return
            message, frozen = self.tick()
            if message is not None:
                self._fire(message, frozen)
                return

    def tick(self) -> tuple[str | None, Beat | None]:
        """One round: publish, watch the peer, check the phase. Returns (message, the frozen
        peer's last beat) when the run must stop, else (None, None)."""
        now = self.clock()
        self._connect()
        if self.store is not None:
            try:
                self._publish()
                self._read_peer(now)
            except Exception as e:  # noqa: BLE001 - a store hiccup must not kill the thread
                self.store_error = f"{type(e).__name__}: {e}"
        frozen = self._check_peer(now)
        if frozen is not None:
            return frozen, self.peer_beat
        return self._check_phase(now), None

    def _connect(self) -> None:
        if self.store is None and self.store_factory is not None:
            try:
                self.store = self.store_factory()
            except Exception as e:  # noqa: BLE001 - retried next interval
                self.store_error = f"{type(e).__name__}: {e}"

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/{rank}"

    def _publish(self, done: bool = False) -> None:
        phase, step, start = self.state
        self.seq += 1
        pid, host, ticks = self.identity
        beat = Beat(rank=self.rank, seq=self.seq, step=step, phase=phase,
                    phase_s=round(self.clock() - start, 3), pid=pid, host=host,
                    start_ticks=ticks, done=done, role=self.role)
        self.store.set(self._key(self.rank), beat.encode())

    def _read(self, rank: int) -> Beat | None:
        """A rank's last heartbeat; None when it has published none yet (check() never
        blocks, get() of a missing key would wait for the store timeout)."""
        key = self._key(rank)
        return Beat.decode(self.store.get(key)) if self.store.check([key]) else None

    def _read_peer(self, now: float) -> None:
        beat = self._read(self.peer)
        if beat is None:
            return
        self.peer_beat, self.peer_done = beat, beat.done
        if beat.seq != self.peer_seen[0]:
            self.peer_seen = (beat.seq, now)
        self.store_error = ""

    def _check_peer(self, now: float) -> str | None:
        limit, b = self.settings.peer_timeout_s, self.peer_beat
        silent = now - self.peer_seen[1]
        # A peer that has not beaten yet is still starting (ranks import at different speeds):
        # the set-up phase's stall check and init_process_group's timeout cover it.
        if b is None or not limit or self.peer_done or silent <= limit:
            return None
        phase, step, start = self.state
        here = f"this rank is in phase '{phase}' of step {step} for {now - start:.1f} s"
        who, unit = ("rollout rank", "batch") if b.role == "rollout" else ("rank", "step")
        what = (f"{who} {b.rank} (pid {b.pid} on {b.host}) sent no heartbeat for "
                f"{silent:.1f} s > watchdog.heartbeat_timeout_s={limit:g}; its last: phase "
                f"'{b.phase}' of {unit} {b.step} (running {b.phase_s:.1f} s then)")
        error = f"; store error: {self.store_error}" if self.store_error else ""
        return (f"megagrpo watchdog on rank {self.rank}: {what}; {here}{error}. The rank is "
                "frozen (SIGSTOP, a debugger, swapping) or hangs holding the GIL: stopping the "
                f"run (exit code {EXIT_STALLED})")

    def _check_phase(self, now: float) -> str | None:
        limit = self.settings.stall_timeout_s
        phase, step, start = self.state
        if not limit or now - start <= limit:
            return None
        return (f"megagrpo watchdog on rank {self.rank}: phase '{phase}' of step {step} has "
                f"run {now - start:.1f} s > watchdog.stall_timeout_s={limit:g}; "
                f"{self._peers_summary()}"
                ". Raise watchdog.stall_timeout_s if the phase is legitimately this slow (a first "
                "vLLM compile, a large model's step), or set it to 0 to turn the check off: "
                f"stopping the run (exit code {EXIT_STALLED})")

    def _peers_summary(self) -> str:
        """'ranks 0-2 in update of step 3 (12.0 s); rank 3 in rollout of step 3 (40.2 s)'."""
        if self.store is None:
            return "no other rank's heartbeat is known" if self.world_size > 1 else "one rank"
        ranks = range(self.world_size) if self.world_size <= MAX_LISTED_RANKS else [self.peer]
        groups: dict[tuple[str, int], list[tuple[int, float]]] = {}
        missing = []
        for r in ranks:
            try:
                beat = self._read(r)
            except Exception:  # noqa: BLE001 - a report must not fail on a store hiccup
                beat = None
            if beat is None:
                missing.append(r)
            else:
                groups.setdefault((beat.phase, beat.step), []).append((r, beat.phase_s))
        parts = [f"{_ranks([r for r, _ in v])} in '{p}' of step {s} (up to "
                 f"{max(t for _, t in v):.1f} s)" for (p, s), v in sorted(groups.items())]
        if missing:
            parts.append(f"no heartbeat from {_ranks(missing)}")
        return "heartbeats: " + "; ".join(parts)

    def _fire(self, message: str, frozen: Beat | None) -> None:
        print(message, file=sys.stderr, flush=True)
        if frozen is not None and _kill_if_stopped(frozen):
            print(f"megagrpo watchdog on rank {self.rank}: sent SIGKILL to stopped rank "
                  f"{frozen.rank} (pid {frozen.pid})", file=sys.stderr, flush=True)
        self.on_stall(message)


def start_watchdog(wd_cfg: WatchdogConfig, rank: int, world_size: int) -> Watchdog:
    """The run's watchdog from `WatchdogConfig` (heartbeat_interval_s, heartbeat_timeout_s,
    stall_timeout_s), started with phase 'setup'. Validates watchdog.* first: it starts before the
    rest of the config is checked, so that set-up itself is watched."""
    wd_cfg.validate()
    settings = WatchdogSettings(interval_s=wd_cfg.heartbeat_interval_s,
                                peer_timeout_s=wd_cfg.heartbeat_timeout_s,
                                stall_timeout_s=wd_cfg.stall_timeout_s)
    timeout = max(5.0, 2 * settings.interval_s)
    factory = partial(connect_job_store, timeout) if "MASTER_PORT" in os.environ else None
    return Watchdog(settings, rank=rank, world_size=world_size, store_factory=factory).start()
