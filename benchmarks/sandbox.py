"""Start-up cost of one sandboxed tool call (megagrpo.agent.sandbox), per isolation.

    PYTHONPATH=. python benchmarks/sandbox.py --calls 50

Times `run_code("print(1)")` --calls times each (after one warm-up) and prints one JSON line
per row: the bare interpreter (`python -I -c 'print(1)'`, no sandbox: the floor), 'weak' (a
child process and the audit hook), 'kernel' (bubblewrap namespaces + seccomp, with the cgroup
scope when one can be made here) and, where a scope is made, 'kernel' without it (what the
cgroup join costs). Rows alternate call by call so that a shared machine's load falls on all
of them alike. Median and 90th percentile in milliseconds, and the CPU model.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megagrpo.agent import isolation, sandbox  # noqa: E402

LIMITS = sandbox.Limits(wall_s=30, cpu_s=10, memory_mb=512, output_bytes=4096)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


def rows() -> dict[str, object]:
    """name -> a zero-argument call to time."""
    out: dict[str, object] = {
        "bare interpreter": lambda: subprocess.run([sys.executable, "-I", "-c", "print(1)"],
                                                   capture_output=True, check=True),
        "weak": lambda: _checked(replace(LIMITS, isolation="weak"))}
    if isolation.kernel_isolation():
        print(f"# kernel isolation unavailable: {isolation.kernel_isolation()}", file=sys.stderr)
        return out
    scoped = isolation.whole_call_limits()
    out[f"kernel ({scoped})"] = lambda: _checked(LIMITS)
    if scoped != "rlimits":
        out["kernel (rlimits)"] = lambda: _without_scope(LIMITS)
    return out


def _checked(limits: sandbox.Limits) -> None:
    result = sandbox.run_code("print(1)", limits)
    assert result.ok and result.stdout == "1\n", result


def _without_scope(limits: sandbox.Limits) -> None:
    real = isolation.whole_call_limits
    isolation.whole_call_limits = lambda: "rlimits"
    try:
        _checked(limits)
    finally:
        isolation.whole_call_limits = real


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args(argv)
    calls = rows()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for i in range(args.calls + 1):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            if i:  # the first round warms the page cache and the probes
                times[name].append(time.perf_counter() - start)
    cpu = cpu_model()
    for name, ts in times.items():
        ts.sort()
        print(json.dumps({"row": name, "calls": len(ts),
                          "median_ms": round(statistics.median(ts) * 1e3, 1),
                          "p90_ms": round(ts[int(0.9 * (len(ts) - 1))] * 1e3, 1), "cpu": cpu}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
