"""Rewards for tests/test_watchdog.py's end-to-end run."""
import os
import signal
import time
from pathlib import Path


def freeze_when_flagged(completion: str, answer: str, flag: str = "", rank: int = 1,
                        settle_s: float = 2.5) -> float:
    """Rank `rank` stops itself (SIGSTOP, the whole process) at its first call once file
    `flag` exists, after writing the time to `flag`.stalled_at; otherwise a length reward.

    It first runs `settle_s` seconds in the phase (more than the heartbeat interval): a peer
    reports the last beat it *received*, and a rank stopped within milliseconds of entering a
    phase (before its watchdog thread got the GIL to publish it) is reported in the phase
    before, which is the truth as the peer can know it, not the freeze this test names."""
    if flag and int(os.environ.get("RANK", 0)) == rank and Path(flag).exists():
        time.sleep(settle_s)
        Path(f"{flag}.stalled_at").write_text(str(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)
    return len(completion) / 10.0
