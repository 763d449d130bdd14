"""This machine's arithmetic, measured: torch.mm rates per dtype (the FLOP floor of the
benchmarks' MFU figures) and which training dtype is faster here. Machines of one kind differ:
an AVX-512 CPU with avx512_bf16 runs bf16 matmuls ~4x faster than fp32, an AVX2-only one ~70x
slower, so the choice is measured, never assumed. And how busy the CPUs are as a run starts: on
a 2-core machine a neighbour's load slows every step, which the start-up console says."""
from __future__ import annotations

import os
import time

import torch


def gemm_gflops(dtype: str, threads: int, size: int = 2048, iters: int = 5,
                budget_s: float = 1.0) -> tuple[float, int]:
    """The measured GEMM rate: best of `iters` torch.mm n^3 at `threads` intra-op threads and
    `dtype`, in GFLOP/s, and the n used. n is `size` unless one product at a smaller n already
    takes over `budget_s` (a CPU without native bf16 runs it at ~1 GFLOP/s; 2048^3 would take
    minutes there)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = 256
        while True:
            best = _best_mm_seconds(n, getattr(torch, dtype), iters, budget_s)
            if n >= size or best > budget_s:
                return 2.0 * n ** 3 / best / 1e9, n
            n = min(size, 2 * n)
    finally:
        torch.set_num_threads(before)


def _best_mm_seconds(n: int, dtype: torch.dtype, iters: int, budget_s: float) -> float:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    torch.mm(a, b)  # warm-up: oneDNN primitive creation, page faults
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
        if best > budget_s:
            break
    return best


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                info[key.strip()] = value.strip()
    except OSError:
        pass
    return info


def cpu_name() -> str:
    """The CPU a figure was measured on, as results files record it: /proc/cpuinfo's model
    name with its family and model numbers (VMs often show a bare "AMD EPYC", and machines of
    one name differ 2x) and torch's CPU capability, e.g. "AMD EPYC (family 25 model 17),
    AVX512"."""
    info = _cpuinfo()
    name = info.get("model name", "unknown CPU")
    if "cpu family" in info:
        name += f" (family {info['cpu family']} model {info.get('model', '?')})"
    return f"{name}, {torch.backends.cpu.get_cpu_capability()}"


def cpu_features() -> str:
    """torch's CPU capability and the bf16-relevant flags of /proc/cpuinfo."""
    flags = set(_cpuinfo().get("flags", "").split())
    have = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"torch capability {torch.backends.cpu.get_cpu_capability()}" + (
        f"; {', '.join(have)}" if have else "")


SMALL_MODEL_PARAMS = 10_000_000
"""Below this many parameters bf16 did not pay end to end even where its matmuls are 5.7x
faster (Xeon with AMX, GRPO steps against fp32: 0.85M params 0.73x, hidden-256 x 6 layers
0.74x, 12.6M 1.15x, SmolLM2-135M 1.66x; docs/performance.md): per-op overhead and casts
dominate small matrices."""


def dtype_advice(threads: int | None = None, params: int | None = None) -> str:
    """One line: fp32 vs bf16 torch.mm on this CPU (measured now, ~1 s) and which
    model.dtype trains faster here, for a model of `params` parameters when given."""
    threads = threads or torch.get_num_threads()
    fp32, n32 = gemm_gflops("float32", threads, size=1024, iters=3, budget_s=0.2)
    bf16, n16 = gemm_gflops("bfloat16", threads, size=1024, iters=3, budget_s=0.2)
    ratio = bf16 / max(fp32, 1e-9)
    small = params is not None and params < SMALL_MODEL_PARAMS
    if ratio > 1.2 and not small:
        pick = ("bfloat16 (set model.dtype=bfloat16 rollout.dtype=bfloat16 "
                "algo.rollout_is=truncate); faster per step, but bf16 weights drop updates "
                "below their rounding step: at lr 5e-6 the SmolLM2 recipe learned far less in "
                "30 steps than in fp32 (docs/performance.md, bf16 accuracy)")
    elif ratio > 1.2:
        pick = (f"float32 (bf16 matmuls are faster, but at {params / 1e6:.1f}M parameters, "
                f"under {SMALL_MODEL_PARAMS // 10**6}M, per-op overhead and casts outweigh "
                "them: measured slower end to end)")
    else:
        pick = "float32"
    return (f"this CPU ({cpu_features()}), torch.mm at {threads} threads: fp32 {fp32:.0f} "
            f"GFLOP/s (n={n32}), bf16 {bf16:.1f} GFLOP/s (n={n16}), bf16/fp32 = {ratio:.2f}x: "
            f"the faster training dtype here is {pick}")


def _cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs so far, from /proc/stat's first line."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait


def _own_cpu_seconds() -> float:
    """CPU time of this process (all its threads) and of its children it has waited for."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def cpu_sample() -> tuple[float, float, int, int] | None:
    """A starting point for `busy_cores_since`: (wall, own CPU seconds, busy, total jiffies);
    None where /proc/stat is missing."""
    try:
        return (time.monotonic(), _own_cpu_seconds(), *_cpu_jiffies())
    except (OSError, ValueError):
        return None


def busy_cores_since(start: tuple[float, float, int, int] | None,
                     min_seconds: float = 0.25) -> float:
    """Cores' worth of CPU that other processes used since `start` (at least `min_seconds` of
    it: sleeps for the remainder): every CPU's busy time minus this process's own, so the work
    done meanwhile (the preflight) is not counted. 0.0 without /proc/stat."""
    if start is None:
        return 0.0
    wall0, mine0, b0, t0 = start
    time.sleep(max(0.0, min_seconds - (time.monotonic() - wall0)))
    b1, t1 = _cpu_jiffies()
    wall, mine = time.monotonic() - wall0, _own_cpu_seconds() - mine0
    cores = os.cpu_count() or 1
    return max(0.0, (b1 - b0) / max(t1 - t0, 1) * cores - mine / wall)


BUSY_NOTE_CORES = 0.5
"""Other processes' load (cores' worth) above which the start-up console says the CPUs are
busy: beside a busy process a training pass ran 1.5-1.8x slower, beside a second training job
4x (docs/performance.md, "Without the profiler")."""


def busy_note(busy: float, cores: int | None = None) -> str | None:
    """The start-up line for `busy` cores' worth of other load; None below BUSY_NOTE_CORES."""
    if busy < BUSY_NOTE_CORES:
        return None
    cores = cores or os.cpu_count() or 1
    return (f"note: other processes use {busy:.1f} of this machine's {cores} cores as the run "
            "starts; torch's threads wait behind them (a training pass ran 1.5-4x slower beside "
            "another job, docs/performance.md#without-the-profiler), so step times and the ETA "
            "reflect the load, not this run")


def memory_read_gbs(threads: int, nbytes: int = 1 << 30, iters: int = 3) -> tuple[float, str]:
    """This machine's memory read bandwidth, measured: the best of `iters` streaming reads
    (`torch.sum` at `threads` intra-op threads) of an fp32 buffer of `nbytes`, in GB/s (1e9
    bytes), and the method as one phrase. The default 1 GiB is far above any LLC of this kind
    (32 MiB here), so every read comes from DRAM; a sum reads each byte once and writes
    nothing, which is what a decode step does to its weights and KV cache. The floor of a
    memory-bound phase is its bytes over this rate (benchmarks/_rollout_floor.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)  # touched: pages mapped
        buf.sum()  # warm-up: the reduction's thread pool
        best = float("inf")
        for _ in range(iters):
            t0 = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - t0)
        rate = buf.numel() * 4 / best / 1e9
    finally:
        torch.set_num_threads(before)
    return rate, (f"torch.sum over {buf.numel() * 4 / 2**30:.2f} GiB fp32, best of {iters}, "
                  f"{threads} threads")
