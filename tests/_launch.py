"""Launches a test worker under torchrun with real processes over gloo."""
from __future__ import annotations

import os
import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str, nproc: int, *args: str, timeout: int = 600) -> str:
    """Runs `script` on `nproc` local ranks; raises with the workers' output on failure."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    # workers pick their kernel path explicitly; the interpreter would only slow vLLM down
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", script, *args]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    out = p.stdout + p.stderr
    if p.returncode != 0:
        raise RuntimeError(f"torchrun {script} failed (rc={p.returncode}):\n{out[-8000:]}")
    return out
