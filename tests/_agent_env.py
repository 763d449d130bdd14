"""A multi-turn test environment for the arithmetic task's tokenizer (digits, '+-*= '):
answers turns 1 and 2 with '<turn>=<b mod 10> ' and ends after turn 3, paying 0.5 per turn.
Deterministic given the record and the turns (rollout engines with several ranks need that)."""
from __future__ import annotations

import json
import time
import zlib

from megagrpo.agent import Environment, Observation, Turn


class Digits(Environment):
    def step(self, turn: Turn) -> Observation:
        if turn.index >= 2:
            return Observation(done=True, reward=0.5)
        return Observation(text=f"{turn.index}={self.record.get('b', 0) % 10} ", reward=0.5,
                           tool_calls=1)


class DigitsSaved(Digits):
    """Digits that counts the turns it answered and refuses a turn out of order (an
    environment built again without its count, or asked a turn twice, raises: an environment
    error); the count is its state (`Environment.state_dict`) once it has answered a turn;
    before that it gives none (a resume restarts those trajectories from their prompt)."""

    def __init__(self, record: dict, tokenizer: object = None, **kwargs: object) -> None:
        super().__init__(record, tokenizer)
        self.answered = 0

    def step(self, turn: Turn) -> Observation:
        if turn.index != self.answered:
            raise RuntimeError(f"asked turn {turn.index} after answering {self.answered}")
        self.answered += 1
        return super().step(turn)

    def state_dict(self) -> dict | None:
        return {"answered": self.answered} if self.answered else None

    def load_state_dict(self, state: dict) -> None:
        self.answered = state["answered"]


class Ids(Environment):
    """Answers turns 1 and 2 with token ids (no tokenizer needed), done after turn 3."""

    def step_ids(self, index: int) -> tuple[int, ...]:
        return (40 + index, 50 + self.record["k"], 61)

    def step(self, turn: Turn) -> Observation:
        if turn.index >= 2:
            return Observation(done=True)
        return Observation(token_ids=self.step_ids(turn.index))


def _fault_roll(record: dict, index: int) -> int:
    """0-99 from the prompt's record and the turn: every run meets the same faults (a resumed
    run must, to be compared with the uninterrupted one)."""
    return zlib.crc32(f"{json.dumps(record, sort_keys=True)}|{index}".encode()) % 100


class Flaky(Digits):
    """Digits that fails as a flaky service does: 10% of turns raise (on every try, so the
    trajectory fails after agent.env_retries and is dropped) and 1% hang for HANG_S (past
    agent.env_timeout_s: cut, not retried); which ones is fixed by the record and the turn."""

    HANG_S = 6.0

    def step(self, turn: Turn) -> Observation:
        roll = _fault_roll(self.record, turn.index)
        if roll < 1:
            time.sleep(self.HANG_S)
        elif roll < 11:
            raise RuntimeError(f"planted environment failure (turn {turn.index})")
        return super().step(turn)


class Sandboxed(Digits):
    """Digits whose answer is computed by a tool's sandboxed child (megagrpo.agent.sandbox,
    the kernel sandbox): a child killed from outside (scripts/fault_harness.py) fails the call,
    the step raises and the runner asks it again (agent.env_retries), so the trajectory is the
    one an undisturbed run samples."""

    def step(self, turn: Turn) -> Observation:
        from megagrpo.agent.sandbox import Limits, run_code

        if turn.index >= 2:
            return Observation(done=True, reward=0.5)
        res = run_code(f"print({int(self.record.get('b', 0))} % 10)", Limits(wall_s=30.0))
        if not res.ok:
            raise RuntimeError(f"the tool's sandbox failed ({res.limit or res.exit_code})")
        return Observation(text=f"{turn.index}={res.stdout.strip()} ", reward=0.5, tool_calls=1)
