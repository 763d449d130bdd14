"""The supervised cold start before GRPO (DeepSeek-R1's): NLL of the completion tokens of
(prompt, answer) pairs (the built-in arithmetic task's, or a file task's training records with
their answer field as the completion, images included for a vision-language model), then a
fresh optimizer and a reference equal to the cold-started policy. It drives the trainer
through `ColdStartable` (`Trainer` provides it) and takes its settings as arguments:
cold_start.*, arithmetic.*, the run's seed."""
from __future__ import annotations

import random
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Protocol

from megagrpo.tasks.arithmetic import sft_examples

if TYPE_CHECKING:
    from megagrpo.config.data import ArithmeticConfig
    from megagrpo.config.run import ColdStartConfig
    from megagrpo.data import Example
    from megagrpo.runtime.distributed import Ranks
    from megagrpo.runtime.metrics import MetricsLogger

Completion = str | tuple[tuple[str, bool], ...]
"""A supervised completion: text, or a multi-turn trajectory as (text, trained) segments."""
Pair = tuple[str, Completion] | tuple[str, Completion, dict]
"""(prompt, completion) or, from a file task, (prompt, completion, record): the record carries
the prompt's images (`megagrpo.data.IMAGE_FIELD`)."""
PairsFn = Callable[..., list[Pair]]
"""(n, seed=...) -> n pairs."""


def example_pairs(examples: list[Example], n: int, seed: int) -> list[Pair]:
    """n (prompt, answer, record) pairs drawn with replacement from a file task's training
    examples (seeded): the completion is the record's answer field."""
    rng = random.Random(seed)
    return [(e.prompt, e.answer, e.record) for e in rng.choices(examples, k=n)]


def encode_completion(tokenizer: object, completion: Completion, eos_id: int
                      ) -> tuple[list[int], list[bool] | None]:
    """The completion's ids with EOS, and the loss mask of a multi-turn trajectory (None: all
    trained). Each segment is encoded on its own, as the rollout encodes an observation and
    samples a turn: the ids the model would see and produce."""
    if isinstance(completion, str):
        return tokenizer.encode(completion) + [eos_id], None
    ids, mask = [], []
    for text, trained in completion:
        part = tokenizer.encode(text)
        ids += part
        mask += [trained] * len(part)
    return ids + [eos_id], mask + [True]


class ColdStartable(Protocol):
    """What the cold start needs from the trainer."""

    ranks: Ranks

    def sft_step(self, pairs: list[Pair], lr: float) -> float:
        """One supervised step on this rank's pairs; the global NLL per completion token."""

    def phase(self, name: str) -> None:
        """Names the phase for the stall watchdog."""

    def sync_weights(self) -> dict:
        """The policy's weights into vLLM."""

    def evaluate(self, examples: list[Example]) -> float:
        """Greedy held-out accuracy with the weights vLLM holds."""

    def restart_optimizer(self) -> None:
        """A fresh optimizer over the policy."""

    def reset_reference(self) -> None:
        """The reference becomes the policy."""


def supervised_steps(tr: ColdStartable, pairs_fn: PairsFn, steps: int, *, cfg: ColdStartConfig,
                     seed: int, progress: bool, start: int = 0,
                     total: int | None = None) -> list[float]:
    """SFT steps `start` .. `start + steps - 1` (of `total`) on this rank's share of
    cfg.batch_size pairs each (drawn from `seed`, the step and the DP rank); the global NLL per
    completion token of every step. `progress`: print every 50 steps (rank 0)."""
    total = total or start + steps
    dp, dp_rank = tr.ranks.dp, tr.ranks.dp_rank
    losses = []
    for s in range(start, start + steps):
        tr.phase(f"cold_start {s + 1}/{total}")  # each SFT step is a phase of its own
        pairs = pairs_fn(cfg.batch_size // dp, seed=seed * 100_003 + s * dp + dp_rank)
        losses.append(tr.sft_step(pairs, cfg.lr))
        if progress and (s + 1) % 50 == 0:
            print(f"cold start {s + 1:4d}/{total} | nll={losses[-1]:.3f}", flush=True)
    return losses


def cold_start(tr: ColdStartable, logger: MetricsLogger, cfg: ColdStartConfig,
               arith: ArithmeticConfig, *, held_out: list[Example], seed: int,
               progress: bool, train: list[Example] | None = None) -> dict:
    """The run's cold start on the arithmetic task (`train` None) or on a file task's training
    examples `train`; its summary fields. With
    cfg.target_accuracy > 0 it stops at the first held-out check (every cfg.check_every steps,
    on `held_out`) that reaches it. GRPO then starts from the cold-started weights with fresh
    Adam moments (the SFT gradients' second moments are far larger than policy-gradient ones
    and would damp the RL updates for hundreds of steps at beta2 = 0.999), and the reference
    is the cold-started model (DeepSeekMath). `progress`: console lines (rank 0)."""
    t = time.perf_counter()
    pairs = (partial(sft_examples, cfg=arith) if train is None
             else partial(example_pairs, train))
    check = cfg.target_accuracy > 0 and bool(held_out)
    losses: list[float] = []
    accuracy = None
    while len(losses) < cfg.steps:  # in chunks of check_every when it stops at an accuracy
        n = min(cfg.check_every if check else cfg.steps, cfg.steps - len(losses))
        losses += supervised_steps(tr, pairs, n, cfg=cfg, seed=seed, progress=progress,
                                   start=len(losses), total=cfg.steps)
        if check:
            tr.sync_weights()
            accuracy = tr.evaluate(held_out)
            if progress:
                print(f"cold start {len(losses):4d}/{cfg.steps} | held-out {accuracy:.3f} "
                      f"(stops at {cfg.target_accuracy:g})", flush=True)
            if accuracy >= cfg.target_accuracy:
                break
    for i in range(0, len(losses), max(1, len(losses) // 20)):
        logger.log({"sft_step": i + 1, "sft_loss": losses[i]})
    tr.restart_optimizer()
    # the reset first: it does not change the policy, and a LoRA reset (a merge) is then in
    # the base this sync sends, so the first step's refit carries the adapters alone
    tr.reset_reference()
    tr.sync_weights()
    out = {"sft_steps": len(losses), "sft_final_loss": losses[-1] if losses else None,
           "sft_seconds": time.perf_counter() - t}
    if accuracy is not None:
        out["sft_eval_accuracy"] = accuracy
    return out
