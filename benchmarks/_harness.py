"""Small shared harness for megagrpo benchmarks: wall time, peak extra memory, copy bandwidth.

Memory is "peak extra": the highest amount of memory allocated by the measured call beyond
what was allocated when it started (so inputs created before the call do not count, and
everything the call allocates and keeps - outputs, gradients - does).

- CUDA: ``torch.cuda.max_memory_allocated() - memory_allocated()`` around the call (caching
  allocator statistics; allocator-exact).
- CPU: ``torch.profiler`` with ``profile_memory=True`` records every allocation and free that
  goes through torch's CPU allocator as a ``[memory]`` event (+bytes / -bytes). Sorting them by
  time and taking the running sum's maximum gives the peak. This counts tensor bytes only, is
  independent of glibc's allocator caching (unlike RSS), and misses memory that libraries
  allocate behind torch's back (oneDNN scratch pads, Python objects). The profiler also keeps
  a record of every op, which grows with the op count (at T=32768, V=151,936 the fused output
  layer's chunked loop grew it past 16 GB): calls with too many ops to profile pass
  ``method="rss"``.
- CPU, ``method="rss"``: the process's resident-set high-water mark (``VmHWM``, reset through
  ``/proc/self/clear_refs``) minus the resident set before the call. Counts every byte touched
  (torch's, oneDNN's, Python's; glibc's free memory is trimmed first, so memory freed by
  earlier calls is not silently reused), O(1) to take.
"""
from __future__ import annotations

import json
import statistics
import time
from typing import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], device: torch.device, *, setup: Callable[[], object]
            | None = None, warmup: int = 1, iters: int = 3) -> float:
    """Median seconds of ``fn()``; ``setup()`` runs untimed before each call."""
    return statistics.median(time_samples(fn, device, setup=setup, warmup=warmup, iters=iters))


def time_samples(fn: Callable[[], object], device: torch.device, *,
                 setup: Callable[[], object] | None = None, warmup: int = 1,
                 iters: int = 3) -> list[float]:
    """Seconds of each timed ``fn()`` call (on a shared machine, the min is the least noisy)."""
    times = []
    for i in range(warmup + iters):
        if setup is not None:
            setup()
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def _cpu_peak_bytes(fn: Callable[[], object]) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [(e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]"]
    current = peak = 0
    for _, nbytes in sorted(events):
        current += nbytes
        peak = max(peak, current)
    return peak


def _rss_kib() -> tuple[int, int]:
    with open("/proc/self/status") as f:
        fields = dict(ln.split(":", 1) for ln in f if ln.startswith(("VmRSS", "VmHWM")))
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def _cpu_rss_peak_bytes(fn: Callable[[], object]) -> int:
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc's cached free memory back to the OS: else
    # the call could reuse it without raising the RSS (a peak of 0 after a larger call)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM <- VmRSS
    base = _rss_kib()[0]
    fn()
    return max(0, _rss_kib()[1] - base) * 1024


def peak_extra_bytes(fn: Callable[[], object], device: torch.device,
                     method: str = "allocator") -> int:
    """Peak bytes allocated during ``fn()`` beyond those allocated before it (see module doc);
    ``method`` (CPU only): "allocator" (torch's allocations, exact) or "rss"."""
    if device.type == "cuda":
        sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        sync(device)
        return torch.cuda.max_memory_allocated(device) - base
    if method == "rss":
        return _cpu_rss_peak_bytes(fn)
    if method != "allocator":
        raise ValueError(f"peak_extra_bytes: method must be 'allocator' or 'rss', got {method!r}")
    return _cpu_peak_bytes(fn)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, iters: int = 5) -> float:
    """Measured device-to-device copy bandwidth in bytes/s (read + write counted)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = time_fn(lambda: dst.copy_(src), device, warmup=2, iters=iters)
    return 2 * nbytes / seconds


def emit(record: dict, path: str | None = None) -> None:
    """Print ``record`` as one JSON line; append it to ``path`` when given."""
    line = json.dumps(record, sort_keys=False)
    print(line, flush=True)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


# Llama shapes shared by the model-size benchmarks (weight_sync, reference_sync): head_dim 32 or
# 64 (vLLM's CPU attention), vocab a multiple of 128 x TP so no padded rows exist (they are not
# exported, which would skew byte counts).
MODEL_SIZES = {
    "tiny": dict(hidden_size=128, num_layers=2, num_attention_heads=4, num_query_groups=2,
                 head_dim=32, ffn_hidden_size=256, vocab_size=256),
    "10m": dict(hidden_size=256, num_layers=4, num_attention_heads=4, num_query_groups=2,
                head_dim=64, ffn_hidden_size=1024, vocab_size=8192),
    "50m": dict(hidden_size=512, num_layers=8, num_attention_heads=8, num_query_groups=4,
                head_dim=64, ffn_hidden_size=2048, vocab_size=16384),
    "100m": dict(hidden_size=768, num_layers=12, num_attention_heads=12, num_query_groups=4,
                 head_dim=64, ffn_hidden_size=2048, vocab_size=16384),
}
