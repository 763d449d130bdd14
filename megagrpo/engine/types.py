"""What the trainer and the rollout stage exchange with a rollout engine: the per-call sampling
knobs, one sampled completion, what a weight update moved, and the engine protocol itself."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from megagrpo.config.rollout import RolloutConfig

NO_VERSION = -1
"""`Completion.token_versions` of an environment's token in a multi-turn trajectory with
partial rollouts: no policy sampled it (its loss-mask entry is False)."""


def model_versions(c: Completion) -> list[int]:
    """The policy versions of the tokens a policy sampled (`token_versions` without the
    environment's `NO_VERSION`); [] when the completion has none."""
    return [v for v in (c.token_versions or ()) if v != NO_VERSION]


@dataclass(frozen=True, kw_only=True)
class SamplingSettings:
    """Per-call sampling knobs (the engine-level seed lives in RolloutConfig)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 64
    stop: tuple[str, ...] = ()
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a completion (e.g. the tokenizer's EOS when the engine has no
    tokenizer of its own)."""

    @classmethod
    def from_config(cls, cfg: RolloutConfig, n: int = 1) -> SamplingSettings:
        """The config's sampling knobs; `n` completions per prompt (the trainer passes
        algo.group_size, the one setting for G)."""
        return cls(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                   max_tokens=cfg.max_tokens, stop=tuple(cfg.stop), n=n)


@dataclass(kw_only=True)
class Completion:
    """One sampled completion, or a multi-turn trajectory (all ids after the prompt: the
    model's and the environment's, `loss_mask` telling them apart; `text` is then the last
    assistant turn's). `logprobs[i]` is the log-prob vLLM sampled `token_ids[i]` with (0.0 on
    environment tokens)."""

    prompt_index: int
    """Index of the prompt in the `generate` call."""
    sample_index: int
    """0..n-1 within the prompt's group."""
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    """'stop' (EOS or a stop string) or 'length' (hit max_tokens)."""
    text: str = ""
    correct: bool | None = None
    """Set by the trainer's reward pass: the correctness term's verdict (None: not scored)."""
    version: int = -1
    """The policy version (optimizer updates) of the weights that sampled it, stamped by the
    rollout stage; -1: not recorded (the batch's `Rollout.version` stands in). With in-flight
    updates (`token_versions` set) the oldest of the token versions."""
    token_versions: list[int] | None = None
    """rollout.inflight_updates or rollout.partial_rollouts: per token of `token_ids`, the
    policy version of the weights that sampled it (non-decreasing over the model's tokens:
    weights change between decode steps); an environment's token of a multi-turn trajectory
    holds NO_VERSION. None: one version sampled the whole completion (`version`)."""
    prompt_token_ids: list[int] | None = None
    """A prompt with images: the prompt as vLLM ran it, each image's placeholder pad expanded
    to the image's tokens (what the trainer's rows must hold); None: the prompt as given."""
    routes: torch.Tensor | None = None
    """MoE with routing capture: [len(prompt) + len(token_ids), L_moe, k] int16, the experts
    vLLM routed each position's token to in each MoE layer (-1 where it computed none: the
    last token, which no forward reads)."""
    # multi-turn trajectories (megagrpo.agent.runner); the defaults are a single-turn sample
    loss_mask: list[bool] | None = None
    """Per token of `token_ids`: True = sampled by the model (trained), False = the
    environment's (masked out of the loss, the KL and the vLLM gap; its `logprobs` entry is
    0.0). None: every token is the model's."""
    turns: int = 1
    """Assistant turns in the trajectory."""
    tool_calls: int = 0
    """Tool calls over the trajectory (the environment's count)."""
    tool_errors: int = 0
    """Of those, the failed ones."""
    tool_seconds: float = 0.0
    """Wall time the environment spent in tools."""
    turn_rewards: list[float] | None = None
    """Multi-turn: the environment's reward after each assistant turn (None: single-turn)."""
    env_reward: float = 0.0
    """The environment's rewards as the reward component joined them (agent.env_reward; set
    when the sample is scored, megagrpo.reward.environment)."""
    truncation: str = ""
    """Why the trajectory was cut short: '' (it ended: done, or a single-turn sample),
    'turn_length' (a turn hit rollout.max_tokens: not continued), 'max_turns', 'token_budget'
    or 'env_error' (the environment failed). finish_reason is 'length' for the first three."""
    env_retries: int = 0
    """Multi-turn: environment calls asked again after a failure (agent.env_retries)."""
    dropped: str = ""
    """Why the sample takes no part in training ('' = it does): 'env_error', its environment
    failed after agent.env_retries (agent.on_env_error=drop); 'reward_error', a reward source
    could not score it (a remote call failed after its retries, with on_failure=drop). A
    dropped sample leaves its group's advantage statistics and the loss
    (megagrpo.algo.group_advantages `valid`); it is never trained as if its reward were 0."""


@dataclass(kw_only=True)
class WeightSyncStats:
    """What one `update_weights` moved and where the time went."""

    tensors: int
    bytes: int
    seconds: float
    """Wall time of the whole update (including pulling from the source iterator)."""
    source_seconds: float
    """Time spent inside the source iterator (gather / convert on the trainer side)."""
    load_seconds: float
    """seconds - source_seconds: vLLM's load, repack and prefix-cache reset."""


class RolloutEngine(Protocol):
    """What the trainer needs from a rollout backend."""

    def generate(self, prompt_token_ids: list[list[int]],
                 sampling: SamplingSettings | None = None, *,
                 n: int | None = None) -> list[Completion]: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                       partial: bool = False,
                       dtypes: Mapping[str, torch.dtype] | None = None) -> WeightSyncStats: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...
