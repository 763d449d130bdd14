"""A user environment for a real chat model (examples/smollm2-135m-hint-cpu.yaml): when the first
answer is wrong, the "user" answers with a hint and the model answers again. The hint is a user
turn written through the tokenizer's own chat template, so the trajectory is exactly the
conversation the model would see in a chat (prompt | answer | hint turn | second answer), and
only the model's two answers are trained.

    agent:
      environment: hint_env:HintEnvironment   # examples/ on PYTHONPATH
      max_turns: 2
"""
from __future__ import annotations

import re

from megagrpo.agent import Environment, Observation, Turn

_PLACEHOLDER = "\x00ANSWER\x00"


def last_number(text: str) -> str | None:
    """The last integer in `text` (commas dropped), or None."""
    found = re.findall(r"-?\d[\d,]*", text)
    return found[-1].replace(",", "") if found else None


class HintEnvironment(Environment):
    """Turn 1 right: done (reward from the reward terms). Turn 1 wrong: a hint as a user turn,
    then the model's second answer ends the trajectory."""

    def __init__(self, record: dict, tokenizer: object = None,
                 hint: str = "That is not right. Add the tens, then the ones, and answer again "
                             "with just the number.") -> None:
        super().__init__(record, tokenizer)
        self.hint = hint

    def step(self, turn: Turn) -> Observation:
        if turn.index > 0 or last_number(turn.text) == str(self.record["answer"]).strip():
            return Observation(done=True)
        return Observation(text=self._hint_turn())

    def _hint_turn(self) -> str:
        """The chat template's text after the model's answer (its closing EOS sampled already):
        the rest of the assistant turn, the user's hint and the next assistant header."""
        hf = getattr(self.tokenizer, "tok", self.tokenizer)
        messages = [{"role": "user", "content": str(self.record["prompt"])},
                    {"role": "assistant", "content": _PLACEHOLDER},
                    {"role": "user", "content": self.hint}]
        text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        tail = text[text.index(_PLACEHOLDER) + len(_PLACEHOLDER):]
        eos = hf.eos_token or ""
        return tail[len(eos):] if eos and tail.startswith(eos) else tail
