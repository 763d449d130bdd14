"""`python -m megagrpo ...` as a user runs it, in a subprocess."""
from __future__ import annotations

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
