"""Built-in synthetic task: integer arithmetic such as '12+7=' -> '19' then EOS.

Why this shape: with a character-level tokenizer every digit is one token, so a ~1-5M parameter
model can learn the digit-by-digit carries in minutes on a CPU. 2-digit addition is hard enough
that a short supervised cold start leaves room for GRPO to show its gain (the cold start gets
part of the carries right), and easy enough that GRPO can push held-out accuracy above 0.9.

The held-out split is chosen by a stable hash of the problem text, so train and eval are disjoint
for any seed and sample size, without enumerating the problem space.
"""
from __future__ import annotations

import io
import os
import random
import re
import zlib
from pathlib import Path

from megagrpo.config.data import ArithmeticConfig
from megagrpo.data import Example, SentencePieceTokenizer
from megagrpo.tasks.arithmetic_tools import SYMBOLS, trajectory

# Fixed alphabet in id order after the 4 specials (<pad>=0, <unk>=1, <s>=2, </s>=3), so digit d
# is id 4 + d, independent of any sampled text.
ALPHABET = "0123456789+-*= "
TOKENIZER_FILE = "arithmetic-char-v1.model"
TOOLS_TOKENIZER_FILE = "arithmetic-tools-char-v1.model"
"""arithmetic.tools: the same characters plus the tool tags (`arithmetic_tools.SYMBOLS`, ids
4-7, the characters after them)."""
_HASH_BUCKETS = 1_000_000


def problem_text(a: int, op: str, b: int) -> str:
    """The prompt for one problem, e.g. '12+7='."""
    return f"{a}{op}{b}="


def solve(a: int, op: str, b: int) -> int:
    """The exact integer result."""
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def answer_text(value: int, cfg: ArithmeticConfig) -> str:
    """The answer as the model should write it (digits reversed when cfg.reverse_answer; a
    minus sign stays in front)."""
    text = str(value)
    if not cfg.reverse_answer:
        return text
    sign, digits = ("-", text[1:]) if text.startswith("-") else ("", text)
    return sign + digits[::-1]


def is_eval_problem(prompt: str, eval_fraction: float) -> bool:
    """Held-out membership by a stable hash of the prompt (CRC32, not Python's salted hash)."""
    return zlib.crc32(prompt.encode()) % _HASH_BUCKETS < eval_fraction * _HASH_BUCKETS


def sample_problem(rng: random.Random, cfg: ArithmeticConfig) -> tuple[int, str, int]:
    """Operands uniform in [0, 10**digits), operator uniform over cfg.operators."""
    hi = 10**cfg.digits - 1
    a, b, op = rng.randint(0, hi), rng.randint(0, hi), rng.choice(cfg.operators)
    if op == "-" and not cfg.allow_negative and a < b:
        a, b = b, a
    return a, op, b


def _draw(cfg: ArithmeticConfig, split: str, n: int, seed: int, distinct: bool) -> list[Example]:
    rng = random.Random(f"arithmetic-{split}-{seed}")
    want_eval = split == "eval"
    out: list[Example] = []
    seen: set[str] = set()
    while len(out) < n:
        a, op, b = sample_problem(rng, cfg)
        prompt = problem_text(a, op, b)
        if is_eval_problem(prompt, cfg.eval_fraction) != want_eval or (distinct and prompt in seen):
            continue
        seen.add(prompt)
        answer = answer_text(solve(a, op, b), cfg)
        out.append(Example(prompt=prompt, answer=answer,
                           record={"prompt": prompt, "answer": answer, "a": a, "op": op, "b": b}))
    return out


def train_examples(cfg: ArithmeticConfig) -> list[Example]:
    """cfg.num_train training prompts (repeats allowed), never from the held-out split."""
    return _draw(cfg, "train", cfg.num_train, cfg.seed, distinct=False)


def eval_examples(cfg: ArithmeticConfig) -> list[Example]:
    """cfg.num_eval distinct held-out prompts."""
    return _draw(cfg, "eval", cfg.num_eval, cfg.seed, distinct=True)


def sft_examples(
    n: int, seed: int, cfg: ArithmeticConfig | None = None
) -> list[tuple[str, str | tuple[tuple[str, bool], ...]]]:
    """(prompt, completion) pairs for a supervised cold start, from the train split only.

    The completion is the answer text; with cfg.tools the tool-using trajectory as (text,
    trained) segments (`arithmetic_tools.trajectory`). Append the tokenizer's EOS id after
    encoding it."""
    cfg = cfg or ArithmeticConfig()
    examples = _draw(cfg, "sft", n, seed, distinct=False)
    if cfg.tools:
        return [(e.prompt, trajectory(e.record["a"], e.record["op"], e.record["b"],
                                      solve(e.record["a"], e.record["op"], e.record["b"])))
                for e in examples]
    return [(e.prompt, e.answer) for e in examples]


def reward(completion: str, answer: str, strict: bool = True) -> float:
    """1.0 if the completion (decoded up to EOS) is the right number.

    strict: the whole completion, whitespace-stripped, must be the number (so the model must also
    learn to stop); otherwise only the leading integer is compared."""
    if strict:
        return float(completion.strip() == answer.strip())
    match = re.match(r"\s*(-?\d+)", completion)
    return float(match is not None and match.group(1) == answer.strip())


def build_tokenizer(directory: str | Path, tools: bool = False) -> SentencePieceTokenizer:
    """The task's character-level sentencepiece tokenizer (19 pieces; 23 with `tools`, the tool
    tags as single pieces), trained on first use and cached as `directory/TOKENIZER_FILE`
    (TOOLS_TOKENIZER_FILE). Deterministic; safe with concurrent ranks (each writes a private
    temp file, then renames it into place atomically)."""
    path = Path(directory).expanduser() / (TOOLS_TOKENIZER_FILE if tools else TOKENIZER_FILE)
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(_train_sentencepiece(SYMBOLS if tools else ()))
        os.replace(tmp, path)
    return SentencePieceTokenizer(path)


def _train_sentencepiece(symbols: tuple[str, ...] = ()) -> bytes:
    import sentencepiece as spm  # optional dependency of the HF-only stack

    # Character k appears len(ALPHABET) - k times, so frequency order = ALPHABET order = ids.
    lines = [ALPHABET[: len(ALPHABET) - k] for k in range(len(ALPHABET))]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, model_type="char",
        vocab_size=len(ALPHABET) + 4 + len(symbols), hard_vocab_limit=False,
        character_coverage=1.0, user_defined_symbols=list(symbols),
        add_dummy_prefix=False, remove_extra_whitespaces=False,
        normalization_rule_name="identity", pad_id=0, unk_id=1, bos_id=2, eos_id=3,
        num_threads=1, minloglevel=2,
    )
    return model.getvalue()
