"""Rule-based reward functions on decoded text, and the resolver of reward-term names.

A rule is `fn(completion: str, answer: str, **kwargs) -> float`: math (math-verify), exact
match, a regex format check, or a user's `module:function`. `megagrpo.reward.terms.RuleTerms`
sums the configured ones (the `rules` reward source).
"""
from __future__ import annotations

import inspect
import re
import threading
from collections.abc import Callable

from megagrpo.config.data import RewardConfig
from megagrpo.runtime.names import import_object

RewardCallable = Callable[..., float]




def math_reward(completion: str, answer: str) -> float:
    """1.0 if math-verify finds the completion's final answer equivalent to `answer`, else 0.0."""
    # Imported here: math-verify pulls in sympy (slow import) and only math tasks need it.
    from math_verify import parse, verify

    in_main = threading.current_thread() is threading.main_thread()
    limit = 5 if in_main else None  # signal.alarm works only in the main thread
    gold = parse(answer, parsing_timeout=limit, raise_on_error=True)
    pred = parse(completion, parsing_timeout=limit, raise_on_error=True)
    return float(verify(gold, pred, timeout_seconds=limit, raise_on_error=True))


def normalize_answer(text: str) -> str:
    """Lower-case, drop surrounding $ / spaces / a final period, collapse whitespace, drop the
    thousands commas of numbers ('1,000' -> '1000')."""
    text = text.strip().strip("$").strip().rstrip(".").strip()
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)
    return " ".join(text.lower().split())


def exact_match_reward(completion: str, answer: str, pattern: str = "") -> float:
    """1.0 if the normalised completion equals the normalised answer.

    With `pattern`, the completion is first reduced to group 1 (or the whole match) of the LAST
    match of that regex, e.g. pattern '#### (.+)' for GSM8K-style answers."""
    if pattern:
        matches = list(re.finditer(pattern, completion, flags=re.DOTALL))
        if not matches:
            return 0.0
        last = matches[-1]
        completion = last.group(1) if last.groups() else last.group(0)
    return float(normalize_answer(completion) == normalize_answer(answer))


def format_reward(completion: str, answer: str, pattern: str, full: bool = True) -> float:
    """1.0 if the completion matches regex `pattern` (DOTALL; whole string if `full`)."""
    match = re.fullmatch if full else re.search
    return float(match(pattern, completion, flags=re.DOTALL) is not None)


BUILTIN_REWARDS: dict[str, str] = {
    "math": "megagrpo.reward.rules:math_reward",
    "exact_match": "megagrpo.reward.rules:exact_match_reward",
    "format": "megagrpo.reward.rules:format_reward",
    "arithmetic": "megagrpo.tasks.arithmetic:reward",
}

MOVED_MODULES: dict[str, str] = {"megagrpo.rewards": "megagrpo.reward.rules"}
"""Import strings of rules that moved: 'megagrpo.rewards:math_reward' (before the reward
subpackage) still names the same function."""


def reward_target(name: str) -> str:
    """The import string a term name stands for: a built-in's, a moved module's new one, or the
    name itself."""
    target = BUILTIN_REWARDS.get(name, name)
    module_name, sep, attr = target.partition(":")
    return f"{MOVED_MODULES[module_name]}{sep}{attr}" if module_name in MOVED_MODULES else target


def resolve_reward(name: str) -> RewardCallable:
    """A built-in name (see BUILTIN_REWARDS) or an import string 'package.module:function'.

    The module is imported like any Python module: it must be on the trainer's import path
    (the launch directory, or a folder on PYTHONPATH). Failures raise ValueError saying so."""
    target = reward_target(name)
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ValueError(
            f"reward {name!r}: use one of {sorted(BUILTIN_REWARDS)} or 'module:function'"
        )
    fn = import_object(target, f"reward {name!r}")
    if not callable(fn):
        raise ValueError(f"reward {name!r} resolves to a non-callable {type(fn).__name__}")
    return fn


def check_reward_kwargs(name: str, fn: RewardCallable, kwargs: dict) -> None:
    """Raise ValueError unless `fn(completion, answer, **kwargs)` binds: a misspelled keyword
    would otherwise make every call fail, scoring 0 for the whole run."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable without a signature: trust it
        return
    try:
        sig.bind("completion", "answer", **kwargs)
    except TypeError as e:
        params = [p for p in sig.parameters.values()
                  if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        accepts = ", ".join(p.name for p in params[2:]) or "no keyword arguments"
        raise ValueError(
            f"reward {name!r} with kwargs {kwargs}: {e}. A reward function is called as "
            f"fn(completion: str, answer: str, **kwargs) -> float; "
            f"{getattr(fn, '__name__', name)} accepts {accepts} after (completion, answer)"
        ) from None


def resolve_terms(cfg: RewardConfig) -> list[RewardCallable]:
    """Each term's function, resolved and checked against its kwargs; errors name the term."""
    fns = []
    for i, term in enumerate(cfg.terms):
        try:
            fn = resolve_reward(term.name)
            check_reward_kwargs(term.name, fn, term.kwargs)
        except ValueError as e:
            raise ValueError(f"reward.terms[{i}]: {e}") from None
        fns.append(fn)
    return fns


