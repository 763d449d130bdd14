"""A guess-the-number environment written in OpenEnv's own API (openenv-core: `Environment`,
`Action`, `Observation`, `State`, served by its `create_app`), nothing of megagrpo in it: the
hub adapter (megagrpo.agent.hub_openenv) must run it unmodified, in process and behind its
server.

reset(target=N) picks the number (the prompt's data record carries `target`); each step reads
the last digit of the message: the right one ends the episode with reward 1, a wrong one is
answered 'higher' / 'lower' (reward 0.25), a message without a digit is asked again (reward 0).
The episode ends after MAX_STEPS steps either way."""
from __future__ import annotations

import itertools
import re
from typing import Any, Optional

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

MAX_STEPS = 3


class GuessAction(Action):
    message: str = Field(..., description="The player's message; its last digit is the guess")


class GuessObservation(Observation):
    feedback: str = Field(default="", description="What the host says")
    guesses: int = Field(default=0, description="Guesses so far")


class GuessNumber(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True
    resets = itertools.count()
    """Episodes started, in this process (the test counts a server's)."""

    def __init__(self) -> None:
        super().__init__()
        self._state = State(step_count=0)
        self._target = 5

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None,
              target: int = 5, **kwargs: Any) -> GuessObservation:
        next(self.resets)
        self._state = State(episode_id=episode_id, step_count=0)
        self._target = int(target)
        return GuessObservation(feedback="I picked a number from 1 to 9.", reward=0.0)

    def step(self, action: GuessAction, timeout_s: Optional[float] = None,
             **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        n = self._state.step_count
        digits = re.findall(r"\d", action.message)
        if digits and int(digits[-1]) == self._target:
            return GuessObservation(feedback="right", guesses=n, done=True, reward=1.0)
        if not digits:
            feedback, reward = "Say a number from 1 to 9.", 0.0
        else:
            feedback = "higher" if int(digits[-1]) < self._target else "lower"
            reward = 0.25
        return GuessObservation(feedback=feedback, guesses=n, done=n >= MAX_STEPS,
                                reward=reward)

    @property
    def state(self) -> State:
        return self._state


class Broken(GuessNumber):
    """Raises on its second step (a hub environment with a bug)."""

    def step(self, action: GuessAction, timeout_s: Optional[float] = None,
             **kwargs: Any) -> GuessObservation:
        if self._state.step_count == 1:
            raise RuntimeError("planted failure on the second step")
        return super().step(action, timeout_s, **kwargs)


class Unannotated(GuessNumber, Environment[GuessAction, GuessObservation, State]):
    """Its types given as the generic parameters only (step carries no annotations)."""

    def step(self, action, timeout_s=None, **kwargs):  # noqa: ANN001, ANN201 - the point
        return super().step(action, timeout_s, **kwargs)


class Untyped(GuessNumber):
    """No annotations and no generic parameters: the adapter cannot know the action type."""

    def step(self, action, timeout_s=None, **kwargs):  # noqa: ANN001, ANN201 - the point
        return super().step(action, timeout_s, **kwargs)


def app(env: type = GuessNumber, sessions: int = 16):
    """OpenEnv's FastAPI app serving `env` (one instance per WebSocket session, at most
    `sessions` at once: the training test's one step, so a session left open fails it)."""
    from openenv.core.env_server.http_server import create_app

    return create_app(env, GuessAction, GuessObservation, env_name="guess",
                      max_concurrent_envs=sessions)
