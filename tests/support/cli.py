"""`python -m megagrpo ...` as a user runs it, in a subprocess."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support import child_env


def cli_env(**changes: str | None) -> dict[str, str]:
    """`child_env` with one OpenMP thread (the launcher sets its ranks' own)."""
    return child_env(**{"OMP_NUM_THREADS": "1", **changes})


def run_cli(*args: str, timeout: float = 600, cwd: str | Path | None = None,
            **env: str | None) -> subprocess.CompletedProcess:
    """Runs `python -m megagrpo ARGS` to its end (output captured as text; `env` as in
    `cli_env`); the caller checks the return code."""
    return subprocess.run([sys.executable, "-m", "megagrpo", *args], capture_output=True,
                          text=True, env=cli_env(**env), timeout=timeout, cwd=cwd)


def train_logged(out_dir: Path, *args: str, timeout: float = 900) -> tuple[str, list[dict]]:
    """`megagrpo train *args run.out_dir=out_dir`, which must succeed: (the console and every
    rank's full log, where step and rollout-rank lines go; metrics.jsonl's step records)."""
    p = run_cli("train", *args, f"run.out_dir={out_dir}", timeout=timeout)
    console = p.stdout + p.stderr
    assert p.returncode == 0, console[-6000:]
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    logs = "".join(f.read_text() for f in sorted((out_dir / "logs").glob("rank*.log")))
    return console + logs, [r for r in records if "loss" in r]
