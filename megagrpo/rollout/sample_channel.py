"""Finished samples from the rollout ranks to the training ranks under separate placement
(`megagrpo.rollout.placement`): a rollout rank's part of a batch as packed tensors plus a small
header over torch.distributed (`TensorChannel`), in place of JSON through torchrun's store
(`StoreChannel`, kept as the reference the tests and `benchmarks/sample_channel.py` compare
with).

A part (`Part`) is what rollout rank j drew of batch i: its completions (token ids, vLLM
log-probs, multi-turn loss masks, per-token versions, turn rewards, MoE routes, text, and
why a sample is dropped from the loss: a failed environment or reward), the
summed rewards, and a few scalars (the loader position it drew at, the draw's seconds, reward
metrics). `pack` lays it out as one uint8 buffer: a JSON header (those scalars, the string
fields' vocabularies, and each tensor field's name, dtype and length), then each field's bytes,
8-byte aligned; `unpack` is its inverse and returns exactly what was packed (log-probs travel
as float32 when every value is a float32, as vLLM's are, else float64; rewards as float64).

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

import array
import dataclasses
import itertools
import json
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from megagrpo.engine import Completion

ALIGN = 8
TAG = 0
"""One tag: messages between a pair of ranks arrive in the order they were sent; a part's
header names its batch and the receiver checks it."""

# per completion, in this order: the int64 scalars of `ints`
INT_COLUMNS = ("prompt_index", "sample_index", "version", "turns", "tool_calls", "tool_errors",
               "tokens", "token_versions", "loss_mask", "turn_rewards", "finish_reason",
               "truncation", "correct", "routes", "text", "env_retries", "dropped")
"""`tokens`: len(token_ids); `token_versions` / `loss_mask`: 1 when present; `turn_rewards`:
their count, -1 for None; `finish_reason` / `truncation` / `dropped`: index into the header's
vocabulary; `correct`: -1 None, 0, 1; `routes`: the routes tensor's rank (0: None);
`text`: its UTF-8 byte count."""
FLOAT_COLUMNS = ("tool_seconds", "env_reward", "reward")


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
    completions: list[Completion] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    """Per completion: the summed reward."""
    policy_versions: bool = False
    """The completions' versions are policy versions already (a part restored from a
    checkpoint, `megagrpo.rollout.placement`), not sync indices of this launch."""

    def slice(self, lo: int, hi: int) -> Part:
        """The completions of prompts lo <= prompt_index < hi (and their rewards)."""
        keep = [k for k, c in enumerate(self.completions) if lo <= c.prompt_index < hi]
        return dataclasses.replace(self, completions=[self.completions[k] for k in keep],
                                   rewards=[self.rewards[k] for k in keep])


# ---------------------------------------------------------------------- packing
def _vocab(values: list[str]) -> list[str]:
    return sorted(set(values))


def _flat(code: str, lists, dtype: torch.dtype) -> torch.Tensor:
    """The lists concatenated as one tensor, through an `array` of type `code` (filled in C:
    building a Python list of every token first took most of a 10k-sample pack)."""
    flat = array.array(code, itertools.chain.from_iterable(lists))
    return torch.frombuffer(flat, dtype=dtype) if flat else torch.empty(0, dtype=dtype)


def _exact_float32(values: torch.Tensor) -> bool:
    return bool(torch.equal(values.to(torch.float32).to(torch.float64), values))


def pack(part: Part) -> torch.Tensor:
    """`part` as one uint8 buffer: [8-byte header length][JSON header][fields] (module
    docstring)."""
    cs = part.completions
    finish, trunc = _vocab([c.finish_reason for c in cs]), _vocab([c.truncation for c in cs])
    dropped = _vocab([c.dropped for c in cs])
    texts = [c.text.encode() for c in cs]
    ints = torch.tensor([[
        c.prompt_index, c.sample_index, c.version, c.turns, c.tool_calls, c.tool_errors,
        len(c.token_ids), c.token_versions is not None, c.loss_mask is not None,
        -1 if c.turn_rewards is None else len(c.turn_rewards), finish.index(c.finish_reason),
        trunc.index(c.truncation), -1 if c.correct is None else int(c.correct),
        0 if c.routes is None else c.routes.dim(), len(t), c.env_retries,
        dropped.index(c.dropped)] for c, t in zip(cs, texts)],
        dtype=torch.int64).reshape(len(cs), len(INT_COLUMNS))
    floats = torch.tensor([[c.tool_seconds, c.env_reward, r] for c, r in
                           zip(cs, part.rewards, strict=True)],
                          dtype=torch.float64).reshape(len(cs), len(FLOAT_COLUMNS))
    ids = _flat("q", (c.token_ids for c in cs), torch.int64)
    if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < 2 ** 31:
        raise ValueError(f"a token id outside int32 ({int(ids.min())}..{int(ids.max())}) in "
                         f"batch {part.batch}: the sample channel sends ids as int32")
    logprobs = _flat("d", (c.logprobs for c in cs), torch.float64)
    for c in cs:
        if len(c.logprobs) != len(c.token_ids):
            raise ValueError(f"a completion of batch {part.batch} has {len(c.token_ids)} token "
                             f"ids and {len(c.logprobs)} log-probs")
    routes = [c.routes for c in cs if c.routes is not None]
    fields = {
        "ints": ints, "floats": floats, "token_ids": ids.to(torch.int32),
        "logprobs": logprobs.to(torch.float32) if _exact_float32(logprobs) else logprobs,
        "token_versions": torch.tensor([v for c in cs if c.token_versions is not None
                                        for v in c.token_versions], dtype=torch.int64),
        "loss_mask": torch.tensor([m for c in cs if c.loss_mask is not None
                                   for m in c.loss_mask], dtype=torch.bool),
        "turn_rewards": torch.tensor([r for c in cs if c.turn_rewards is not None
                                      for r in c.turn_rewards], dtype=torch.float64),
        "route_shapes": torch.tensor([s for r in routes for s in r.shape], dtype=torch.int64),
        "routes": (torch.cat([r.reshape(-1) for r in routes]) if routes
                   else torch.empty(0, dtype=torch.int16)),
        "text": torch.frombuffer(bytearray(b"".join(texts)) or bytearray(1), dtype=torch.uint8
                                 )[:sum(map(len, texts))],
    }
    header = {"batch": part.batch, "rollout": part.rollout, "loader": part.loader,
              "epoch": part.epoch, "draw_s": part.draw_s, "metrics": part.metrics,
              "finish_reason": finish, "truncation": trunc, "dropped": dropped,
              "policy_versions": part.policy_versions,
              "fields": [[k, str(t.dtype).removeprefix("torch."), t.numel()]
                         for k, t in fields.items()]}
    blobs = [json.dumps(header).encode()]
    blobs += [t.contiguous().view(torch.uint8).numpy().tobytes() for t in fields.values()]
    out = bytearray(len(blobs[0]).to_bytes(8, "little"))
    for b in blobs:
        out += b + bytes(-len(b) % ALIGN)
    return torch.frombuffer(out, dtype=torch.uint8)


def unpack(buf: torch.Tensor) -> Part:
    """The `Part` `pack` laid out in `buf` (uint8)."""
    n = int.from_bytes(buf[:8].numpy().tobytes(), "little")
    header = json.loads(buf[8:8 + n].numpy().tobytes().decode())
    off, f = 8 + n + (-n % ALIGN), {}
    for name, dtype, numel in header["fields"]:
        dt = getattr(torch, dtype)
        size = numel * torch.empty(0, dtype=dt).element_size()
        f[name] = buf[off:off + size].clone().view(dt)
        off += size + (-size % ALIGN)
    ints, floats = f["ints"].view(-1, len(INT_COLUMNS)).tolist(), f["floats"].view(
        -1, len(FLOAT_COLUMNS)).tolist()
    ids, lps = _Cursor(f["token_ids"].tolist()), _Cursor(f["logprobs"].double().tolist())
    tv, lm = _Cursor(f["token_versions"].tolist()), _Cursor(f["loss_mask"].tolist())
    tr, shapes = _Cursor(f["turn_rewards"].tolist()), _Cursor(f["route_shapes"].tolist())
    routes, text = _Cursor(f["routes"]), _Cursor(f["text"].numpy().tobytes())
    comps = []
    for row, (tool_s, env_r, _) in zip(ints, floats):
        r = dict(zip(INT_COLUMNS, row))
        k = r["tokens"]
        c = Completion(prompt_index=r["prompt_index"], sample_index=r["sample_index"],
                       token_ids=ids.take(k), logprobs=lps.take(k),
                       finish_reason=header["finish_reason"][r["finish_reason"]],
                       text=text.take(r["text"]).decode(),
                       correct=None if r["correct"] < 0 else bool(r["correct"]),
                       version=r["version"], turns=r["turns"], tool_calls=r["tool_calls"],
                       tool_errors=r["tool_errors"], tool_seconds=tool_s, env_reward=env_r,
                       truncation=header["truncation"][r["truncation"]],
                       env_retries=r["env_retries"],
                       dropped=header["dropped"][r["dropped"]],
                       token_versions=tv.take(k) if r["token_versions"] else None,
                       loss_mask=lm.take(k) if r["loss_mask"] else None,
                       turn_rewards=tr.take(r["turn_rewards"]) if r["turn_rewards"] >= 0
                       else None)
        if r["routes"]:
            shape = shapes.take(r["routes"])
            c.routes = routes.take(math.prod(shape)).reshape(shape)
        comps.append(c)
    return Part(batch=header["batch"], rollout=header["rollout"], loader=header["loader"],
                epoch=header["epoch"], draw_s=header["draw_s"], metrics=header["metrics"],
                completions=comps, rewards=[x[2] for x in floats],
                policy_versions=header.get("policy_versions", False))


class _Cursor:
    """Consecutive slices of one flat sequence."""

    def __init__(self, seq) -> None:
        self.seq, self.at = seq, 0

    def take(self, n: int):
        self.at += n
        return self.seq[self.at - n:self.at]


# ---------------------------------------------------------------------- the channels
def replica_range(dp_rank: int, dp: int, batch_size: int) -> tuple[int, int]:
    """The prompts of the global batch DP replica `dp_rank` trains: [lo, hi)."""
    n = batch_size // dp
    return dp_rank * n, (dp_rank + 1) * n


def ready_key(i: int, j: int) -> str:
    return f"batch/{i}/{j}"


class TensorChannel:
    """Packed parts over the `samples` gloo group (module docstring). Built on either side:
    rollout ranks `put` and `close`, training ranks `take`."""

    def __init__(self, *, group, store, rank: int, train_world: int, rollout_ranks: int,
                 batch_size: int, timeout_s: float, replica: tuple[int, int] | None = None
                 ) -> None:
        self.group, self.store, self.rank = group, store, rank
        self.T, self.R, self.B, self.timeout_s = train_world, rollout_ranks, batch_size, timeout_s
        self.bytes_sent = self.bytes_received = 0
        self._queue: queue.Queue = queue.Queue()
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
        self._unsent[part.batch] = part
        self._queue.put(part)
        self.store.set(ready_key(part.batch, part.rollout), "1")

    def close(self) -> None:
        """Rollout rank, after the trainer's stop: the parts it never asked for are dropped."""
        self._stop.set()
        if self._thread is not None:
            self._queue.put(None)
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
            while True:
                part = self._queue.get()
                if part is None or not self._asked(part.batch):
                    return
                packed = {r: pack(part.slice(*r)) for r in set(ranges)}
                for t, r in enumerate(ranges):
                    self._send(packed[r], t)
                self._unsent.pop(part.batch, None)
        except BaseException as e:  # re-raised by the next put / close on the main thread
            self._failed.append(e)

    def _asked(self, i: int) -> bool:
        """Waits until the trainer asks for batch i (True) or says stop (False)."""
        while not self.store.check([f"take/{i}"]):
            if self._stop.is_set():
                return False
            time.sleep(0.005)
        return True

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

    def put(self, part: Part) -> None:
        data = json.dumps(dict(dataclasses.asdict(dataclasses.replace(part, completions=[])),
                               completions=[dataclasses.asdict(dataclasses.replace(
                                   c, routes=None)) for c in part.completions]))
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


__all__ = ["Part", "StoreChannel", "TensorChannel", "pack", "replica_range", "unpack"]
