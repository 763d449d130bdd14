"""The kernel boundary of a sandboxed tool call: bubblewrap namespaces and a cgroup per call.

`bwrap_argv` builds the command line of one call. The call runs in fresh namespaces:
- user: the code runs as uid/gid 65534 with no capabilities, and cannot create further user
  namespaces (`--disable-userns`); no_new_privs is set by bwrap;
- mount: a new root holding read-only binds of what Python needs (/usr, a few /etc files, the
  interpreter's prefix, the site-packages directories, for a user tool its sys.path entries)
  and nothing else: the run's directories, /home, /root, other calls' scratch are absent. /tmp
  is a size-capped tmpfs (the scratch dir, cwd and HOME), /dev/shm another; / and /dev are
  read-only; /proc is the pid namespace's own;
- pid: the call's processes see only each other; none can signal anything outside. When the
  call's first process exits, bwrap's init exits and the kernel kills every process left in
  the namespace (a `setsid` daemon included); `--die-with-parent` does the same when the rank
  kills bwrap at the wall-clock limit;
- network (only a loopback that is down), IPC, UTS, cgroup;
- seccomp (x86_64): the system calls a tool has no use for and that are the usual kernel
  attack surface (io_uring, bpf, userfaultfd, perf_event_open, keyrings, ptrace, mount and
  namespace calls, module and kexec loading) fail with EPERM (`seccomp_filter`).

`CallScope` holds whole-call limits in a cgroup when one can be created here (cgroup v2 with
the pids and memory controllers delegated, or cgroup v1's pids and memory hierarchies as
root): at most `Limits.processes` tasks and `Limits.memory_mb` of memory (tmpfs pages
included) for all of the call's processes together. Where none can be created the child's
rlimits are what bounds a call (RLIMIT_NPROC counts per user namespace, so per call, unless
the trainer runs as root, which it ignores).
"""
from __future__ import annotations

import contextlib
import functools
import os
import platform
import shutil
import struct
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SANDBOX_UID = 65534
CHILD_DIR = "/opt/megagrpo"
CHILD_FILES = ("sandbox_child.py", "tool_schema.py")
"""The child script and the schema code it loads, bound read-only into CHILD_DIR."""
CHILD_PATH = f"{CHILD_DIR}/sandbox_child.py"
SCRATCH = "/tmp"
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "nsswitch.conf",
             "passwd", "group", "alternatives")
"""The /etc entries bound: enough for the dynamic loader, time zones and getpwuid; no
shadow, no ssh, no certificates (there is no network)."""
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
CGROUP_PREFIX = "megagrpo-tool-"
INSTALL_HINT = ("install bubblewrap (apt-get install bubblewrap; scripts/setup_venv.sh does "
                "it as root) and allow unprivileged user namespaces "
                "(sysctl kernel.unprivileged_userns_clone=1)")


def bwrap_argv(python: str, binds: list[str], disk_bytes: int,
               seccomp_fd: int | None = None) -> list[str]:
    """The bwrap command line running `python -I -B CHILD_PATH` in fresh namespaces, with the
    directories `binds` visible read-only at their own paths, `disk_bytes` of tmpfs each on
    /tmp and /dev/shm, and the seccomp program readable from `seccomp_fd` when given."""
    bwrap = shutil.which("bwrap") or "bwrap"  # absolute: the child's PATH is a minimal one
    argv = [bwrap, *(["--seccomp", str(seccomp_fd)] if seccomp_fd is not None else []),
            "--unshare-all", "--unshare-user", "--uid", str(SANDBOX_UID), "--gid",
            str(SANDBOX_UID), "--disable-userns", "--die-with-parent", "--new-session",
            "--cap-drop", "ALL", "--hostname", "sandbox", "--clearenv"]
    for name, value in sandbox_env().items():
        argv += ["--setenv", name, value]
    for path in SYSTEM_DIRS:
        argv += _mirror(path)
    for name in ETC_FILES:
        argv += _mirror(f"/etc/{name}")
    argv += ["--proc", "/proc", "--dev", "/dev",
             "--size", str(disk_bytes), "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
             "--size", str(disk_bytes), "--tmpfs", SCRATCH]
    for path in binds:  # after /tmp's tmpfs: a bound directory may live under the host's /tmp
        argv += _mirror(path)
    for name in CHILD_FILES:
        argv += ["--ro-bind", str(Path(__file__).with_name(name)), f"{CHILD_DIR}/{name}"]
    argv += ["--remount-ro", "/", "--chdir", SCRATCH, "--", python, "-I", "-B", CHILD_PATH]
    return argv


def _mirror(path: str) -> list[str]:
    """bwrap arguments showing host `path` at the same place: a symlink as a symlink (merged
    /usr systems link /bin to usr/bin), anything else as a read-only bind; [] when absent."""
    if os.path.islink(path) and os.path.dirname(path) in ("/", "/etc"):
        return ["--symlink", os.readlink(path), path]
    return ["--ro-bind", path, path] if os.path.exists(path) else []


def sandbox_env() -> dict[str, str]:
    """The whole environment of the code: no proxies, no PYTHONPATH, one thread per math
    library, the scratch dir as HOME and TMPDIR."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": SCRATCH, "TMPDIR": SCRATCH,
            "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def python_binds() -> tuple[str, list[str], list[str]]:
    """(interpreter, directories to bind, site directories to add in the child). The base
    interpreter runs (a venv's bin/python is a symlink chain through paths that are not
    bound); the venv's site-packages are added by the child with site.addsitedir, so its .pth
    files apply. megagrpo itself is not bound: tool code cannot import the trainer."""
    python = os.path.realpath(sys.executable)
    sites = sorted({os.path.realpath(p) for p in (sysconfig.get_paths()["purelib"],
                                                  sysconfig.get_paths()["platlib"])
                    if os.path.isdir(p)})
    prefix = os.path.realpath(sys.base_prefix)
    binds = [prefix, *(s for s in sites if not s.startswith(prefix + os.sep))]
    if not python.startswith(prefix + os.sep):
        binds.append(os.path.dirname(python))
    return python, binds, sites


@functools.lru_cache(maxsize=1)
def kernel_isolation() -> str:
    """'' when a bwrap sandbox starts here (probed once per process by running the
    interpreter in one, seccomp filter included), else why not, in one line."""
    if shutil.which("bwrap") is None:
        return "bwrap (bubblewrap) is not installed"
    python, binds, _ = python_binds()
    try:
        with seccomp_fd() as fd:
            argv = bwrap_argv(python, binds, 2**20, fd)
            argv[argv.index("--") + 1:] = [python, "-I", "-c", "pass"]
            probe = subprocess.run(argv, capture_output=True, text=True, timeout=30,
                                   stdin=subprocess.DEVNULL, pass_fds=() if fd is None else (fd,))
    except (OSError, subprocess.SubprocessError) as e:
        return f"bwrap failed to start ({e})"
    if probe.returncode != 0:
        why = probe.stderr.strip() or f"exit status {probe.returncode}"
        return f"bwrap cannot create the namespaces here ({why})"
    return ""


# ---------------------------------------------------------------------------------------------
# seccomp

DENIED_SYSCALLS_X86_64 = {
    "ptrace": 101, "syslog": 103, "pivot_root": 155, "acct": 163, "mount": 165, "umount2": 166,
    "swapon": 167, "swapoff": 168, "reboot": 169, "init_module": 175, "delete_module": 176,
    "quotactl": 179, "lookup_dcookie": 212, "kexec_load": 246, "add_key": 248,
    "request_key": 249, "keyctl": 250, "unshare": 272, "perf_event_open": 298,
    "name_to_handle_at": 303, "open_by_handle_at": 304, "setns": 308,
    "process_vm_readv": 310, "process_vm_writev": 311, "finit_module": 313,
    "kexec_file_load": 320, "bpf": 321, "userfaultfd": 323, "io_uring_setup": 425,
    "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428, "move_mount": 429,
    "fsopen": 430, "fsmount": 432, "fspick": 433}
"""System calls refused (EPERM) in the sandbox, by x86_64 number (asm/unistd_64.h)."""
AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
_LD_ABS, _JEQ, _JGE, _RET = 0x20, 0x15, 0x35, 0x06
_ALLOW, _ERRNO, _KILL = 0x7FFF0000, 0x00050000, 0x80000000
EPERM = 1


def seccomp_filter() -> bytes | None:
    """A classic-BPF seccomp program (struct sock_filter[]) refusing DENIED_SYSCALLS_X86_64
    with EPERM, killing a call made through another ABI (i386 or x32, where the numbers
    differ); None off x86_64 (no filter there: the console does not claim one)."""
    if platform.machine() != "x86_64":
        return None
    ops = [(_LD_ABS, 0, 0, 4),  # seccomp_data.arch
           (_JEQ, 1, 0, AUDIT_ARCH_X86_64), (_RET, 0, 0, _KILL),
           (_LD_ABS, 0, 0, 0),  # seccomp_data.nr
           (_JGE, 0, 1, X32_SYSCALL_BIT), (_RET, 0, 0, _KILL)]
    for nr in sorted(DENIED_SYSCALLS_X86_64.values()):
        ops += [(_JEQ, 0, 1, nr), (_RET, 0, 0, _ERRNO | EPERM)]
    ops.append((_RET, 0, 0, _ALLOW))
    return b"".join(struct.pack("=HBBI", *op) for op in ops)


@contextlib.contextmanager
def seccomp_fd() -> Iterator[int | None]:
    """A pipe's read end holding the seccomp program, for bwrap's `--seccomp FD` (passed to
    it with pass_fds, closed here after); None where there is no program."""
    program = seccomp_filter()
    if program is None:
        yield None
        return
    read, write = os.pipe()
    try:
        os.write(write, program)  # ~ 600 bytes: fits the pipe's buffer
        os.close(write)
        write = -1
        yield read
    finally:
        os.close(read)
        if write >= 0:
            os.close(write)


# ---------------------------------------------------------------------------------------------
# whole-call limits


@dataclass(frozen=True)
class CallScope:
    """One call's cgroup directories (one per hierarchy: one for v2, pids + memory for v1):
    the call's first process joins them before it starts bwrap."""

    dirs: tuple[str, ...]

    def procs_files(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def close(self) -> None:
        """Kills whatever is still inside and removes the directories (retried briefly: the
        kernel frees a killed task asynchronously)."""
        for d in self.dirs:
            _kill_members(d)
        for d in self.dirs:
            for _ in range(250):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.002)


def _kill_members(d: str) -> None:
    try:
        Path(d, "cgroup.kill").write_text("1")
        return
    except OSError:
        pass
    try:
        pids = Path(d, "cgroup.procs").read_text().split()
    except OSError:
        return
    for pid in pids:
        try:
            os.kill(int(pid), 9)
        except (ProcessLookupError, PermissionError, ValueError):
            pass


def _own_cgroups() -> dict[str, str]:
    """{controller or '' (v2): path} of this process, from /proc/self/cgroup."""
    out: dict[str, str] = {}
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    except OSError:
        pass
    return out


def _parents() -> list[tuple[str, tuple[str, ...]]]:
    """Candidate (parent dir, {(file, kind)}) where a call's cgroups may go: v1's pids and
    memory hierarchies, or the v2 hierarchy where pids and memory are delegated."""
    own = _own_cgroups()
    v1 = [(f"/sys/fs/cgroup/{c}{own[c]}", c) for c in ("pids", "memory") if c in own]
    if len(v1) == 2 and all(os.path.isdir(d) for d, _ in v1):
        return [(d, (c,)) for d, c in v1]
    for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
        parent = root + own.get("", "/")
        try:
            enabled = Path(parent, "cgroup.subtree_control").read_text().split()
        except OSError:
            continue
        if {"pids", "memory"} <= set(enabled):
            return [(parent, ("pids", "memory"))]
    return []


_LIMIT_FILES = {"pids": ("pids.max",), "memory": ("memory.limit_in_bytes", "memory.max")}


def open_scope(name: str, processes: int, memory_bytes: int) -> CallScope | None:
    """A fresh cgroup scope limiting a call to `processes` tasks and `memory_bytes` (no swap),
    or None when none can be created here."""
    dirs: list[str] = []
    try:
        for parent, controllers in _parents():
            d = os.path.join(parent, CGROUP_PREFIX + name)
            os.mkdir(d)
            dirs.append(d)
            for c in controllers:
                value = processes if c == "pids" else memory_bytes
                written = [f for f in _LIMIT_FILES[c] if _write(d, f, value)]
                if not written:
                    raise OSError(f"cannot set {c} limits in {d}")
            _write(d, "memory.memsw.limit_in_bytes", memory_bytes)
            _write(d, "memory.swap.max", 0)
    except OSError:
        CallScope(tuple(dirs)).close()
        return None
    return CallScope(tuple(dirs)) if dirs else None


def _write(d: str, name: str, value: int) -> bool:
    try:
        Path(d, name).write_text(str(value))
        return True
    except OSError:
        return False


@functools.lru_cache(maxsize=1)
def whole_call_limits() -> str:
    """'cgroup v1' / 'cgroup v2' when a call's processes can be limited together here (probed
    once per process by creating a scope), else 'rlimits'. Also removes scopes that earlier
    runs' dead processes left behind."""
    sweep_scopes()
    scope = open_scope(f"probe-{os.getpid()}", 8, 64 * 2**20)
    if scope is None:
        return "rlimits"
    kind = "cgroup v1" if len(scope.dirs) == 2 else "cgroup v2"
    scope.close()
    return kind


def sweep_scopes() -> None:
    """Removes call scopes whose creating process (the pid in the name) is gone."""
    for parent, _ in _parents():
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            owner = name[len(CGROUP_PREFIX):].split("-")[-2:-1]
            if name.startswith(CGROUP_PREFIX) and owner and owner[0].isdigit() \
                    and not Path(f"/proc/{owner[0]}").exists():
                CallScope((os.path.join(parent, name),)).close()


def scope_wrapper(scope: CallScope | None, argv: list[str]) -> list[str]:
    """`argv` started by a shell that first moves itself into the scope's cgroups (so bwrap
    and everything it starts is counted from its first instruction)."""
    if scope is None:
        return argv
    script = ('while [ "$1" != -- ]; do echo $$ > "$1" || exit 87; shift; done; shift; '
              'exec "$@"')
    return ["/bin/sh", "-c", script, "sh", *scope.procs_files(), "--", *argv]
