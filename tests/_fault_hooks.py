"""Faults that tests and scripts/fault_harness.py plant through the environment: no megagrpo
flag knows of them. Read by the test reward `tests._rewards:length_reward` and the test reward
source `PromptLog`, both in the ranks' own processes (reward.isolation: thread).

- MEGAGRPO_TEST_DIE=<rank>:<path>: rank <rank> SIGKILLs itself at its first reward call after
  <path> exists (e.g. a checkpoint's manifest.json), on the first attempt of its torchrun job
  only (TORCHELASTIC_RESTART_COUNT 0), so a restarted job runs on.
- MEGAGRPO_TEST_KILL_WRITER=<rank>:<seconds>:<path>:<pidfile>[,...]: the first process rank
  <rank> forks while <path> exists (megatron's checkpoint writer while e.g.
  <out>/checkpoints/step_000002/policy.tmp exists: the policy's save of step 2) writes its pid
  to <pidfile> (created, so that only the first does; outside the run's checkpoints, which a
  restart clears), sleeps <seconds> and SIGKILLs itself; first attempt only. Read at import.
- MEGAGRPO_TEST_PROMPT_LOG=<dir>: `PromptLog` appends the prompts of every batch it scores to
  <dir>/attempt<A>.rank<R>.jsonl (one JSON list per call).
- MEGAGRPO_TEST_TRAJECTORY_LOG=<dir>: `TrajectoryLog` appends every sample it scores (prompt
  ids, completion ids, loss mask, turn rewards, truncation, finish reason) to
  <dir>/rank<R>.jsonl (one JSON list per call).
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch

from megagrpo.reward.source import Scores

DIE_ENV = "MEGAGRPO_TEST_DIE"
KILL_WRITER_ENV = "MEGAGRPO_TEST_KILL_WRITER"
PROMPT_LOG_ENV = "MEGAGRPO_TEST_PROMPT_LOG"
TRAJECTORY_LOG_ENV = "MEGAGRPO_TEST_TRAJECTORY_LOG"


def attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def maybe_die() -> None:
    """SIGKILL this rank where MEGAGRPO_TEST_DIE says (see the module doc)."""
    spec = os.environ.get(DIE_ENV)
    if not spec or attempt() != 0:
        return
    rank, path = spec.split(":", 1)
    if os.environ.get("RANK") == rank and os.path.exists(path):
        os.kill(os.getpid(), signal.SIGKILL)


def kill_writer() -> None:
    """In every child this process forks: die where MEGAGRPO_TEST_KILL_WRITER says (see the
    module doc). Registered after megagrpo's own at-fork hook (megagrpo.runtime.writers, which
    sends the writer's pid to the rank), as in a rank: megagrpo.run imports it first."""
    if attempt() != 0:
        return
    for spec in os.environ.get(KILL_WRITER_ENV, "").split(","):
        rank, seconds, rest = spec.split(":", 2)
        path, pidfile = rest.rsplit(":", 1)
        if os.environ.get("RANK") != rank or not os.path.exists(path):
            continue
        try:
            fd = os.open(pidfile, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            continue  # a writer of that save was killed already
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        time.sleep(float(seconds))
        os.kill(os.getpid(), signal.SIGKILL)


if os.environ.get(KILL_WRITER_ENV):
    import megagrpo.runtime.writers  # noqa: F401 - its hook first, as in a rank

    os.register_at_fork(after_in_child=kill_writer)


class PromptLog:
    """A reward source: `length_reward` of each completion (len / 10), and the prompts of
    every scored batch written where MEGAGRPO_TEST_PROMPT_LOG says (in sample order)."""

    def __init__(self, cfg=None) -> None:
        folder = os.environ.get(PROMPT_LOG_ENV)
        self.path = (Path(folder) / f"attempt{attempt()}.rank{os.environ.get('RANK', '0')}"
                     ".jsonl") if folder else None

    def score(self, samples) -> Scores:
        maybe_die()
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps([s.prompt for s in samples]) + "\n")
        r = torch.tensor([len(s.completion) / 10.0 for s in samples])
        return Scores(rewards=r, per_term={"length": r})

    def close(self) -> None:
        pass


class TrajectoryLog:
    """A reward source: the parity of each sample's token count after the prompt (0 or 1: a
    group of G has no reward spread with probability 2^(1-G), which dynamic sampling filters),
    and every scored sample as token ids, loss mask, turn rewards and ends, written where
    MEGAGRPO_TEST_TRAJECTORY_LOG says (in sample order): what this rank's engine and
    environments produced."""

    def __init__(self, cfg=None) -> None:
        folder = os.environ.get(TRAJECTORY_LOG_ENV)
        self.path = Path(folder) / f"rank{os.environ.get('RANK', '0')}.jsonl" if folder else None

    def score(self, samples) -> Scores:
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps([[s.prompt_ids, s.completion_ids, s.loss_mask,
                                     s.turn_rewards, s.truncation, s.finish_reason]
                                    for s in samples]) + "\n")
        r = torch.tensor([float(len(s.completion_ids) % 2) for s in samples])
        return Scores(rewards=r, per_term={"parity": r})

    def close(self) -> None:
        pass
