"""A multi-turn test environment for the arithmetic task's tokenizer (digits, '+-*= '):
answers turns 1 and 2 with '<turn>=<b mod 10> ' and ends after turn 3, paying 0.5 per turn.
Deterministic given the record and the turns (rollout engines with several ranks need that)."""
from __future__ import annotations

from megagrpo.agent import Environment, Observation, Turn


class Digits(Environment):
    def step(self, turn: Turn) -> Observation:
        if turn.index >= 2:
            return Observation(done=True, reward=0.5)
        return Observation(text=f"{turn.index}={self.record.get('b', 0) % 10} ", reward=0.5,
                           tool_calls=1)


class Ids(Environment):
    """Answers turns 1 and 2 with token ids (no tokenizer needed), done after turn 3."""

    def step_ids(self, index: int) -> tuple[int, ...]:
        return (40 + index, 50 + self.record["k"], 61)

    def step(self, turn: Turn) -> Observation:
        if turn.index >= 2:
            return Observation(done=True)
        return Observation(token_ids=self.step_ids(turn.index))
