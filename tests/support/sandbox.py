"""Kernel-sandbox requirements of the tool tests: `require_kernel_sandbox` skips a test where
bubblewrap cannot create its namespaces, and fails it under CI (env CI set), where the set-up
(scripts/setup_venv.sh) must have provided it: a boundary test never passes by skipping there."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from megagrpo.agent.isolation import python_binds, whole_call_limits
from megagrpo.agent.sandbox import isolation_problem


def require_kernel_sandbox() -> None:
    """Skip (fail under CI) unless agent.sandbox=kernel can run here."""
    problem = isolation_problem("kernel")
    if problem:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(problem)


def require_whole_call_limits() -> None:
    """Skip (fail under CI) unless a call's processes are bounded together: a cgroup scope,
    or RLIMIT_NPROC in the call's user namespace (not exempt: the trainer is not root). A
    fork bomb test without either would load the whole machine until the wall clock."""
    require_kernel_sandbox()
    if whole_call_limits() == "rlimits" and os.geteuid() == 0:
        why = ("no cgroup scope can be created and the trainer runs as root (exempt from "
               "RLIMIT_NPROC): a call's processes are bounded by the wall clock only")
        (pytest.fail if os.environ.get("CI") else pytest.skip)(why)


def bound_under_tmp() -> set[str]:
    """The names in the sandbox's /tmp that its read-only binds create: the interpreter's
    prefix and site-packages are bound at their own paths, so a Python (or a venv, a checkout)
    that lives under the host's /tmp shows its first folder there, read-only. Empty where it
    lives elsewhere (CI's checkout, /work)."""
    return {Path(b).parts[2] for b in python_binds()[1] if Path(b).parts[1:2] == ("tmp",)}


def outside_binds(paths: list[str]) -> list[str]:
    """`paths` (seen from inside a sandbox, /proc/<pid>/root/... included) less those under a
    folder `bound_under_tmp` names."""
    tops = bound_under_tmp()
    def bound(p: str) -> bool:
        rest = p.split("/root", 1)[1] if p.startswith("/proc/") else p
        parts = Path(rest).parts
        return len(parts) > 2 and parts[1] == "tmp" and parts[2] in tops
    return [p for p in paths if not bound(p)]
