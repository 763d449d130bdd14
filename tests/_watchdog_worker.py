"""Run under torchrun (2 ranks, gloo) by tests/test_watchdog.py: a stand-in training loop with
the run's real watchdog (`start_watchdog`, as `megagrpo.run.train` starts it) and real gloo
collectives, which then stalls as --scenario says:

- freeze: rank 1 stops itself with SIGSTOP 0.3 s into phase 'update' of step 3;
- slow: rank 0 sleeps in phase 'score' of step 2 while rank 1 waits in a collective;
- collective: no watchdog; `init_distributed` with parallel.collective_timeout_s=2, then rank 1
  enters a world-group and then a megatron TP-group collective 4 s late; every rank writes
  WORK/collective_rank<r>.json with how long it waited and what it raised.

Each rank writes its pid to WORK/pid_rank<r> first, so the test can make sure none is left,
and the stalling rank writes the time it stalls to WORK/stalled_at."""
import argparse
import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

LATE_S = 4.0  # twice the 2 s timeout: a rank that waited for the peer waited ~4 s, not ~2 s


def timed_all_reduce(group=None) -> dict:
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=group)
        error = ""
    except Exception as e:  # noqa: BLE001 - the test reads what was raised
        error = f"{type(e).__name__}: {e}"
    return {"waited_s": time.monotonic() - t0, "error": error[:300]}


def _release(store: dist.Store) -> None:
    while int(store.add("collective_ready", 0)) < 2:
        time.sleep(0.05)
    store.set("collective_go", "1")


def collective(work: Path, rank: int) -> None:
    import megatron.core.parallel_state  # noqa: F401 - imported before the barrier below

    from megagrpo.config.model import ParallelConfig
    from megagrpo.runtime.distributed import init_distributed, tp_group

    # The timeout also bounds connecting each new group: start both ranks together (a slow
    # import on a loaded machine must not eat into it)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=120))
    store.add("collective_ready", 1)
    if rank == 0:
        _release(store)
    store.wait(["collective_go"])
    init_distributed(ParallelConfig(tp=2, collective_timeout_s=2.0))
    rounds = {}
    for name, group in (("world", None), ("megatron_tp", tp_group())):
        if rank == 1:
            time.sleep(LATE_S)
        rounds[name] = timed_all_reduce(group)
    (work / f"collective_rank{rank}.json").write_text(json.dumps(rounds))
    os._exit(0)  # the groups are broken now; skip the teardown


def stall_loop(work: Path, scenario: str, rank: int, world: int) -> None:
    from megagrpo.config.run import WatchdogConfig
    from megagrpo.runtime.metrics import PhaseTimer
    from megagrpo.runtime.watchdog import start_watchdog

    # freeze: only the heartbeat check can fire; slow: only the stall check can (the heartbeat
    # timeout is far longer, so a rank starved by a loaded machine is not taken for frozen)
    run = WatchdogConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=6.0 if scenario == "freeze"
                    else 30.0, stall_timeout_s=60.0 if scenario == "freeze" else 3.0)
    watchdog = start_watchdog(run, rank, world)
    # a long collective timeout: the watchdog, not gloo, must be what ends the run
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    for step in range(1, 7):
        t = PhaseTimer(watchdog, step=step)
        for phase in ("rollout", "score", "update"):
            with t(phase):
                if scenario == "freeze" and rank == 1 and (step, phase) == (3, "update"):
                    time.sleep(0.3)  # frozen mid-phase
                    (work / "stalled_at").write_text(str(time.time()))
                    os.kill(os.getpid(), signal.SIGSTOP)
                if scenario == "slow" and rank == 0 and (step, phase) == (2, "score"):
                    (work / "stalled_at").write_text(str(time.time()))
                    time.sleep(120.0)
                dist.all_reduce(torch.ones(1))
                time.sleep(0.1)
    watchdog.stop()
    print(f"rank {rank}: finished without the watchdog firing", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--scenario", choices=("freeze", "slow", "collective"), required=True)
    args = ap.parse_args()
    work = Path(args.work)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    (work / f"pid_rank{rank}").write_text(str(os.getpid()))
    if args.scenario == "collective":
        collective(work, rank)
    else:
        stall_loop(work, args.scenario, rank, world)


if __name__ == "__main__":
    main()
