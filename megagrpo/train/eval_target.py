"""The GRPO phase's stop at a held-out accuracy (`eval.target_accuracy`), as the cold start's
`cold_start.target_accuracy`: a run ends at a skill, not a step count, since float rounding
differs between CPUs and with it where a fixed number of steps ends; `run.steps` is then the
most it runs. The run loop (`megagrpo.run`) checks it at each periodic evaluation; the state is
a checkpoint part (a key of trainer_state.json), so a resumed run that had reached the target
does not continue."""
from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("megagrpo")


@dataclass
class EvalTarget:
    """Whether (and where) held-out accuracy reached `target` during GRPO. `target` 0: off."""

    target: float
    reached_step: int | None = None
    """The GRPO step after which an evaluation first reached the target (None: not yet)."""
    accuracy: float | None = None
    """That evaluation's held-out accuracy."""

    @property
    def reached(self) -> bool:
        return self.reached_step is not None

    def check(self, step: int, accuracy: float, *, announce: bool = False,
              cap: int | None = None) -> bool:
        """Records `accuracy`, the evaluation after GRPO step `step`; True when it is the first
        to reach the target (the run stops there). `announce`: one console line (rank 0);
        `cap`: run.steps, named in it."""
        if self.target <= 0 or self.reached or accuracy < self.target:
            return False
        self.reached_step, self.accuracy = step, accuracy
        if announce:
            left = f"; {cap - step} of run.steps={cap} left unused" if cap else ""
            log.info("held-out accuracy %.3f >= eval.target_accuracy=%g after GRPO step %d: "
                     "the run stops here%s", accuracy, self.target, step, left)
        return True

    def summary(self) -> dict:
        """The run summary's fields (none when the target is off)."""
        if self.target <= 0:
            return {}
        return {"eval_target_accuracy": self.target, "eval_target_step": self.reached_step}

    def state_dict(self) -> dict:
        """For the checkpoint (keys of trainer_state.json)."""
        return {"eval_target": self.target, "eval_target_step": self.reached_step,
                "eval_target_reached_accuracy": self.accuracy}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint written after the target was reached: the run stays stopped, unless
        this run's target is off or higher than the accuracy reached (then it continues).
        Checkpoints from before this part have no such keys: not reached."""
        step, acc = state.get("eval_target_step"), state.get("eval_target_reached_accuracy")
        if step is None or acc is None or self.target <= 0 or acc < self.target:
            self.reached_step = self.accuracy = None
            return
        self.reached_step, self.accuracy = int(step), float(acc)
