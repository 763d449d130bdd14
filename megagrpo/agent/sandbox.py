"""Run untrusted Python (a tool's code or a user tool function) in a child process with limits.

Each call starts `python -I megagrpo/agent/sandbox_child.py` (a fresh interpreter, never a fork
of a rank that holds torch, CUDA or vLLM) in its own session, with:
- a wall-clock limit: the whole process group is killed (SIGKILL) when it passes;
- RLIMIT_CPU, RLIMIT_AS (memory), RLIMIT_FSIZE, no core files (set in the child);
- a fresh scratch directory as cwd, HOME and TMPDIR, deleted afterwards;
- a minimal environment (no proxies, no PYTHONPATH; `-I` ignores PYTHON* variables);
- stdout and stderr read incrementally up to a byte cap: at the cap reading stops and the
  process group is killed, so a child printing 10 MB neither fills memory nor blocks;
- no network: a new user + network namespace when the kernel allows one (probed once per
  process: `network_isolation`), and in any case an audit hook in the child that refuses
  sockets, process creation and ctypes before the code runs. The hook alone is not a security
  boundary (Python documents audit hooks as such); the namespace is;
- writes only inside the scratch directory: the same audit hook refuses opening a file for
  writing, removing, renaming, chmod-ing (...) a path outside it. This is best effort (the
  hook, no kernel boundary): the child runs as the trainer's user and can read what it can.

Nothing the code does makes these functions raise: a crash, a timeout, a limit or a failure to
start becomes a `SandboxResult` saying so.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from megagrpo.agent import sandbox_child as child
from megagrpo.config.agent import AgentConfig

log = logging.getLogger("megagrpo")

CHILD_SCRIPT = Path(child.__file__)
READ_CHUNK = 65536


@dataclass(frozen=True, kw_only=True)
class Limits:
    """What one sandboxed call may use."""

    wall_s: float = 10.0
    cpu_s: float = 5.0
    memory_mb: int = 512
    output_bytes: int = 4096
    """Cap on stdout + stderr together; the process is killed when it writes more."""
    file_mb: int = 64
    """Largest file the code may write (RLIMIT_FSIZE)."""

    @classmethod
    def from_config(cls, cfg: AgentConfig) -> Limits:
        return cls(wall_s=cfg.tool_timeout_s, cpu_s=cfg.tool_cpu_s,
                   memory_mb=cfg.tool_memory_mb, output_bytes=cfg.tool_output_bytes)


@dataclass(frozen=True, kw_only=True)
class SandboxResult:
    """How a sandboxed call ended."""

    stdout: str
    stderr: str
    exit_code: int | None
    """The child's exit status (negative: killed by that signal); None if it never started."""
    timed_out: bool = False
    truncated: bool = False
    """The output reached Limits.output_bytes; the child was killed there."""
    limit: str = ""
    """Which limit ended the call: '', 'wall', 'output', 'cpu', 'memory', 'file size',
    'killed' (SIGKILL from elsewhere: the hard CPU limit, the OOM killer) or 'sandbox' (the
    child could not be started or set up)."""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.limit


@functools.lru_cache(maxsize=1)
def network_isolation() -> str:
    """'namespace+hook' when a child can enter a new user + network namespace here, else
    'hook' (the audit hook only). Probed once per process, and said once on the console."""
    try:
        probe = subprocess.run([sys.executable, "-I", str(CHILD_SCRIPT), "--probe"],
                               capture_output=True, text=True, timeout=30, env=_child_env("/"),
                               cwd="/", stdin=subprocess.DEVNULL)
        ok, why = probe.returncode == 0, probe.stderr.strip()
    except (OSError, subprocess.SubprocessError) as e:
        ok, why = False, str(e)
    if ok:
        log.info("tool sandbox: no network (a new user + network namespace and an audit hook)")
        return "namespace+hook"
    log.warning("tool sandbox: cannot create a network namespace here (%s); sockets are refused "
                "only by a Python audit hook, which is not a security boundary", why or "?")
    return "hook"


def run_code(code: str, limits: Limits) -> SandboxResult:
    """Runs the Python source `code` as a script; its stdout/stderr come back."""
    return _run({"mode": "code", "code": code}, limits)


def call_function(module: str, function: str, arguments: dict, limits: Limits,
                  sys_path: list[str] | None = None) -> SandboxResult:
    """Imports `module` in the child and calls `function(**arguments)` (JSON values); stdout is
    the result (a str as is, else JSON), stderr the function's prints and any traceback.
    `sys_path` (default: this process's, '' resolved to the cwd) is where the child imports
    from."""
    if sys_path is None:
        sys_path = [p or os.getcwd() for p in sys.path]
    return _run({"mode": "call", "module": module, "function": function,
                 "arguments": arguments, "sys_path": sys_path}, limits)


def _child_env(scratch: str) -> dict[str, str]:
    """A minimal environment: no proxies, no PYTHONPATH, one thread per math library."""
    return {"PATH": os.defpath, "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1"}


def _run(job: dict, limits: Limits) -> SandboxResult:
    start = time.monotonic()
    scratch = tempfile.mkdtemp(prefix="megagrpo-tool-")
    try:
        job = {**job, "netns": network_isolation() == "namespace+hook",
               "limits": {"cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb,
                          "file_mb": limits.file_mb}}
        Path(scratch, child.JOB_FILE).write_text(json.dumps(job), encoding="utf-8")
        proc = subprocess.Popen([sys.executable, "-I", "-B", str(CHILD_SCRIPT)], cwd=scratch,
                                env=_child_env(scratch), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        return _collect(proc, limits, start)
    except Exception as e:  # noqa: BLE001 - e.g. EAGAIN on fork, a full disk: never raise
        return SandboxResult(stdout="", stderr=f"sandbox: {type(e).__name__}: {e}",
                             exit_code=None, limit="sandbox", seconds=time.monotonic() - start)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _collect(proc: subprocess.Popen, limits: Limits, start: float) -> SandboxResult:
    """Reads stdout/stderr until both close, the output cap or the deadline; then kills the
    process group (also any process the code left behind) and reaps the child."""
    deadline = start + limits.wall_s
    chunks: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
    room, truncated, timed_out = limits.output_bytes, False, False
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
        sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
        while sel.get_map() and not truncated:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            for key, _ in sel.select(timeout=remaining):
                data = os.read(key.fd, READ_CHUNK)
                if not data:
                    sel.unregister(key.fileobj)
                    continue
                chunks[key.data].append(data[:room])
                truncated, room = len(data) > room, max(0, room - len(data))
                if truncated:
                    break
    if not (truncated or timed_out):
        try:  # the pipes closed; the process may still run (it closed them itself)
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    _kill_group(proc)
    proc.stdout.close()
    proc.stderr.close()
    code = proc.wait()
    return SandboxResult(
        stdout=b"".join(chunks["stdout"]).decode("utf-8", errors="replace"),
        stderr=b"".join(chunks["stderr"]).decode("utf-8", errors="replace"),
        exit_code=code, timed_out=timed_out, truncated=truncated,
        limit=_which_limit(code, timed_out, truncated), seconds=time.monotonic() - start)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the child's process group (its own session), before the child is reaped so
    the group id cannot have been reused."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _which_limit(code: int, timed_out: bool, truncated: bool) -> str:
    if timed_out:
        return "wall"
    if truncated:
        return "output"
    if code == -signal.SIGXCPU:
        return "cpu"
    if code == -signal.SIGKILL:
        return "killed"  # not by us: the RLIMIT_CPU hard limit or the kernel's OOM killer
    if code == child.EXIT_MEMORY:
        return "memory"
    if code == -signal.SIGXFSZ:
        return "file size"
    if code == child.EXIT_SANDBOX:
        return "sandbox"
    return ""
