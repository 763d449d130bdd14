"""Finished samples from the rollout ranks to the training ranks under separate placement
(`megagrpo.rollout.placement`): a rollout rank's part of a batch as packed tensors plus a small
header over torch.distributed (`TensorChannel`), in place of JSON through torchrun's store
(`StoreChannel`, kept as the reference the tests and `benchmarks/sample_channel.py` compare
with).

A part (`Part`) is what rollout rank j drew of batch i: its completions (token ids, vLLM
log-probs, multi-turn loss masks, per-token versions, turn rewards, MoE routes, text, and
why a sample is dropped from the loss: a failed environment or reward), the
summed rewards, and a few scalars (the loader position it drew at, the draw's seconds, reward
metrics). A part holds its completions as columns (`megagrpo.engine.columns.SampleColumns`:
flat tensors per token field, a row of scalars per completion), made when the part is built,
so no queued part holds per-token Python objects. `pack` lays it out as one uint8 buffer: a
JSON header (those scalars, the string fields' vocabularies, and each tensor field's name,
dtype and shape), then each column's bytes, 8-byte aligned, copied once into one allocation;
`unpack` is its inverse and returns exactly what was packed, its columns views of the
received buffer (log-probs travel as float32 when every value is a float32, as vLLM's are,
else float64; rewards as float64).

The tensor channel: one gloo group of the whole world (`Placement.samples`). Every training
rank publishes its DP replica in the store once; rollout rank j sends each training rank only
its replica's prompts of each part (every TP/PP rank of a replica gets the same slice), as two
messages: the buffer's length, then the buffer. A rollout rank marks a part finished in the
store at once (the trainer's queue depth counts the marks) and sends it from a thread of its
own once the trainer asks for that batch (`take/{i}`), so it keeps sampling ahead while
batches wait; parts the trainer never asks for (drawn ahead of the run's end) are dropped when
the trainer says stop. The sender thread only polls the store (`check`): a TCP store client
serialises its calls, so a blocking `wait` there would hold up the main thread's.
"""
from __future__ import annotations

import dataclasses
import heapq
import json
import math
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from megagrpo.engine import Completion
from megagrpo.engine.columns import FLOAT_COLUMNS, INT_COLUMNS, VOCAB_COLUMNS, SampleColumns

ALIGN = 8
TAG = 0
"""One tag: messages between a pair of ranks arrive in the order they were sent; a part's
header names its batch and the receiver checks it."""


@dataclass
class Part:
    """Rollout rank `rollout`'s part of batch `batch` (or a training rank's slice of it)."""

    batch: int
    rollout: int
    loader: dict
    """The rollout rank's loader position before drawing the batch (the trainer checks it)."""
    epoch: int
    draw_s: float
    metrics: dict
    """The reward terms' and sampling scalars of the whole part."""
    completions: SampleColumns = field(
        default_factory=lambda: SampleColumns.from_completions([]))
    """The completions as columns (a list of `Completion`s given here is made columns at
    once, so a queued part holds no per-token Python objects)."""
    rewards: list[float] = field(default_factory=list)
    """Per completion: the summed reward."""
    policy_versions: bool = False
    """The completions' versions are policy versions already (a part restored from a
    checkpoint, `megagrpo.rollout.placement`), not sync indices of this launch."""
    by: int | None = None
    """A make-up part (rollout.engine_failure=continue): the rollout rank that drew rollout
    rank `rollout`'s share of the batch after that rank's engine failed; None: its own."""

    def __post_init__(self) -> None:
        self.completions = SampleColumns.of(self.completions)
        if len(self.rewards) != len(self.completions):
            raise ValueError(f"batch {self.batch} of rollout rank {self.rollout}: "
                             f"{len(self.completions)} completions, {len(self.rewards)} rewards")

    def slice(self, lo: int, hi: int) -> Part:
        """The completions of prompts lo <= prompt_index < hi (and their rewards)."""
        p = self.completions.column("prompt_index")
        keep = torch.nonzero((p >= lo) & (p < hi)).reshape(-1).tolist()
        return dataclasses.replace(self, completions=self.completions.take(keep),
                                   rewards=[self.rewards[k] for k in keep])


# ---------------------------------------------------------------------- packing
def pack(part: Part) -> torch.Tensor:
    """`part` as one uint8 buffer: [8-byte header length][JSON header][fields] (module
    docstring), written into one allocation."""
    cols = part.completions
    fields = dict(cols.tensors(), rewards=torch.tensor(part.rewards, dtype=torch.float64))
    header = {"batch": part.batch, "rollout": part.rollout, "loader": part.loader,
              "epoch": part.epoch, "draw_s": part.draw_s, "metrics": part.metrics,
              "vocab": cols.vocab, "policy_versions": part.policy_versions, "by": part.by,
              "fields": [[k, str(t.dtype).removeprefix("torch."), list(t.shape)]
                         for k, t in fields.items()]}
    head = json.dumps(header).encode()
    sizes = [t.numel() * t.element_size() for t in fields.values()]
    total = 8 + _padded(len(head)) + sum(map(_padded, sizes))
    out = torch.zeros(total, dtype=torch.uint8)
    out[:8] = torch.frombuffer(bytearray(len(head).to_bytes(8, "little")), dtype=torch.uint8)
    out[8:8 + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    off = 8 + _padded(len(head))
    for t, size in zip(fields.values(), sizes):
        out[off:off + size] = t.contiguous().reshape(-1).view(torch.uint8)
        off += _padded(size)
    return out


def unpack(buf: torch.Tensor) -> Part:
    """The `Part` `pack` laid out in `buf` (uint8): its columns are views of `buf` (no copy;
    they keep it alive)."""
    n = int.from_bytes(buf[:8].numpy().tobytes(), "little")
    header = json.loads(buf[8:8 + n].numpy().tobytes().decode())
    off, f = 8 + _padded(n), {}
    for name, dtype, shape in header["fields"]:
        dt = getattr(torch, dtype)
        shape = shape if isinstance(shape, list) else [shape]  # a count: the layout before
        size = math.prod(shape) * torch.empty(0, dtype=dt).element_size()
        f[name] = buf[off:off + size].view(dt).view(shape)
        off += _padded(size)
    if "vocab" not in header:  # packed before the columns (a checkpoint's queued parts)
        _columns_from_rows(header, f)
    rewards = f.pop("rewards").tolist()
    cols = SampleColumns(**f, vocab={k: tuple(v) for k, v in header["vocab"].items()})
    return Part(batch=header["batch"], rollout=header["rollout"], loader=header["loader"],
                epoch=header["epoch"], draw_s=header["draw_s"], metrics=header["metrics"],
                completions=cols, rewards=rewards,
                policy_versions=header.get("policy_versions", False), by=header.get("by"))


def _columns_from_rows(header: dict, f: dict) -> None:
    """A part packed before the columnar change, in place: its ints and floats were flat
    (the floats with the reward as a third column) and its vocabularies separate keys."""
    f["ints"] = f["ints"].view(-1, len(INT_COLUMNS))
    floats = f["floats"].view(-1, len(FLOAT_COLUMNS) + 1)
    f["floats"], f["rewards"] = floats[:, :-1].contiguous(), floats[:, -1].contiguous()
    header["vocab"] = {k: header[k] for k in VOCAB_COLUMNS}


def _padded(n: int) -> int:
    return n + (-n % ALIGN)


def merged(parts: list[Part], lo: int, hi: int, versions: dict[int, int]
            ) -> tuple[SampleColumns, list[float]]:
    """The completions of prompts [lo, hi) of every part, ordered by (prompt, sample), their
    prompts counted from lo and their sync indices (per token too, in flight) made policy
    versions (a part restored from a checkpoint carries those already), as columns copied
    once; and their rewards."""
    fresh = [not p.policy_versions for p in parts]
    cols = [p.completions.with_versions(versions) if f and not all(fresh) else p.completions
            for p, f in zip(parts, fresh)]
    picks = []
    for s, c in enumerate(cols):
        prompt, sample = c.column("prompt_index").tolist(), c.column("sample_index").tolist()
        picks += [(prompt[r], sample[r], s, r) for r in range(len(c)) if lo <= prompt[r] < hi]
    picks.sort()
    out = SampleColumns.gather(cols, [(s, r) for _, _, s, r in picks])
    out.shift_and_map_(-lo, versions if all(fresh) else None)  # on this copy: no other
    return out, [parts[s].rewards[r] for _, _, s, r in picks]



# ---------------------------------------------------------------------- the channels
def replica_range(dp_rank: int, dp: int, batch_size: int) -> tuple[int, int]:
    """The prompts of the global batch DP replica `dp_rank` trains: [lo, hi)."""
    n = batch_size // dp
    return dp_rank * n, (dp_rank + 1) * n


def ready_key(i: int, j: int, by: int | None = None) -> str:
    """The store key that marks rollout rank j's part of batch i finished (`by`: a make-up
    part another rollout rank drew for j)."""
    return f"batch/{i}/{j}" if by is None else f"batch/{i}/{j}/by/{by}"


class TensorChannel:
    """Packed parts over the `samples` gloo group (module docstring). Built on either side:
    rollout ranks `put` and `close`, training ranks `take`."""

    def __init__(self, *, group, store, rank: int, train_world: int, rollout_ranks: int,
                 batch_size: int, timeout_s: float, replica: tuple[int, int] | None = None,
                 failover: bool = False) -> None:
        self.group, self.store, self.rank = group, store, rank
        self.T, self.R, self.B, self.timeout_s = train_world, rollout_ranks, batch_size, timeout_s
        self.bytes_sent = self.bytes_received = 0
        self._heap: list = []
        """Rollout side: parts put and not sent, as (batch, make-up, slot, seq, part): sent
        lowest first, once the trainer asks for their batch."""
        self._lock = threading.Lock()
        self._seq = 0
        self.failover = failover
        """rollout.engine_failure=continue: a training rank takes a failed rollout rank's share
        from the rollout rank the trainer asked to make it up (`take`)."""
        self.outs: dict[int, dict] = {}
        """Training side: the rollout ranks seen out ({"batch": the first batch they did not
        draw, "pid", "how"}), by rollout index."""
        self._stop = threading.Event()
        self._failed: list[BaseException] = []
        self._thread: threading.Thread | None = None
        self._unsent: dict[int, Part] = {}
        """Rollout side: the parts put and not yet sent, by batch (a checkpoint saves them)."""
        if replica is not None:  # a training rank: (dp_rank, dp)
            self.store.set(f"replica/{rank}", json.dumps(list(replica)))
            self.replica = replica

    # ---------------------------------------------------------------- rollout side
    def put(self, part: Part) -> None:
        """Rollout rank: `part` is finished (marked now, sent when the trainer asks)."""
        self._raise_failed()
        if self._thread is None:
            self._thread = threading.Thread(target=self._send_loop, daemon=True,
                                            name="megagrpo-sample-channel")
            self._thread.start()
        if part.by is None:
            self._unsent[part.batch] = part
        with self._lock:
            heapq.heappush(self._heap, (part.batch, part.by is not None, part.rollout,
                                        self._seq, part))
            self._seq += 1
        self.store.set(ready_key(part.batch, part.rollout, part.by), "1")

    def close(self) -> None:
        """Rollout rank, after the trainer's stop: the parts it never asked for are dropped."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._raise_failed()

    def unsent(self, first: int, end: int) -> list[Part]:
        """Rollout rank: the finished parts of batches first..end-1, none of them asked for
        yet (the trainer has taken every batch before `first`)."""
        missing = [b for b in range(first, end) if b not in self._unsent]
        if missing:
            raise RuntimeError(f"sample channel: batches {missing} were drawn but are neither "
                               "queued nor taken")
        return [self._unsent[b] for b in range(first, end)]

    def _raise_failed(self) -> None:
        if self._failed:
            raise RuntimeError("the sample channel's sender failed") from self._failed[0]

    def _send_loop(self) -> None:
        try:
            keys = [f"replica/{t}" for t in range(self.T)]
            deadline = time.monotonic() + self.timeout_s
            while not self.store.check(keys):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the training ranks did not publish their replicas in "
                                       f"{self.timeout_s:.0f} s (parallel.collective_timeout_s)")
                time.sleep(0.005)
            ranges = [replica_range(*json.loads(self.store.get(k)), self.B) for k in keys]
            while (part := self._next_asked()) is not None:
                packed = {r: pack(part.slice(*r)) for r in set(ranges)}
                for t, r in enumerate(ranges):
                    self._send(packed[r], t)
                if part.by is None:
                    self._unsent.pop(part.batch, None)
                del packed, part  # not held while the next part is drawn
        except BaseException as e:  # re-raised by the next put / close on the main thread
            self._failed.append(e)

    def _next_asked(self) -> Part | None:
        """Waits until the trainer asks for the batch of the lowest part queued (a make-up part
        of an earlier batch, put later, goes before the parts drawn ahead) and takes it off the
        queue; None once the trainer says stop."""
        while True:
            with self._lock:
                head = self._heap[0] if self._heap else None
            if head is not None and self.store.check([f"take/{head[0]}"]):
                with self._lock:
                    return heapq.heappop(self._heap)[-1]
            if self._stop.is_set():
                return None
            time.sleep(0.005)

    def _send(self, buf: torch.Tensor, dst: int) -> None:
        self.group.send([torch.tensor([buf.numel()], dtype=torch.int64)], dst, TAG).wait()
        self.group.send([buf], dst, TAG).wait()
        self.bytes_sent += buf.numel() + 8

    # ---------------------------------------------------------------- training side
    def finished(self, i: int) -> bool:
        """Every rollout rank has finished its part of batch i."""
        return all(self.store.check([ready_key(i, j)]) for j in range(self.R))

    def take(self, i: int) -> list[Part]:
        """Training rank: this replica's slice of every rollout rank's part of batch i."""
        if self.rank == 0:
            self.store.set(f"take/{i}", "1")
        if self.failover:
            return self._take_failover(i)
        parts = []
        for j in range(self.R):
            n = torch.empty(1, dtype=torch.int64)
            self.group.recv([n], self.T + j, TAG).wait()
            buf = torch.empty(int(n.item()), dtype=torch.uint8)
            self.group.recv([buf], self.T + j, TAG).wait()
            self.bytes_received += buf.numel() + 8
            part = unpack(buf)
            if (part.batch, part.rollout) != (i, j):
                raise RuntimeError(f"sample channel: expected batch {i} of rollout rank {j}, "
                                   f"got batch {part.batch} of rollout rank {part.rollout}")
            parts.append(part)
        return parts

    def _take_failover(self, i: int) -> list[Part]:
        """`take` where a rollout rank may be out (rollout.engine_failure=continue): each
        share from the rank that finished it (its own, or the one asked to make it up), own
        shares first, then make-ups, each in rollout order (the order every sender keeps)."""
        src = [self._provider(i, j) for j in range(self.R)]
        order = [j for j in range(self.R) if src[j] == j] + [j for j in range(self.R)
                                                             if src[j] != j]
        parts: dict[int, Part] = {}
        for j in order:
            n = torch.empty(1, dtype=torch.int64)
            self.group.recv([n], self.T + src[j], TAG).wait()
            buf = torch.empty(int(n.item()), dtype=torch.uint8)
            self.group.recv([buf], self.T + src[j], TAG).wait()
            self.bytes_received += buf.numel() + 8
            part = unpack(buf)
            if (part.batch, part.rollout) != (i, j):
                raise RuntimeError(f"sample channel: expected batch {i} of rollout rank {j} "
                                   f"from rollout rank {src[j]}, got batch {part.batch} of "
                                   f"rollout rank {part.rollout}")
            parts[j] = part
        return [parts[j] for j in range(self.R)]

    def out(self, j: int) -> dict | None:
        """Whether rollout rank j has reported itself out (its engine failed), and where."""
        if j not in self.outs and self.store.check([f"out/{j}"]):
            self.outs[j] = json.loads(self.store.get(f"out/{j}"))
        return self.outs.get(j)

    def _provider(self, i: int, j: int) -> int:
        """The rollout rank whose part holds rollout rank j's share of batch i, once finished:
        j itself, or where j is out from batch i or before, the rank training rank 0 asked
        to make it up (`_make_up`)."""
        deadline = time.monotonic() + self.timeout_s
        while not self.store.check([ready_key(i, j)]):
            gone = self.out(j)
            if gone is not None and gone["batch"] <= i:
                return self._make_up(i, j, deadline)
            if time.monotonic() > deadline:
                raise TimeoutError(f"rollout rank {self.T + j} did not finish batch {i} in "
                                   f"{self.timeout_s:.0f} s (parallel.collective_timeout_s)")
            time.sleep(0.005)
        return j

    def _make_up(self, i: int, j: int, deadline: float) -> int:
        """Rollout rank j's share of batch i by another rollout rank: training rank 0 picks
        the next rank in rollout order that is not out and asks it in the store
        (`makeup/{m}`); every training rank waits for that part."""
        key = f"makeup/of/{i}/{j}"
        if self.rank == 0:
            live = [r for r in range(self.R) if self.out(r) is None]
            if not live:
                raise RuntimeError("rollout.engine_failure=continue: every rollout rank's engine "
                                   f"has failed ({self.outs}); nothing left to draw batch {i}")
            by = min(live, key=lambda r: (r - j) % self.R)
            m = self.store.add("makeups", 1) - 1
            self.store.set(f"makeup/{m}", json.dumps({"batch": i, "slot": j, "by": by}))
            self.store.set(key, str(by))
        else:
            self.store.wait([key], timedelta(seconds=self.timeout_s))
            by = int(self.store.get(key))
        while not self.store.check([ready_key(i, j, by)]):
            if self.out(by) is not None:
                raise RuntimeError(f"rollout rank {self.T + by}, asked to draw rollout rank "
                                   f"{self.T + j}'s share of batch {i}, failed too: stopping")
            if time.monotonic() > deadline:
                raise TimeoutError(f"rollout rank {self.T + by} did not draw rollout rank "
                                   f"{self.T + j}'s share of batch {i} in {self.timeout_s:.0f} s")
            time.sleep(0.005)
        return by

    def forget(self, i: int) -> None:
        """Training rank 0: batch i's store keys are no longer needed."""
        for j in range(self.R):
            self.store.delete_key(ready_key(i, j))
        self.store.delete_key(f"take/{i}")


class StoreChannel:
    """The JSON path separate placement used before the tensor channel: each part as JSON
    under `batch/{i}/{j}` in torchrun's store, the whole part read by every training rank
    (routes are not carried). The reference for tests and `benchmarks/sample_channel.py`."""

    def __init__(self, *, store, rollout_ranks: int, timeout_s: float) -> None:
        self.store, self.R, self.timeout_s = store, rollout_ranks, timeout_s
        self.bytes_sent = self.bytes_received = 0

    @staticmethod
    def encode(part: Part) -> str:
        """`part` as this path's JSON (routes left out)."""
        scalars = {f.name: getattr(part, f.name) for f in dataclasses.fields(Part)
                   if f.name != "completions"}
        return json.dumps(dict(scalars, completions=[dataclasses.asdict(dataclasses.replace(
            c, routes=None)) for c in part.completions]))

    def put(self, part: Part) -> None:
        data = self.encode(part)
        self.store.set(ready_key(part.batch, part.rollout), data)
        self.bytes_sent += len(data.encode())

    def close(self) -> None:
        pass

    def finished(self, i: int) -> bool:
        return all(self.store.check([ready_key(i, j)]) for j in range(self.R))

    def take(self, i: int) -> list[Part]:
        keys = [ready_key(i, j) for j in range(self.R)]
        self.store.wait(keys, timedelta(seconds=self.timeout_s))
        parts = []
        for k in keys:
            raw = self.store.get(k)
            self.bytes_received += len(raw)
            d = json.loads(raw)
            d["completions"] = [Completion(**c) for c in d["completions"]]
            parts.append(Part(**d))
        return parts

    def forget(self, i: int) -> None:
        for j in range(self.R):
            self.store.delete_key(ready_key(i, j))


__all__ = ["Part", "StoreChannel", "TensorChannel", "merged", "pack", "replica_range", "unpack"]
