"""Tasks: where train/eval prompts and the tokenizer come from (built-in or files)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megagrpo.config.data import ArithmeticConfig, DataConfig
from megagrpo.data import (
    IMAGE_FIELD,
    Example,
    Tokenizer,
    build_examples,
    load_tokenizer,
    read_records,
)
from megagrpo.tasks import arithmetic
from megagrpo.tasks.arithmetic_tools import TOOL_STOP


@dataclass(kw_only=True)
class Task:
    """Everything the trainer needs from the data side."""

    train: list[Example]
    """Templated training prompts and answers."""
    eval: list[Example]
    """Held-out prompts (may be empty)."""
    tokenizer: Tokenizer
    """The tokenizer shared by trainer, rollout and rewards."""
    stop_ids: tuple[int, ...] = ()
    """Token ids besides EOS that end a turn (arithmetic.tools: the call's closing tag)."""


def build_task(data: DataConfig, arith: ArithmeticConfig | None = None) -> Task:
    """The configured task: the built-in arithmetic one, or prompts read from files. The
    sections are checked already (`TrainConfig.validate`, in the preflight)."""
    if data.task == "arithmetic":
        arith = arith or ArithmeticConfig()
        tokenizer = load_tokenizer(data.tokenizer) if data.tokenizer else (
            arithmetic.build_tokenizer(arith.tokenizer_dir, tools=arith.tools))
        stop = tuple(tokenizer.encode(TOOL_STOP)) if arith.tools else ()
        return Task(train=arithmetic.train_examples(arith), eval=arithmetic.eval_examples(arith),
                    tokenizer=tokenizer, stop_ids=stop)
    if not data.tokenizer:
        raise ValueError("data.tokenizer is empty: task=file needs a .model file or HF tokenizer")
    tokenizer = load_tokenizer(data.tokenizer)
    return Task(train=_file_examples(data, data.path, tokenizer),
                eval=_file_examples(data, data.eval_path, tokenizer) if data.eval_path else [],
                tokenizer=tokenizer)


def _file_examples(data: DataConfig, path: str, tokenizer: Tokenizer) -> list[Example]:
    records = read_records(path, data.format, data.split)
    examples = build_examples(records, prompt_field=data.prompt_field,
                              answer_field=data.answer_field, template=data.template,
                              tokenizer=tokenizer, system_prompt=data.system_prompt,
                              source=str(path))
    base = Path(path).expanduser()
    base = base if base.is_dir() else base.parent
    for i, e in enumerate(examples):  # a record's images: paths relative to its file
        images = e.record.get(IMAGE_FIELD)
        if images is None:
            continue
        if not isinstance(images, list) or not all(isinstance(p, str) for p in images):
            raise ValueError(f"{path}, record {i + 1}: {IMAGE_FIELD!r} must be a list of image "
                             f"paths (relative to the file), got {images!r}")
        e.record[IMAGE_FIELD] = [str(base / p) for p in images]
    return examples
