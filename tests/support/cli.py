"""`python -m megagrpo ...` as a user runs it, in a subprocess."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support import ROOT


def cli_env(**changes: str | None) -> dict[str, str]:
    """This environment as a user's shell would have it: one OpenMP thread (the launcher
    sets its ranks' own), the repository root first on PYTHONPATH and no TRITON_INTERPRET
    (the test session's setting for in-process kernels; the command picks its kernel path
    itself and the interpreter would only slow vLLM down). `changes` set variables, None
    removes one."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def run_cli(*args: str, timeout: float = 600, cwd: str | Path | None = None,
            **env: str | None) -> subprocess.CompletedProcess:
    """Runs `python -m megagrpo ARGS` to its end (output captured as text; `env` as in
    `cli_env`); the caller checks the return code."""
    return subprocess.run([sys.executable, "-m", "megagrpo", *args], capture_output=True,
                          text=True, env=cli_env(**env), timeout=timeout, cwd=cwd)
