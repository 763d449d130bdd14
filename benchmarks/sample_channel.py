"""Separate placement's sample channel: one batch's samples from a rollout rank to a training
rank as packed tensors over gloo (`megagrpo.rollout.sample_channel.TensorChannel`) against JSON
through a TCP store (`StoreChannel`, the path it replaced), in bytes and seconds.

Two spawned processes, a rollout rank and a training rank, and a TCP store held by this
process (as torchrun's agent holds it). The batch: `--prompts` x `--group` completions of
`--tokens` tokens each (ids below 151,936, float32 log-probs as vLLM's, a reward; with
`--multiturn` also a loss mask, per-token versions and three turn rewards each). Each
repeat times one batch end to end on the training rank: from its go (a store key) to the
unpacked `Part`s: the rollout rank's packing and sending, the transfer, the training rank's
receiving and unpacking. The median of `--repeats` after one warm-up; the received parts are
checked against the sent ones. One JSON line per path (bytes on the wire, seconds, MB/s, the
CPU, torch's capability, the load average) to stdout and, with --out, appended to a file;
--table renders a results file as docs/async.md's table.

    python benchmarks/sample_channel.py --out benchmarks/results/sample_channel_cpu.jsonl
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megagrpo.engine import Completion  # noqa: E402
from megagrpo.runtime.machine import cpu_name  # noqa: E402
from megagrpo.rollout.sample_channel import Part, StoreChannel, TensorChannel  # noqa: E402

PATHS = ("json_store", "tensor_gloo")
JSON_ATTEMPT_BYTES = 256 * 2**20
"""Batches whose JSON would exceed this are not built for the JSON path (the store refuses
anything over 8 MiB, measured at 64 x 8 x 1024 tokens): their size is estimated."""


def batch(i: int, prompts: int, group: int, tokens: int, multiturn: bool) -> Part:
    """Batch i as rollout rank 0 of 1 draws it (seeded)."""
    rnd = random.Random(i)
    g = torch.Generator().manual_seed(i)
    comps = []
    for p in range(prompts):
        for s in range(group):
            lp = (-torch.rand(tokens, generator=g) * 4).tolist()  # float32 values
            c = Completion(prompt_index=p, sample_index=s,
                           token_ids=[rnd.randrange(151_936) for _ in range(tokens)],
                           logprobs=lp, finish_reason="length", text="", version=i)
            if multiturn:
                c.loss_mask = [k % 5 != 0 for k in range(tokens)]
                c.token_versions = [i] * tokens
                c.turns, c.turn_rewards = 3, [0.0, 0.5, 1.0]
            comps.append(c)
    return Part(batch=i, rollout=0, loader={"epoch": 0, "index": i}, epoch=0, draw_s=1.0,
                metrics={"reward_mean": 0.5}, completions=comps,
                rewards=[rnd.random() for _ in comps])


def _rank(rank: int, port: int, args: argparse.Namespace, path: str, out: str) -> None:
    torch.set_num_threads(1)
    timeout = timedelta(seconds=600)
    store = dist.TCPStore("127.0.0.1", port, 3, is_master=False, timeout=timeout)
    store = dist.PrefixStore(f"{path}/", store)
    if path == "tensor_gloo":
        group = dist.ProcessGroupGloo(dist.PrefixStore("samples/", store), rank, 2, timeout)
        channel = TensorChannel(group=group, store=store, rank=rank, train_world=1,
                                rollout_ranks=1, batch_size=args.prompts, timeout_s=600,
                                replica=(0, 1) if rank == 0 else None)
    else:
        channel = StoreChannel(store=store, rollout_ranks=1, timeout_s=600)
    n = args.repeats + 1
    parts = [batch(i, args.prompts, args.group, args.tokens, args.multiturn) for i in range(n)]
    if rank == 1:  # the rollout rank: puts batch i once the trainer says go
        for i in range(n):  # polls: a blocking wait would hold the sender thread's store calls
            _poll(store, f"go/{i}")
            channel.put(parts[i])
        _poll(store, "done")
        channel.close()
        return
    seconds = []
    for i in range(n):
        t0 = time.perf_counter()
        store.set(f"go/{i}", "1")
        (got,) = channel.take(i)
        seconds.append(time.perf_counter() - t0)
        if got.completions != parts[i].completions or got.rewards != parts[i].rewards:
            raise SystemExit(f"{path}: batch {i} arrived different from what was sent")
        channel.forget(i)
    store.set("done", "1")
    Path(out).write_text(json.dumps({"seconds": seconds[1:],
                                     "bytes": channel.bytes_received // n}))


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
                           timeout=timedelta(seconds=600))
    row = {"path": path, "prompts": args.prompts, "group": args.group, "tokens": args.tokens,
           "multiturn": args.multiturn, "samples": args.prompts * args.group,
           "repeats": args.repeats, "cpu": cpu_name(),
           "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cores": os.cpu_count(),
           "loadavg_1m": round(os.getloadavg()[0], 2)}
    if path == "json_store":
        one = batch(0, 1, 1, args.tokens, args.multiturn)
        estimate = len(json.dumps(dataclasses.asdict(one)).encode()) * args.prompts * args.group
        if estimate > JSON_ATTEMPT_BYTES:  # not built: gigabytes of JSON for a store of 8 MiB
            return dict(row, bytes=estimate, refused=(
                f"not attempted: ~{estimate / 1e6:.0f} MB of JSON (one sample's x the samples), "
                "over the store's 8 MiB payload limit"))
        data = json.dumps(dataclasses.asdict(batch(0, args.prompts, args.group, args.tokens,
                                                   args.multiturn)))
        refused = store_refuses(master, args)
        if refused:  # the JSON path cannot carry this batch at all
            return dict(row, bytes=len(data.encode()), refused=refused)
    out = work / f"{path}.json"
    mp.spawn(_rank, args=(master.port, args, path, str(out)), nprocs=2)
    got = json.loads(out.read_text())
    s = statistics.median(got["seconds"])
    return dict(row, bytes=got["bytes"], seconds=round(s, 4),
                mb_per_s=round(got["bytes"] / s / 1e6, 1))


def table(path: str) -> str:
    """A results file as a markdown table: per batch shape, each path's bytes and seconds and
    the tensor channel's ratios to the JSON path."""
    rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    out = ["| batch: prompts x samples x tokens | CPU (load) | JSON via store: MB, s | "
           "tensors via gloo: MB, s | bytes, time vs JSON |", "|---|---|---|---|---|"]
    runs: dict[tuple, dict] = {}
    for r in rows:
        runs.setdefault((r["prompts"], r["group"], r["tokens"], r["multiturn"], r["cpu"]),
                        {})[r["path"]] = r
    for (p, g, t, mt, cpu), run in runs.items():
        j, x = run["json_store"], run["tensor_gloo"]
        if "refused" in j:
            json_cell = (f"~{j['bytes'] / 1e6:.0f}, not built (over the store's 8 MiB)"
                         if j["refused"].startswith("not attempted")
                         else f"{j['bytes'] / 1e6:.1f}, refused by the store")
            ratio = (
                f"{x['bytes'] / j['bytes']:.2f}x, -")
        else:
            json_cell, ratio = f"{j['bytes'] / 1e6:.1f}, {j['seconds']:.3f}", (
                f"{x['bytes'] / j['bytes']:.2f}x, {x['seconds'] / j['seconds']:.2f}x")
        out.append(f"| {p} x {g} x {t} tokens{', multi-turn' if mt else ''} | {cpu} "
                   f"({j['loadavg_1m']}) | {json_cell} | {x['bytes'] / 1e6:.1f}, "
                   f"{x['seconds']:.3f} | {ratio} |")
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
    args = ap.parse_args()
    if args.table:
        print(table(args.table))
        return
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    for path in PATHS:
        row = measure(args, path, work)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
