"""The child side of megagrpo.agent.sandbox: run as `python -I -B sandbox_child.py`, standard
library only (it must not import megagrpo or torch; under 'kernel' megagrpo is not even
visible).

In order: read the job (JSON) from stdin; under 'weak' enter a new user + network namespace
when the parent asks (the parent probed that it works); set the resource limits; install the
audit hook; add the job's site directories; run the job: a code string (`mode: code`),
`module:function(**arguments)` (`mode: call`, the result written to stdout as text or JSON,
the function's own prints to stderr) or a user tool's schema (`mode: schema`: the module
imported here, never in the rank; the schema derived by tool_schema.py, loaded from beside this
file). With `--probe` it only tries the namespace and exits 0
when it works.

The audit hook's role depends on the isolation. Under 'kernel' it is a diagnostic only: the
kernel refuses what must be refused (a socket cannot reach anything, a write outside /tmp hits
a read-only mount, a process cannot leave the pid namespace), and the hook merely notes that the
code tried the network so a failed call says why. Under 'weak' it is all there is, and it
refuses sockets, process creation, ctypes and writes outside the scratch dir (best effort:
code can remove it, which is why 'weak' must be asked for).
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import linecache
import os
import resource
import site
import sys
import traceback

EXIT_MEMORY = 86
"""Exit status of a child whose code hit the memory limit (MemoryError under RLIMIT_AS)."""
EXIT_SANDBOX = 87
"""Exit status of a child that could not set up its isolation (the code did not run)."""
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
REFUSED_EVENTS = ("socket.", "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn",
                  "os.fork", "os.forkpty", "pty.spawn", "ctypes.dlopen", "ctypes.dlsym",
                  "ctypes.call_function")
"""Audit events refused once the hook is in: any socket operation; creating a process (a new
interpreter would run without the hook); loading or calling C functions through ctypes (a
direct socket syscall)."""
SOURCE_NAME = "<tool>"


def enter_network_namespace() -> int:
    """unshare(CLONE_NEWUSER | CLONE_NEWNET): the process sees only a loopback device that is
    down, so no connection can leave it. Returns 0 or the errno. Must run while the process is
    single-threaded (a fresh interpreter is)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        return ctypes.get_errno() or -1
    return 0


def set_limits(limits: dict, per_call_user: bool) -> None:
    """RLIMIT_CPU (SIGXCPU at the soft limit, SIGKILL a second later), RLIMIT_AS (allocations
    fail with MemoryError), RLIMIT_FSIZE (a bigger file write is killed by SIGXFSZ), no core
    files; RLIMIT_NPROC when the process runs in the call's own user namespace
    (`per_call_user`): the kernel counts it per (user namespace, uid), so per call. Outside
    one it would count every process of the trainer's user, so 'weak' leaves it alone (and
    refuses process creation in the hook). Root outside the namespace is exempt from it: there
    the call's cgroup (pids.max) is the bound."""
    cpu = max(1, int(-(-limits["cpu_s"] // 1)))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    memory = int(limits["memory_mb"]) * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    size = int(limits["file_mb"]) * 2**20
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if per_call_user:
        nproc = int(limits["processes"])
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))


WRITE_EVENTS: dict[str, tuple[tuple[int, int | None], ...]] = {
    "os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),),
    "os.chmod": ((0, 2),), "os.chown": ((0, 3),), "os.utime": ((0, 3),),
    "os.symlink": ((1, 2),), "os.rename": ((0, 2), (1, 3)), "os.link": ((0, 2), (1, 3)),
    "os.truncate": ((0, None),), "os.chflags": ((0, None),), "os.lchflags": ((0, None),),
    "os.setxattr": ((0, None),), "os.removexattr": ((0, None),), "shutil.rmtree": ((0, 1),),
    "shutil.copyfile": ((1, None),), "shutil.copymode": ((1, None),),
    "shutil.copystat": ((1, None),), "shutil.copytree": ((1, None),),
    "shutil.chown": ((0, None),), "shutil.make_archive": ((0, None),),
    "shutil.unpack_archive": ((1, None),)}
"""Audit events that change the filesystem, with the (path, dir_fd) positions of their
arguments: allowed only on paths inside the scratch dir."""
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
DEVICES = ("/dev/null",)


class Guard:
    """The weak mode's audit hook: raises PermissionError at the call site of a refused
    operation: a REFUSED_EVENTS one, or a filesystem change (an open for writing, a
    WRITE_EVENTS one) on a path outside `root` (the scratch dir). Best effort: CPython
    documents audit hooks as no security boundary."""

    def __init__(self, root: str) -> None:
        self.root = os.path.realpath(root)

    def __call__(self, event: str, args: tuple) -> None:
        if event.startswith(REFUSED_EVENTS):
            raise PermissionError(f"{event} is not allowed in the tool sandbox (no network, "
                                  "no processes, no ctypes)")
        if event == "open":
            path, mode, flags = args
            writes = (any(c in mode for c in "wax+") if isinstance(mode, str)
                      else bool((flags or 0) & WRITE_FLAGS))
            if writes and not isinstance(path, int):
                self.check(path, None)
        elif event in WRITE_EVENTS:
            for path_at, fd_at in WRITE_EVENTS[event]:
                path = args[path_at] if path_at < len(args) else None
                dir_fd = args[fd_at] if fd_at is not None and fd_at < len(args) else None
                if isinstance(path, (str, bytes, os.PathLike)):
                    self.check(path, dir_fd if isinstance(dir_fd, int) and dir_fd >= 0 else None)

    def check(self, path: object, dir_fd: int | None) -> None:
        path = os.fsdecode(path)
        if dir_fd is not None and not os.path.isabs(path):
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        real = os.path.realpath(path)
        if real not in DEVICES and os.path.commonpath([real, self.root]) != self.root:
            raise PermissionError(f"writing {path!r} is not allowed in the tool sandbox (only "
                                  "its working directory is writable)")


class NetworkNote:
    """The kernel mode's audit hook, a diagnostic: remembers whether the code used a socket,
    so that a failed call can add why it failed (there is no network). Refuses nothing."""

    def __init__(self) -> None:
        self.used = False

    def __call__(self, event: str, args: tuple) -> None:
        if event.startswith("socket."):
            self.used = True

    def explain(self) -> None:
        if self.used:
            sys.stderr.write("[sandbox: this sandbox has no network]\n")


def print_user_traceback(exc: BaseException) -> None:
    """The exception's traceback without this file's frames (the model sees its own code and
    the library frames it called, not the sandbox's)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename != __file__]
    text = "".join(["Traceback (most recent call last):\n", *traceback.format_list(frames),
                    *traceback.format_exception_only(type(exc), exc)])
    sys.stderr.write(text)


def run_code(code: str) -> None:
    """Runs `code` as a script named <tool> (its lines appear in tracebacks)."""
    linecache.cache[SOURCE_NAME] = (len(code), None, code.splitlines(True), SOURCE_NAME)
    compiled = compile(code, SOURCE_NAME, "exec")
    exec(compiled, {"__name__": "__main__", "__builtins__": __builtins__})


def call_function(job: dict) -> None:
    """Imports `module`, calls `function(**arguments)` and writes its result (a str as is,
    anything else as JSON) to the original stdout; the function's prints go to stderr."""
    sys.path[:0] = job["sys_path"]
    result_fd = _stdout_to_stderr()
    target = importlib.import_module(job["module"])
    for part in job["function"].split("."):
        target = getattr(target, part)
    result = target(**job["arguments"])
    _write_result(result_fd, result if isinstance(result, str) else json.dumps(result, default=str))


def describe_function(job: dict) -> None:
    """Imports `module` and writes `function`'s schema as JSON to the original stdout:
    {name, description, parameters}, or {problem, detail} saying what is wrong (the parent
    turns it into a ValueError naming agent.tools)."""
    sys.path[:0] = job["sys_path"]
    result_fd = _stdout_to_stderr()
    spec = f"{job['module']}:{job['function']}"
    found: dict = {}
    try:
        target = importlib.import_module(job["module"])
    except ImportError as e:
        found = {"problem": "import", "detail": str(e)}
    except Exception as e:  # noqa: BLE001 - user code failing at import time
        found = {"problem": "raised", "detail": f"{type(e).__name__}: {e}"}
    for part in job["function"].split(".") if not found else []:
        if not hasattr(target, part):
            found = {"problem": "attribute", "detail": part}
            break
        target = getattr(target, part)
    if not found and not inspect.isfunction(target):
        found = {"problem": "not_function", "detail": type(target).__name__}
    if not found:
        try:
            description, parameters = _tool_schema().function_schema(target, spec)
            found = {"name": target.__name__, "description": description,
                     "parameters": parameters}
        except ValueError as e:
            found = {"problem": "schema", "detail": str(e)}
    _write_result(result_fd, json.dumps(found))


def _tool_schema() -> object:
    """megagrpo/agent/tool_schema.py, loaded by path from beside this file (megagrpo itself
    is not importable here)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tool_schema.py")
    spec = importlib.util.spec_from_file_location("megagrpo_tool_schema", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses / typing look their module up
    spec.loader.exec_module(module)
    return module


def _stdout_to_stderr() -> int:
    """Points fd 1 at stderr (user code's prints) and returns a copy of the real stdout."""
    result_fd = os.dup(1)
    os.dup2(2, 1)
    return result_fd


def _write_result(result_fd: int, text: str) -> None:
    sys.stdout.flush()
    with os.fdopen(result_fd, "w", encoding="utf-8") as out:
        out.write(text)


MODES = {"code": lambda job: run_code(job["code"]), "call": call_function,
         "schema": describe_function}


def main() -> int:
    if sys.argv[1:] == ["--probe"]:
        err = enter_network_namespace()
        if err:
            print(os.strerror(err) if err > 0 else "unshare failed", file=sys.stderr)
        return 1 if err else 0
    job = json.loads(sys.stdin.buffer.read())
    kernel = job["isolation"] == "kernel"
    if job.get("netns"):
        err = enter_network_namespace()
        if err:
            print(f"sandbox: cannot enter a network namespace ({os.strerror(err)})",
                  file=sys.stderr)
            return EXIT_SANDBOX
    set_limits(job["limits"], per_call_user=kernel)
    sys.dont_write_bytecode = True
    for site_dir in job.get("site_dirs", []):
        site.addsitedir(site_dir)
    note = NetworkNote()
    sys.addaudithook(note if kernel else Guard(os.getcwd()))
    try:
        MODES[job["mode"]](job)
    except MemoryError:
        os.write(2, b"MemoryError: the tool exceeded its memory limit\n")
        return EXIT_MEMORY
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - the model sees any failure as a traceback
        print_user_traceback(exc)
        note.explain()
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)
