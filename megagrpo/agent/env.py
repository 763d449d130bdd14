"""What a multi-turn environment is: created per trajectory, it answers each assistant turn.

A trajectory is one token sequence: the prompt, then per turn the assistant's sampled ids
(exactly vLLM's) and the environment's observation ids (tokenized once, never re-encoded from
decoded text). Only the assistant's ids count in the loss, the KL and the vLLM-vs-trainer gap.

A user environment is a subclass named in the recipe (`agent.environment: my_mod:MyEnv`):

    class MyEnv(Environment):
        def step(self, turn: Turn) -> Observation:
            if "ANSWER" in turn.text:
                return Observation(done=True, reward=1.0)
            return Observation(text="\\nKeep going.\\n")
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Turn:
    """One assistant turn as sampled."""

    index: int
    """0 for the first turn."""
    text: str
    """The turn's ids decoded (for parsing only: the trajectory keeps `token_ids`)."""
    token_ids: tuple[int, ...]
    finish_reason: str
    """'stop' (EOS or a stop string) or 'length' (hit the turn's token budget)."""


@dataclass(frozen=True, kw_only=True)
class Observation:
    """The environment's answer to a turn. With `done` the trajectory ends after this turn and
    `text`/`token_ids` are ignored; otherwise they are appended and the model continues."""

    text: str = ""
    """Appended as is, tokenized once without special-token insertion (e.g. a chat template's
    tool turn: end of the assistant turn, the tool's result, the start of the next assistant
    turn)."""
    token_ids: tuple[int, ...] | None = None
    """The observation's ids, when the environment tokenizes itself (then `text` is for logs)."""
    done: bool = False
    reward: float = 0.0
    """This turn's reward (agent.env_reward says how turns' rewards join the reward terms')."""
    tool_calls: int = 0
    """Tool calls this turn made (metrics)."""
    tool_errors: int = 0
    """Of those, calls that failed: unknown tool, bad arguments, a raise, a timeout, a limit."""
    tool_seconds: float = 0.0
    """Wall time spent in tools this turn."""


class Environment:
    """Base class of multi-turn environments; one instance per trajectory.

    `record` is the prompt's data record (a dict: the question, the answer and any other
    field of the data file); `tokenizer` is the run's HF tokenizer (for chat templates);
    `kwargs` are agent.kwargs from the recipe."""

    def __init__(self, record: dict, tokenizer: object = None, **kwargs: object) -> None:
        self.record, self.tokenizer = record, tokenizer

    def step(self, turn: Turn) -> Observation:
        """Answers assistant turn `turn` (called once per turn, in order)."""
        raise NotImplementedError(f"{type(self).__name__}.step")

    def close(self) -> None:
        """Called once when the trajectory ends (release what the environment holds)."""

    def state_dict(self) -> dict | None:
        """What a checkpoint keeps of this environment while its trajectory is paused at a
        weight update (rollout.partial_rollouts): a dict of tensors, dicts, lists, tuples,
        numbers, strings and None (saved pickle-free). With it, a resumed run continues the
        trajectory where it was, as the uninterrupted run does (`load_state_dict` puts it
        back into an environment built afresh from the same record). None, the default: this
        environment cannot save its state, and a resume samples its paused trajectories again
        from their prompt (said on the console, counted as partial_restarted)."""
        return None

    def load_state_dict(self, state: dict) -> None:
        """Puts back what `state_dict` gave, into an environment just built from the same
        record, tokenizer and agent.kwargs; the next call is `step` of the trajectory's next
        turn."""
        raise NotImplementedError(f"{type(self).__name__}.load_state_dict (its state_dict "
                                  "gives a state, so a resume must be able to put it back)")
