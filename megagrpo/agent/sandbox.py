"""Run untrusted Python (a tool's code or a user tool function) in a child process with limits.

Each call starts a fresh interpreter running megagrpo/agent/sandbox_child.py (never a fork of a
rank that holds torch, CUDA or vLLM); the job (code, or module/function/arguments) goes in on
its stdin. How the child is isolated is `Limits.isolation` (agent.sandbox):

- 'kernel' (the default): the kernel is the boundary. The child runs under bubblewrap in fresh
  user, mount, pid, network, IPC and UTS namespaces (megagrpo.agent.isolation): a read-only
  view of only what Python needs, a size-capped tmpfs as /tmp (the scratch dir, cwd, HOME),
  no network, no process outside the call visible or signalable, every process of the call
  killed when its first one exits or the wall clock runs out; whole-call limits on processes
  and memory in a cgroup when one can be made here. Where bubblewrap cannot run, such tools
  are refused before compute (`isolation_problem`), never run weaker.
- 'weak' (only when a recipe says agent.sandbox: weak): a child process in its own session
  with a scratch directory under the run's scratch root, a network namespace when the kernel
  allows one, and the Python audit hook that refuses sockets, process creation, ctypes and
  writes outside the scratch dir. The hook is no security boundary (CPython documents audit
  hooks as such); this mode is for machines where namespaces are unavailable and the model's
  code is trusted enough.

In both: a wall-clock limit (the process group is killed with SIGKILL); RLIMIT_CPU, RLIMIT_AS,
RLIMIT_FSIZE, no core files (set in the child); a minimal environment; stdout and stderr read
incrementally up to a byte cap, at which the call is killed (a child printing 10 MB neither
fills memory nor blocks).

Nothing the code does makes these functions raise: a crash, a timeout, a limit or a failure to
start becomes a `SandboxResult` saying so.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.util
import itertools
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from megagrpo.agent import isolation
from megagrpo.agent import sandbox_child as child
from megagrpo.config.agent import SANDBOX_MODES, AgentConfig

log = logging.getLogger("megagrpo")

CHILD_SCRIPT = Path(child.__file__)
READ_CHUNK = 65536
FIELD = "agent.sandbox"


@dataclass(frozen=True, kw_only=True)
class Limits:
    """What one sandboxed call may use, and how it is isolated."""

    wall_s: float = 10.0
    cpu_s: float = 5.0
    memory_mb: int = 512
    """Address space of each process (RLIMIT_AS) and, under a cgroup, memory of the whole call
    (its tmpfs pages included)."""
    output_bytes: int = 4096
    """Cap on stdout + stderr together; the process is killed when it writes more."""
    file_mb: int = 64
    """Largest file the code may write (RLIMIT_FSIZE); under 'kernel' also the size of each of
    the call's tmpfs mounts (/tmp, /dev/shm): all the disk a call has."""
    processes: int = 32
    """Most processes (threads included) of one call together: the cgroup's pids.max, else
    RLIMIT_NPROC in the call's user namespace."""
    isolation: str = "kernel"
    """'kernel' (bubblewrap namespaces) or 'weak' (a child process and the audit hook)."""

    @classmethod
    def from_config(cls, cfg: AgentConfig) -> Limits:
        return cls(wall_s=cfg.tool_timeout_s, cpu_s=cfg.tool_cpu_s,
                   memory_mb=cfg.tool_memory_mb, output_bytes=cfg.tool_output_bytes,
                   processes=cfg.tool_processes, isolation=cfg.sandbox)


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


def isolation_problem(mode: str) -> str:
    """'' when sandboxed calls can run with agent.sandbox=`mode` here, else one line naming
    the field and the fix (the caller refuses the tools before compute)."""
    if mode not in SANDBOX_MODES:
        return f"{FIELD}={mode!r}: use one of {SANDBOX_MODES}"
    why = isolation.kernel_isolation() if mode == "kernel" else ""
    if why:
        return (f"{FIELD}=kernel: the python tool and user tools run only inside kernel "
                f"namespaces, and {why}; {isolation.INSTALL_HINT}, or set agent.sandbox: weak "
                "to run them behind a Python audit hook only (no security boundary)")
    return ""


@functools.lru_cache(maxsize=2)
def announce_isolation(mode: str) -> str:
    """Says once on the console which isolation sandboxed tools run with; returns the line."""
    if mode == "kernel":
        seccomp = "seccomp" if isolation.seccomp_filter() is not None else "no seccomp filter"
        limits = isolation.whole_call_limits()
        if limits == "rlimits" and os.geteuid() == 0:  # root is exempt from RLIMIT_NPROC
            limits += ("; as root without a cgroup scope a call's process count is bounded "
                       "by its wall clock only")
        line = ("tool sandbox: kernel (bubblewrap: user, mount, pid, network, IPC namespaces; "
                f"read-only root, tmpfs scratch; {seccomp}; whole-call limits: {limits})")
        log.info(line)
    else:
        line = (f"tool sandbox: weak (agent.sandbox=weak: a child process, "
                f"{network_isolation()}; the audit hook is no security boundary)")
        log.warning(line)
    return line


@functools.lru_cache(maxsize=1)
def network_isolation() -> str:
    """Under agent.sandbox=weak: 'namespace+hook' when a child can enter a new user + network
    namespace here, else 'hook' (the audit hook only). Probed once per process."""
    try:
        probe = subprocess.run([sys.executable, "-I", str(CHILD_SCRIPT), "--probe"],
                               capture_output=True, text=True, timeout=30, env=_child_env("/"),
                               cwd="/", stdin=subprocess.DEVNULL)
        ok = probe.returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return "namespace+hook" if ok else "hook"


def run_code(code: str, limits: Limits) -> SandboxResult:
    """Runs the Python source `code` as a script; its stdout/stderr come back."""
    return _run({"mode": "code", "code": code}, limits, [])


def call_function(module: str, function: str, arguments: dict, limits: Limits,
                  sys_path: list[str] | None = None) -> SandboxResult:
    """Imports `module` in the child and calls `function(**arguments)` (JSON values); stdout is
    the result (a str as is, else JSON), stderr the function's prints and any traceback.
    `sys_path` (default: the sys.path entry `module` is found in, located without importing
    it) is where the child imports from; under 'kernel' it is bound read-only, nothing else
    of the host's files besides the interpreter."""
    if sys_path is None:
        sys_path = module_root(module)
    return _run({"mode": "call", "module": module, "function": function,
                 "arguments": arguments, "sys_path": sys_path}, limits, sys_path)


def describe_function(module: str, function: str, limits: Limits,
                      sys_path: list[str] | None = None) -> SandboxResult:
    """Imports `module` in the child and derives `function`'s tool schema there
    (megagrpo.agent.tool_schema): stdout is one JSON object, {name, description, parameters}
    or {problem, detail} (problem: 'import', 'raised', 'attribute', 'not_function' or
    'schema'). The rank never imports a user's tool module."""
    if sys_path is None:
        sys_path = module_root(module)
    return _run({"mode": "schema", "module": module, "function": function,
                 "sys_path": sys_path}, limits, sys_path)


def module_root(module: str) -> list[str]:
    """[the sys.path entry holding `module`'s top-level package], found without importing
    it; [] for a module that is not a file (a built-in) or is not found."""
    top = module.split(".")[0]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.origin or not os.path.isabs(spec.origin):
        return []
    origin = Path(spec.origin)
    return [str(origin.parent.parent if origin.name == "__init__.py" else origin.parent)]


def _child_env(scratch: str) -> dict[str, str]:
    """The weak child's environment: the kernel sandbox's, with the scratch dir on disk."""
    return {**isolation.sandbox_env(), "PATH": os.defpath, "HOME": scratch, "TMPDIR": scratch}


def _run(job: dict, limits: Limits, binds: list[str]) -> SandboxResult:
    start = time.monotonic()
    job = {**job, "isolation": limits.isolation,
           "limits": {"cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb,
                      "file_mb": limits.file_mb, "processes": limits.processes}}
    try:
        with LAUNCHERS[limits.isolation](job, limits, binds) as proc:
            _send(proc, job)
            return _collect(proc, limits, start)
    except Exception as e:  # noqa: BLE001 - e.g. EAGAIN on fork, no bwrap: never raise
        return SandboxResult(stdout="", stderr=f"sandbox: {type(e).__name__}: {e}",
                             exit_code=None, limit="sandbox", seconds=time.monotonic() - start)


def _send(proc: subprocess.Popen, job: dict) -> None:
    """Writes the job to the child's stdin and closes it. A child that died first (bwrap
    refusing its arguments) is not an error here: its stderr says why."""
    try:
        proc.stdin.write(json.dumps(job).encode("utf-8"))
        proc.stdin.close()
    except BrokenPipeError:
        pass


_calls = itertools.count()


@contextlib.contextmanager
def _launch_kernel(job: dict, limits: Limits, binds: list[str]) -> Iterator[subprocess.Popen]:
    """bwrap around the child, in a cgroup scope when one can be made; the scope is killed
    and removed afterwards (nothing of the call outlives it)."""
    why = isolation.kernel_isolation()
    if why:
        raise RuntimeError(f"{FIELD}=kernel: {why}")
    python, python_dirs, sites = isolation.python_binds()
    job["site_dirs"] = sites
    scope = None
    if isolation.whole_call_limits() != "rlimits":
        scope = isolation.open_scope(f"{os.getpid()}-{next(_calls)}", limits.processes,
                                     limits.memory_mb * 2**20)
    try:
        with isolation.seccomp_fd() as fd:
            argv = isolation.bwrap_argv(python, [*python_dirs, *binds], limits.file_mb * 2**20,
                                        fd)
            with _popen(isolation.scope_wrapper(scope, argv), cwd="/", env={"PATH": os.defpath},
                        pass_fds=() if fd is None else (fd,)) as proc:
                yield proc
    finally:
        if scope is not None:
            scope.close()


@contextlib.contextmanager
def _launch_weak(job: dict, limits: Limits, binds: list[str]) -> Iterator[subprocess.Popen]:
    """A plain child in a scratch dir under the run's scratch root, deleted afterwards."""
    job["netns"] = network_isolation() == "namespace+hook"
    scratch = tempfile.mkdtemp(prefix="call-", dir=scratch_root())
    try:
        with _popen([sys.executable, "-I", "-B", str(CHILD_SCRIPT)], cwd=scratch,
                    env=_child_env(scratch)) as proc:
            yield proc
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def _popen(argv: list[str], cwd: str, env: dict[str, str],
           pass_fds: tuple[int, ...] = ()) -> Iterator[subprocess.Popen]:
    """The child in its own session (its group is what the wall clock kills), pipes on all
    three streams; killed and reaped however the block ends."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, pass_fds=pass_fds)
    try:
        yield proc
    finally:
        _kill_group(proc)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            stream.close()
        proc.wait()


LAUNCHERS: dict[str, Callable[..., contextlib.AbstractContextManager[subprocess.Popen]]] = {
    "kernel": _launch_kernel, "weak": _launch_weak}


SCRATCH_PREFIX = "megagrpo-tools-"


@functools.lru_cache(maxsize=1)
def scratch_root() -> str:
    """This process's root of weak-mode scratch dirs (`$TMPDIR/megagrpo-tools-<pid>`, mode
    0700), made once and removed at exit; roots whose process is gone (a run killed before it
    cleaned up) are swept first."""
    base = tempfile.gettempdir()
    for name in os.listdir(base):
        pid = name[len(SCRATCH_PREFIX):]
        if name.startswith(SCRATCH_PREFIX) and pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
    root = os.path.join(base, f"{SCRATCH_PREFIX}{os.getpid()}")
    os.makedirs(root, mode=0o700, exist_ok=True)
    atexit.register(shutil.rmtree, root, True)  # a run that ends normally leaves nothing
    return root


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
    code = _signal_status(proc.wait())
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


def _signal_status(code: int) -> int:
    """bwrap reports a child killed by signal S as exit status 128 + S; this is -S, as
    subprocess reports it (a child exiting with 129..159 itself reads as killed too)."""
    return -(code - 128) if 128 < code < 160 else code


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
