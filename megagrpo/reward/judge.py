"""The `judge` source: a generative LLM judge served by the run's own vLLM engine (colocated, no
extra weights). Each sample becomes a judge prompt from the recipe's `template` (a format
string with {prompt}, {completion}, {answer}), rendered through the run's chat template
(`chat: true`) and encoded as the trainer encodes prompts; the engine answers greedily, and the
reward is `scale` x the number the `pattern`'s first group captures in the answer.

An answer the pattern does not match (or whose group is not a number) is a parse failure:
counted (`judge_parse_failures`), said on the console, and the sample is dropped from the loss
(`on_failure: drop`) or the step stops (`error`); never a silent 0.

Which weights judge: the engine serves the policy being trained, so the judge is the current
policy (self-judging) unless `base_model: true`, which on a LoRA run whose vLLM serves the
adapter (lora.enabled with an adapter refit) generates with the adapter off: the frozen base
model, at no extra weights. The engine is not safe for concurrent use, so the judge generates
synchronously on the thread that submitted the batch (the async draw thread, or the main one);
on engines of several ranks (rollout.tensor_parallel_size > 1) every rank would have to judge,
which the leader-only scoring does not do: refused at set-up.
"""
from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass

import torch

from megagrpo.config.data import RewardConfig
from megagrpo.data import encode_prompt, format_prompt
from megagrpo.engine.types import SamplingSettings
from megagrpo.reward.options import parse_options
from megagrpo.reward.sample import Sample
from megagrpo.reward.source import RewardContext, Scores, register_source

log = logging.getLogger("megagrpo")

ON_FAILURE = ("drop", "error")


@dataclass(kw_only=True)
class JudgeOptions:
    """`reward.options` of the `judge` source."""

    template: str
    """The judge's instruction: a format string with {completion} (and optionally {prompt},
    {answer})."""
    pattern: str = r"Score:\s*(-?\d+(?:\.\d+)?)"
    """A regular expression whose first group captures the score in the judge's answer (the
    first match counts)."""
    scale: float = 1.0
    """Reward = scale x the parsed score (e.g. 0.1 for a 0-10 scale)."""
    correct_at: float = 1.0
    """A reward >= this counts as correct (held-out accuracy)."""
    max_tokens: int = 256
    """Tokens the judge may write."""
    chat: bool = True
    """Render the instruction through the run's chat template (as a user message)."""
    system_prompt: str = ""
    """chat: an optional system message for the judge."""
    prompt_field: str = "prompt"
    """The data record's question for {prompt}; '' = the prompt text the policy saw."""
    base_model: bool = False
    """LoRA runs: judge with the frozen base (the adapter off in the same engine)."""
    on_failure: str = "drop"
    """A parse failure: 'drop' (the sample leaves the loss, counted) or 'error'."""

    def check(self, where: str) -> None:
        if "{completion}" not in self.template:
            raise ValueError(f"{where}.template={self.template!r}: put {{completion}} where the "
                             "judged answer goes ({prompt} and {answer} may appear too)")
        try:
            self.template.format(prompt="", completion="", answer="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"{where}.template: a slot other than {{prompt}}, {{completion}}, "
                             f"{{answer}} ({e}); write literal braces as {{{{ }}}}") from None
        try:
            groups = re.compile(self.pattern).groups
        except re.error as e:
            raise ValueError(f"{where}.pattern={self.pattern!r}: not a regular expression "
                             f"({e})") from None
        if groups < 1:
            raise ValueError(f"{where}.pattern={self.pattern!r}: needs a group capturing the "
                             "score, e.g. 'Score: (\\d+)'")
        if self.max_tokens < 1:
            raise ValueError(f"{where}.max_tokens={self.max_tokens}: need >= 1")
        if self.on_failure not in ON_FAILURE:
            raise ValueError(f"{where}.on_failure={self.on_failure!r}: use one of {ON_FAILURE}")
        if self.system_prompt and not self.chat:
            raise ValueError(f"{where}.system_prompt is set but {where}.chat is false")


def check_with_run(cfg: RewardConfig, *, engine_tp: int, lora_enabled: bool,
                   lora_refit: str) -> None:
    """Preflight: a judge source against the rest of the recipe (errors name the fields)."""
    judges = ([("reward.options", cfg.options)] if not cfg.sources and cfg.source == "judge"
              else [(f"reward.sources[{i}].options", s.options)
                    for i, s in enumerate(cfg.sources) if s.source == "judge"])
    for where, options in judges:
        if engine_tp > 1:
            raise ValueError(f"a judge reward ({where}) with rollout.tensor_parallel_size="
                             f"{engine_tp}: only an engine's leader rank scores, but every rank "
                             "of the engine would have to generate; set "
                             "rollout.tensor_parallel_size=1 or use a remote judge")
        if options.get("base_model") and (not lora_enabled or lora_refit == "merged"):
            raise ValueError(f"{where}.base_model=true needs vLLM serving a LoRA adapter to "
                             f"switch off (lora.rank > 0, lora.refit adapter or auto; now "
                             f"lora.enabled={lora_enabled}, lora.refit={lora_refit!r}); drop "
                             "base_model to judge with the policy")


@register_source("judge")
class JudgeSource:
    """Scores samples with the run's engine as a judge (module docstring)."""

    needs_context = True

    @staticmethod
    def check(cfg: RewardConfig) -> None:
        parse_options(JudgeOptions, cfg.options)

    def __init__(self, cfg: RewardConfig, context: RewardContext) -> None:
        self.opts = o = parse_options(JudgeOptions, cfg.options)
        if context.engine is None or context.tokenizer is None:
            raise ValueError("reward.source=judge needs the run's rollout engine and tokenizer "
                             "(megagrpo.run builds it with them)")
        if context.engine_tp > 1:
            raise ValueError(f"reward.source=judge with rollout.tensor_parallel_size="
                             f"{context.engine_tp}: only an engine's leader rank scores, but "
                             "every rank of the engine would have to generate; set "
                             "rollout.tensor_parallel_size=1 or use a remote judge")
        if o.base_model and not getattr(context.engine, "max_lora_rank", 0):
            raise ValueError("reward.options.base_model=true needs vLLM serving the policy's "
                             "LoRA adapter (lora.enabled with an adapter refit), so the adapter "
                             "can be switched off; this engine holds merged or full weights")
        self.engine, self.tokenizer = context.engine, context.tokenizer
        self.max_prompt = (context.max_model_len - o.max_tokens - 1 if context.max_model_len
                           else None)
        """The longest judge prompt the engine takes with room for the answer (None: any)."""
        self.pattern = re.compile(o.pattern)
        self.settings = SamplingSettings(temperature=0.0, max_tokens=o.max_tokens, n=1,
                                         stop_token_ids=tuple(context.stop_ids))

    def score(self, samples: list[Sample]) -> Scores:
        """Judges the samples in one generate call (synchronous: the engine is not shared)."""
        start = time.perf_counter()
        prompts = [self.judge_prompt(s) for s in samples]
        fits = [i for i, p in enumerate(prompts)
                if self.max_prompt is None or len(p) <= self.max_prompt]
        kwargs = {"adapter": False} if self.opts.base_model else {}
        answers = (self.engine.generate([prompts[i] for i in fits], self.settings, **kwargs)
                   if fits else [])
        texts = [""] * len(samples)
        for i, c in zip(fits, answers, strict=True):
            texts[i] = c.text or self.tokenizer.decode(c.token_ids)
        sent = set(fits)
        parsed = [self.parse(t) if i in sent else None for i, t in enumerate(texts)]
        too_long = len(samples) - len(fits)
        failed = [i for i, v in enumerate(parsed) if v is None]
        if failed:
            first = texts[failed[0]][:80]
            msg = (f"reward judge: {len(failed)} of {len(samples)} samples unscored: "
                   f"{len(failed) - too_long} answers did not match reward.options.pattern="
                   f"{self.opts.pattern!r} (first: {first!r}), {too_long} judge prompts longer "
                   f"than rollout.max_model_len - reward.options.max_tokens")
            if self.opts.on_failure == "error":
                raise RuntimeError(f"{msg}; reward.options.on_failure=error stops the run (set "
                                   "it to 'drop' to leave such samples out of the loss)")
            log.warning("%s: left out of the loss (reward.options.on_failure=drop)", msg)
        rewards = torch.tensor([self.opts.scale * v if v is not None else 0.0 for v in parsed],
                               dtype=torch.float32)
        valid = torch.tensor([v is not None for v in parsed], dtype=torch.bool)
        mean = float(rewards[valid].mean()) if bool(valid.any()) else 0.0
        return Scores(rewards=rewards, per_term={"judge": rewards},
                      correct=(rewards >= self.opts.correct_at) & valid,
                      valid=None if bool(valid.all()) else valid,
                      metrics={"reward/judge": mean,
                               "judge_parse_failures": float(len(failed) - too_long),
                               "judge_too_long": float(too_long),
                               "judge_time_s": time.perf_counter() - start})

    def judge_prompt(self, s: Sample) -> list[int]:
        """The judge's prompt ids for one sample."""
        o = self.opts
        if o.prompt_field and o.prompt_field not in s.record:
            raise ValueError(f"reward.options.prompt_field={o.prompt_field!r}: a data record "
                             f"has no such field (it has {sorted(s.record)}); name the "
                             "question's field, or '' for the prompt text the policy saw")
        question = str(s.record[o.prompt_field]) if o.prompt_field else s.prompt
        text = o.template.format(prompt=question, completion=s.completion, answer=s.answer)
        if o.chat:
            text = format_prompt(text, "chat", self.tokenizer, system_prompt=o.system_prompt)
        return encode_prompt(self.tokenizer, text)

    def parse(self, text: str) -> float | None:
        """The first match's first group as a number, None when there is none."""
        m = self.pattern.search(text)
        if m is None or m.group(1) is None:
            return None
        try:
            return float(m.group(1))
        except ValueError:
            return None

    def close(self) -> None:
        pass
