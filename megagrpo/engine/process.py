"""A rollout rank's vLLM engine in a child process (rollout.engine_failure=continue).

Under torchrun a worker that dies ends the whole worker group: its agent stops every rank. So
that a rollout rank survives its engine (an engine crash, an out-of-memory kill, a kill -9,
a draw that hangs), the engine runs in a child process of the rank (`EngineProcess`) and the
rank keeps its place in every process group. Calls go over a pipe; tensors cross through
shared memory (torch.multiprocessing's pickling), and a weight update is streamed bucket by
bucket, never held whole. When the child dies, or a call runs past its deadline (the child
is then killed), the call raises `EngineLost` and the engine stays lost: later weight
updates are drained (the rank still takes every sync, so the trainer's collectives go on)
and every draw raises `EngineLost` at once. What the rollout rank then does is
`megagrpo.rollout.serve.serve`'s business (it reports itself out; the trainer hands its
prompts to the remaining rollout ranks until the next checkpoint).
"""
from __future__ import annotations

import logging
import os
import signal
import time
from typing import Callable, Iterable

import torch
import torch.multiprocessing as mp

from megagrpo.engine.types import WeightSyncStats

log = logging.getLogger("megagrpo")

CHUNK_BYTES = 64 << 20
"""A weight update crosses to the child in chunks of about this many bytes."""

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                 "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                 "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE")


class EngineLost(RuntimeError):
    """The engine's child process died or stopped answering; the engine cannot be used."""

    def __init__(self, pid: int, how: str) -> None:
        super().__init__(f"the vLLM engine (child process {pid}) {how}")
        self.pid, self.how = pid, how


def _child(conn, build: Callable, parent: int, rank: int) -> None:
    """The child: the engine `build()` makes, serving calls from `conn` until told to close."""
    from megagrpo.runtime.console import configure
    from megagrpo.runtime.procs import die_with_parent

    die_with_parent(signal.SIGKILL, parent=parent)  # a rollout rank killed takes it along
    for name in _TORCHRUN_ENV:  # a world of one: vLLM starts as in a single-process run
        os.environ.pop(name, None)
    configure(rank)  # the rank's console filter (vLLM's start-up notes kept off)
    engine = build()
    conn.send(("ok", {"image_token_id": engine.image_token_id,
                      "max_lora_rank": engine.max_lora_rank, "on_cpu": engine.on_cpu}))
    while True:
        name, args, kwargs = conn.recv()
        try:
            if name == "update_weights":  # the tensors follow in chunks, then None
                out = engine.update_weights(_chunks(conn), **kwargs)
            else:
                out = getattr(engine, name)(*args, **kwargs)
            conn.send(("ok", out))
        except BaseException as e:  # the caller re-raises it
            conn.send(("err", e))
        if name == "close":
            return


def _chunks(conn) -> Iterable[list[tuple[str, torch.Tensor]]]:
    while (chunk := conn.recv()) is not None:
        yield chunk


class EngineProcess:
    """`VLLMEngine`'s calls, run by one in a child process (module docstring). `build`: a
    picklable callable that starts the engine in the child; `timeout_s`: the longest a call may
    take before the child is deemed frozen and killed (`start_timeout_s`, the engine's start,
    the same unless given)."""

    inflight = None  # refused with rollout.engine_failure=continue (by field)
    routes = None

    def __init__(self, build: Callable, timeout_s: float, rank: int,
                 start_timeout_s: float | None = None) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(child, build, os.getpid(), rank),
                                daemon=True, name=f"megagrpo-engine-rank{rank}")
        self.proc.start()
        child.close()
        self.pid = self.proc.pid
        self.timeout_s = timeout_s
        self.lost: EngineLost | None = None
        """Set once the child died or froze (every later draw raises it)."""
        attrs = self._result("start", timeout_s if start_timeout_s is None else start_timeout_s)
        self.image_token_id = attrs["image_token_id"]
        self.max_lora_rank = attrs["max_lora_rank"]
        self.on_cpu = attrs["on_cpu"]

    def alive(self) -> bool:
        """Whether the engine can still be used (a dead child is found here too, between
        calls: `lost` is then set)."""
        if self.lost is None and not self.proc.is_alive():
            self.lost = EngineLost(self.pid, self._how())
        return self.lost is None

    # ---------------------------------------------------------------- the pipe
    def _call(self, name: str, *args, **kwargs):
        if self.lost is not None:
            raise self.lost
        try:
            self._conn.send((name, args, kwargs))
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            self._lose(self._how())
        return self._result(name, self.timeout_s)

    def _result(self, name: str, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(0.05):
            if not self.proc.is_alive() and not self._conn.poll(0):
                self._lose(self._how())
            if time.monotonic() > deadline:
                self.proc.kill()
                self.proc.join(5)
                self._lose(f"did not answer {name} in {timeout_s:.0f} s "
                           "(parallel.collective_timeout_s) and was killed")
        try:
            status, out = self._conn.recv()
        except (EOFError, ConnectionResetError, OSError):
            self._lose(self._how())
        if status == "err":
            raise out
        return out

    def _how(self) -> str:
        self.proc.join(5)
        code = self.proc.exitcode
        if code is None:
            return "stopped answering"
        if code < 0:
            return f"was killed by signal {-code} ({signal.Signals(-code).name})"
        return f"exited with code {code}"

    def _lose(self, how: str):
        self.lost = EngineLost(self.pid, how)
        raise self.lost

    # ---------------------------------------------------------------- VLLMEngine's calls
    def generate(self, *args, **kwargs):
        return self._call("generate", *args, **kwargs)

    def rng_state(self) -> dict:
        return self._call("rng_state")

    def set_rng_state(self, state) -> None:
        self._call("set_rng_state", state)

    def load_adapter(self, path: str) -> None:
        if self.lost is None:
            self._call("load_adapter", path)

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass

    def update_weights(self, named_tensors, **kwargs) -> WeightSyncStats:
        """Streams the pairs (or buckets of pairs) to the child in chunks of ~CHUNK_BYTES. A
        lost engine drains them (the sync's collectives run to their end) and returns empty
        stats; the loss shows in `lost`."""
        live = self.lost is None
        if live:
            try:
                self._conn.send(("update_weights", (), kwargs))
            except OSError:
                live = False
        chunk, size = [], 0
        for item in named_tensors:
            pairs = item if isinstance(item, list) else [item]
            if not live:
                continue
            chunk += [(n, t) for n, t in pairs]
            size += sum(t.numel() * t.element_size() for _, t in pairs)
            if size >= CHUNK_BYTES:
                live = self._send_chunk(chunk)
                chunk, size = [], 0
        if live and self._send_chunk(chunk) and self._send_chunk(None):
            try:
                return self._result("update_weights", self.timeout_s)
            except EngineLost:
                pass
        if self.lost is None:
            self.lost = EngineLost(self.pid, self._how())
        return WeightSyncStats(tensors=0, bytes=0, seconds=0.0, source_seconds=0.0,
                               load_seconds=0.0)

    def _send_chunk(self, chunk) -> bool:
        try:
            if chunk != []:
                self._conn.send(chunk)
            return True
        except OSError:
            return False

    def close(self) -> None:
        if self.lost is None and self.proc.is_alive():
            try:
                self._call("close")
            except EngineLost:
                pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
