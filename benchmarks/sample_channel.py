"""Separate placement's sample channel: one batch's samples from a rollout rank to a training
rank as packed columns over gloo (`megagrpo.rollout.sample_channel.TensorChannel`) against JSON
through a TCP store (`StoreChannel`, the path it replaced), in bytes, seconds, samples per second
and each side's peak memory.

Two spawned processes, a rollout rank and a training rank, and a TCP store held by this
process (as torchrun's agent holds it). The batch: `--prompts` x `--group` completions of
`--tokens` tokens each (ids below 151,936, float32 log-probs as vLLM's, a reward; with
`--multiturn` also a loss mask, per-token versions and three turn rewards each), built as
columns (`megagrpo.engine.columns.SampleColumns`) by the rollout rank before the training rank's
go. Each repeat times one batch end to end on the training rank: from its go (a store key) to
its replica's merged columns (`sample_channel.merged`, as `SeparateSource` builds them): the rollout
rank's packing and sending, the transfer, the training rank's receiving and merging. The
median of `--repeats` after one warm-up; what arrived is checked against what was sent (a
digest of every column). Each process reports its resident memory after start-up and its peak
(VmRSS, VmHWM). One JSON line per path (bytes on the wire, seconds, samples/s, MB/s, memory,
the CPU, torch's capability, the load average) to stdout and, with --out, appended to a file;
--table renders a results file as docs/performance.md's table.

    python benchmarks/sample_channel.py --out benchmarks/results/sample_channel_cpu.jsonl
    python benchmarks/sample_channel.py --prompts 1250 --tokens 4096 --repeats 1 --out ...
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megagrpo.engine.columns import INT_COLUMNS, SampleColumns  # noqa: E402
from megagrpo.rollout.sample_channel import (  # noqa: E402
    Part,
    StoreChannel,
    TensorChannel,
    merged,
)
from megagrpo.runtime.machine import cpu_name  # noqa: E402

PATHS = ("json_store", "tensor_gloo")
FORMAT = "columns"
"""What both ends hold since the columnar change (rows before it: `Completion` lists)."""
JSON_ATTEMPT_BYTES = 256 * 2**20
"""Batches whose JSON would exceed this are not built for the JSON path (the store refuses
anything over 8 MiB, measured at 64 x 8 x 1024 tokens): their size is estimated."""


def batch(i: int, prompts: int, group: int, tokens: int, multiturn: bool) -> Part:
    """Batch i as rollout rank 0 of 1 draws it (seeded), built as columns."""
    g = torch.Generator().manual_seed(i)
    n, col = prompts * group, {c: k for k, c in enumerate(INT_COLUMNS)}
    ints = torch.zeros(n, len(INT_COLUMNS), dtype=torch.int64)
    ints[:, col["prompt_index"]] = torch.arange(prompts).repeat_interleave(group)
    ints[:, col["sample_index"]] = torch.arange(group).repeat(prompts)
    ints[:, col["version"]], ints[:, col["tokens"]], ints[:, col["correct"]] = i, tokens, -1
    ints[:, col["turns"]], ints[:, col["turn_rewards"]] = (3, 3) if multiturn else (1, -1)
    ints[:, col["token_versions"]] = ints[:, col["loss_mask"]] = int(multiturn)
    N = n * tokens if multiturn else 0
    cols = SampleColumns(
        ints=ints, floats=torch.zeros(n, 2, dtype=torch.float64),
        token_ids=torch.randint(151_936, (n * tokens,), generator=g, dtype=torch.int32),
        logprobs=torch.rand(n * tokens, generator=g) * -4,
        token_versions=torch.full((N,), i, dtype=torch.int64),
        loss_mask=(torch.arange(N) % tokens) % 5 != 0,
        turn_rewards=torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64).repeat(
            n if multiturn else 0),
        route_shapes=torch.empty(0, dtype=torch.int64), routes=torch.empty(0, dtype=torch.int16),
        text=torch.empty(0, dtype=torch.uint8),
        vocab={"finish_reason": ("length",), "truncation": ("",), "dropped": ("",)})
    return Part(batch=i, rollout=0, loader={"epoch": 0, "index": i}, epoch=0, draw_s=1.0,
                metrics={"reward_mean": 0.5}, completions=cols,
                rewards=torch.rand(n, generator=g, dtype=torch.float64).tolist())


def digest(cols: SampleColumns, rewards: list[float]) -> str:
    """A digest of every column and the rewards (what arrived vs what was sent)."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in cols.tensors().items():
        h.update(name.encode() + str(t.dtype).encode() + str(list(t.shape)).encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())  # no copy
    h.update(json.dumps([cols.vocab, rewards]).encode())
    return h.hexdigest()


def memory_mb() -> dict:
    """This process's resident memory now and at its peak, MB (/proc/self/status)."""
    got = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            got[key] = round(int(value.split()[0]) / 1024)
    return got


def _rank(rank: int, port: int, args: argparse.Namespace, path: str, out: str) -> None:
    torch.set_num_threads(1)
    start_mb = memory_mb()["VmRSS"]
    timeout = timedelta(seconds=900)
    store = dist.TCPStore("127.0.0.1", port, 3, is_master=False, timeout=timeout)
    store = dist.PrefixStore(f"{path}/", store)
    if path == "tensor_gloo":
        group = dist.ProcessGroupGloo(dist.PrefixStore("samples/", store), rank, 2, timeout)
        channel = TensorChannel(group=group, store=store, rank=rank, train_world=1,
                                rollout_ranks=1, batch_size=args.prompts, timeout_s=900,
                                replica=(0, 1) if rank == 0 else None)
    else:
        channel = StoreChannel(store=store, rollout_ranks=1, timeout_s=900)
    n = args.repeats + 1
    if rank == 1:  # the rollout rank: builds batch i, then puts it once the trainer says go
        for i in range(n):
            part = batch(i, args.prompts, args.group, args.tokens, args.multiturn)
            store.set(f"sent/{i}", digest(part.completions, part.rewards))
            _poll(store, f"go/{i}")  # polls: a blocking wait would hold the sender's store
            channel.put(part)
            del part
        _poll(store, "done")
        channel.close()
        store.set("rollout_memory", json.dumps(dict(memory_mb(), start=start_mb)))
        return
    seconds = []
    for i in range(n):
        _poll(store, f"sent/{i}")
        t0 = time.perf_counter()
        store.set(f"go/{i}", "1")
        parts = channel.take(i)
        cols, rewards = merged(parts, 0, args.prompts, {i: i})
        seconds.append(time.perf_counter() - t0)
        if digest(cols, rewards) != store.get(f"sent/{i}").decode():
            raise SystemExit(f"{path}: batch {i} arrived different from what was sent")
        channel.forget(i)
        del parts, cols, rewards
    store.set("done", "1")
    _poll(store, "rollout_memory")
    Path(out).write_text(json.dumps({
        "seconds": seconds[1:], "bytes": channel.bytes_received // n,
        "training_memory_mb": dict(memory_mb(), start=start_mb),
        "rollout_memory_mb": json.loads(store.get("rollout_memory"))}))


def _poll(store, key: str) -> None:
    while not store.check([key]):
        time.sleep(0.001)


def store_refuses(master: dist.TCPStore, args: argparse.Namespace) -> str:
    """Why torchrun's kind of store refuses one JSON part of this size ('' if it takes it):
    a client sets it, as a rollout rank would."""
    store = StoreChannel(store=dist.TCPStore("127.0.0.1", master.port, 3, is_master=False,
                                             timeout=timedelta(seconds=60)),
                         rollout_ranks=1, timeout_s=60)
    try:
        store.put(batch(0, args.prompts, args.group, args.tokens, args.multiturn))
    except dist.DistError as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return ""


def measure(args: argparse.Namespace, path: str, work: Path) -> dict:
    master = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=900))
    row = {"path": path, "format": FORMAT, "prompts": args.prompts, "group": args.group,
           "tokens": args.tokens, "multiturn": args.multiturn,
           "samples": args.prompts * args.group, "repeats": args.repeats, "cpu": cpu_name(),
           "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cores": os.cpu_count(),
           "loadavg_1m": round(os.getloadavg()[0], 2)}
    if path == "json_store":
        one = len(StoreChannel.encode(batch(0, 1, 1, args.tokens, args.multiturn)).encode())
        estimate = one * args.prompts * args.group
        if estimate > JSON_ATTEMPT_BYTES:  # not built: gigabytes of JSON for a store of 8 MiB
            return dict(row, bytes=estimate, refused=(
                f"not attempted: ~{estimate / 1e6:.0f} MB of JSON (one sample's x the samples), "
                "over the store's 8 MiB payload limit"))
        part = batch(0, args.prompts, args.group, args.tokens, args.multiturn)
        size = len(StoreChannel.encode(part).encode())
        refused = store_refuses(master, args)
        if refused:  # the JSON path cannot carry this batch at all
            return dict(row, bytes=size, refused=refused)
    out = work / f"{path}.json"
    mp.spawn(_rank, args=(master.port, args, path, str(out)), nprocs=2)
    got = json.loads(out.read_text())
    s = statistics.median(got["seconds"])
    return dict(row, bytes=got["bytes"], seconds=round(s, 4),
                samples_per_s=round(args.prompts * args.group / s, 1),
                mb_per_s=round(got["bytes"] / s / 1e6, 1),
                rollout_memory_mb=got["rollout_memory_mb"],
                training_memory_mb=got["training_memory_mb"])


def _memory(r: dict) -> str:
    """'rollout / training rank peak MB (+ over start-up)' or '-' (rows before memory was
    measured)."""
    if "rollout_memory_mb" not in r:
        return "-"
    a, b = r["rollout_memory_mb"], r["training_memory_mb"]
    return (f"{a['VmHWM']:,} (+{a['VmHWM'] - a['start']:,}) / "
            f"{b['VmHWM']:,} (+{b['VmHWM'] - b['start']:,})")


def _json_cell(j: dict | None) -> str:
    if j is None:
        return "-"
    if "refused" in j:
        return (f"~{j['bytes'] / 1e6:.0f} MB, not built (over the store's 8 MiB)"
                if j["refused"].startswith("not attempted")
                else f"{j['bytes'] / 1e6:.1f} MB, refused by the store")
    memory = _memory(j)
    return (f"{j['bytes'] / 1e6:.1f} MB, {j['seconds']:.3f} s, {_rate(j)}"
            + ("" if memory == "-" else f"; peak RSS MB {memory}"))


def _rate(r: dict) -> str:
    return f"{r['samples'] / r['seconds']:,.0f}/s"


def table(path: str) -> str:
    """A results file as a markdown table: per batch shape and format (what both ends held:
    `Completion` lists before the columnar change, columns after it), each path's bytes,
    seconds and samples/s, the tensor channel's peak memory per side and its ratios to the
    JSON path."""
    rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    out = ["| batch: prompts x samples x tokens | ends hold | CPU (load) | JSON via store | "
           "tensors via gloo | tensors: peak RSS MB, rollout / training rank (+ over start-up) | "
           "bytes, time vs JSON |", "|---|---|---|---|---|---|---|"]
    runs: dict[tuple, dict] = {}
    for r in rows:
        key = (r["prompts"], r["group"], r["tokens"], r["multiturn"], r.get("format", "lists"),
               r["cpu"])
        runs.setdefault(key, {})[r["path"]] = r
    for (p, g, t, mt, fmt, cpu), run in runs.items():
        j, x = run.get("json_store"), run.get("tensor_gloo")
        first = x or j  # the tensor run's load (a JSON row may be an earlier run's estimate)
        tensor_cell = "-" if x is None else (
            f"{x['bytes'] / 1e6:.1f} MB, {x['seconds']:.3f} s, {_rate(x)}")
        if j is None or x is None:
            ratio = "-"
        elif "refused" in j:
            ratio = f"{x['bytes'] / j['bytes']:.2f}x, -"
        else:
            ratio = f"{x['bytes'] / j['bytes']:.2f}x, {x['seconds'] / j['seconds']:.2f}x"
        out.append(f"| {p} x {g} x {t} tokens{', multi-turn' if mt else ''} | {fmt} | {cpu} "
                   f"({first['loadavg_1m']}) | {_json_cell(j)} | {tensor_cell} | "
                   f"{'-' if x is None else _memory(x)} | {ratio} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--multiturn", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="append the JSON lines to this file")
    ap.add_argument("--work", default="/tmp/megagrpo-sample-channel")
    ap.add_argument("--table", default=None, help="print a results file as a markdown table")
    ap.add_argument("--paths", default=",".join(PATHS),
                    help="which paths to measure (json_store: at the largest batch the store "
                         "takes, run it alone at that size)")
    args = ap.parse_args()
    if args.table:
        print(table(args.table))
        return
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    for path in args.paths.split(","):
        row = measure(args, path, work)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
