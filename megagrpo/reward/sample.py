"""What a reward source scores: a whole `Sample` (prompt, completion or trajectory, data record)."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from megagrpo.engine.types import Completion


@dataclass(kw_only=True)
class Sample:
    """One sampled completion (or multi-turn trajectory) with everything it was sampled from."""

    prompt: str
    """The prompt text the model continued (templated)."""
    prompt_ids: list[int]
    """The prompt's token ids."""
    completion: str
    """The completion's text; a trajectory's last assistant turn (what rule terms score)."""
    completion_ids: list[int]
    """Every token after the prompt (a trajectory's assistant and environment tokens)."""
    answer: str
    """The reference answer of the prompt's data record."""
    record: dict = field(default_factory=dict)
    """The data record the prompt came from."""
    loss_mask: list[bool] | None = None
    """Per `completion_ids` token: True = sampled by the model, False = the environment's;
    None: a single-turn completion (all the model's)."""
    turn_rewards: list[float] | None = None
    """Multi-turn: the environment's reward after each assistant turn; None: single-turn."""
    finish_reason: str = "stop"
    truncation: str = ""
    """Why a trajectory was cut short ('' = it ended; see `Completion.truncation`)."""

    def segments(self) -> list[tuple[bool, list[int]]]:
        """The trajectory as alternating runs of `completion_ids`: (sampled by the model?, ids)."""
        mask = self.loss_mask if self.loss_mask is not None else [True] * len(self.completion_ids)
        runs: list[tuple[bool, list[int]]] = []
        for tok, own in zip(self.completion_ids, mask, strict=True):
            if runs and runs[-1][0] == own:
                runs[-1][1].append(tok)
            else:
                runs.append((own, [tok]))
        return runs


def samples_of(comps: Sequence[Completion], prompt_of: Sequence[int], *,
               prompts: Sequence[list[int]], texts: Sequence[str] | Mapping[int, str],
               answers: Sequence[str], records: Sequence[dict],
               decode: Callable[[list[int]], str]) -> list[Sample]:
    """One `Sample` per completion; `prompt_of[i]` indexes completion i's prompt in `prompts`,
    `texts`, `answers` and `records`. Completions without text are decoded."""
    return [Sample(prompt=texts[p], prompt_ids=prompts[p],
                   completion=c.text or decode(c.token_ids), completion_ids=c.token_ids,
                   answer=answers[p], record=records[p], loss_mask=c.loss_mask,
                   turn_rewards=c.turn_rewards, finish_reason=c.finish_reason,
                   truncation=c.truncation)
            for c, p in zip(comps, prompt_of, strict=True)]
