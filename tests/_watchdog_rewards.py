"""Rewards for tests/test_watchdog.py's end-to-end run."""
import os
import signal
import time
from pathlib import Path


def freeze_when_flagged(completion: str, answer: str, flag: str = "", rank: int = 1) -> float:
    """Rank `rank` stops itself (SIGSTOP, the whole process) at its first call once file
    `flag` exists, after writing the time to `flag`.stalled_at; otherwise a length reward."""
    if flag and int(os.environ.get("RANK", 0)) == rank and Path(flag).exists():
        Path(f"{flag}.stalled_at").write_text(str(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)
    return len(completion) / 10.0
