"""Prompt data: files -> records -> templated `Example`s -> a DP-sharded, resumable loader.

Also the one small `Tokenizer` protocol that sentencepiece and Hugging Face tokenizers both sit
behind, so the trainer, the rollout and the rewards never see which one is in use.
"""
from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

# ---------------------------------------------------------------------------------------------
# tokenizers


@runtime_checkable
class Tokenizer(Protocol):
    """What megagrpo needs from a tokenizer. encode adds no BOS/EOS; decode drops special
    tokens and ids outside the vocabulary (models pad their vocab for TP and may sample those)."""

    eos_id: int
    pad_id: int
    bos_id: int | None
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class SentencePieceTokenizer:
    """A sentencepiece model file behind the `Tokenizer` protocol (pad falls back to EOS)."""

    def __init__(self, model_file: str | Path) -> None:
        import sentencepiece as spm  # optional dependency of the HF-only stack

        self.sp = spm.SentencePieceProcessor(model_file=str(model_file))
        if self.sp.eos_id() < 0:
            raise ValueError(f"sentencepiece model {model_file} has no EOS piece (eos_id=-1)")
        self.eos_id = self.sp.eos_id()
        self.pad_id = self.sp.pad_id() if self.sp.pad_id() >= 0 else self.eos_id
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        self.vocab_size = self.sp.get_piece_size()
        self.unk_id = self.sp.unk_id() if self.sp.unk_id() >= 0 else None

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; ids outside the vocabulary (a TP-padded model can sample them) are
        dropped rather than raising."""
        return self.sp.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size])


class HFTokenizer:
    """A Hugging Face tokenizer (local folder or hub name) behind the `Tokenizer` protocol."""

    def __init__(self, name_or_path: str) -> None:
        from transformers import AutoTokenizer  # heavy import, only when an HF tokenizer is used

        self.source = str(name_or_path)
        """Where the tokenizer came from (a vision-language folder's image processor lies
        beside it: `megagrpo.hf.export.save_tokenizer` keeps it)."""
        self.tok = AutoTokenizer.from_pretrained(name_or_path)
        if self.tok.eos_token_id is None:
            raise ValueError(f"HF tokenizer {name_or_path} defines no eos_token")
        self.eos_id = int(self.tok.eos_token_id)
        pad = self.tok.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_id
        self.bos_id = self.tok.bos_token_id
        self.vocab_size = len(self.tok)
        self.unk_id = self.tok.unk_token_id  # None for byte-level vocabularies

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` without special tokens; out-of-vocabulary ids (TP padding) dropped."""
        kept = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        return self.tok.decode(kept, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """The conversation rendered as text, ending with the assistant generation prompt."""
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def load_tokenizer(spec: str) -> Tokenizer:
    """A `.model` file -> sentencepiece; anything else -> Hugging Face (folder or hub name)."""
    if spec.endswith(".model"):
        if not Path(spec).expanduser().is_file():
            raise FileNotFoundError(f"sentencepiece model {spec} does not exist")
        return SentencePieceTokenizer(Path(spec).expanduser())
    return HFTokenizer(spec)


def encode_prompt(tokenizer: Tokenizer, text: str, add_bos: bool = True) -> list[int]:
    """Prompt token ids, with BOS in front when the tokenizer has one and the text (e.g. a chat
    template) did not already produce it."""
    ids = tokenizer.encode(text)
    if add_bos and tokenizer.bos_id is not None and (not ids or ids[0] != tokenizer.bos_id):
        ids = [tokenizer.bos_id, *ids]
    return ids


# ---------------------------------------------------------------------------------------------
# records from files


def read_records(path: str | Path, fmt: str = "auto", split: str = "train") -> list[dict]:
    """Records (dicts) from a .jsonl/.json file, a .parquet file, or a datasets folder."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"data file {path} does not exist")
    if fmt == "auto":
        fmt = _detect_format(path)
    readers = {"jsonl": _read_jsonl, "parquet": _read_parquet,
               "datasets": lambda p: _read_datasets(p, split)}
    if fmt not in readers:
        raise ValueError(f"data.format={fmt!r}: use auto, jsonl, parquet or datasets")
    records = readers[fmt](path)
    if not records:
        raise ValueError(f"data file {path} holds no records: it needs one prompt per record")
    return records


def _detect_format(path: Path) -> str:
    if path.is_dir():
        return "datasets"
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return "jsonl"
    if suffix == ".parquet":
        return "parquet"
    raise ValueError(f"cannot tell the format of {path}: set data.format (jsonl/parquet/datasets)")


def _read_jsonl(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):  # a .json array of records
        return list(json.loads(text))
    records = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
    return records


def _read_parquet(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(
            f"reading {path} needs pyarrow, which is not installed: pip install pyarrow"
        ) from e
    return pq.read_table(path).to_pylist()


def _read_datasets(path: Path, split: str) -> list[dict]:
    try:
        import datasets
    except ImportError as e:
        raise ImportError(
            f"reading the dataset folder {path} needs the `datasets` package: pip install datasets"
        ) from e
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ValueError(f"{path} has splits {list(ds)}; data.split={split!r} is not one")
        ds = ds[split]
    return [dict(r) for r in ds]


def get_field(record: dict, dotted: str) -> Any:
    """record['a']['b'] for 'a.b'; a clear error naming the available keys if missing."""
    value: Any = record
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value:
            keys = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise KeyError(f"field {dotted!r} not found (at {key!r}; available: {keys})")
        value = value[key]
    return value


# ---------------------------------------------------------------------------------------------
# templated examples


@dataclass(frozen=True)
class Example:
    """One prompt, already templated (the text the model continues), and its reference answer."""

    prompt: str
    answer: str
    record: dict = field(default_factory=dict, compare=False)
    """The data record it came from (what a multi-turn environment is built from)."""


def format_prompt(
    question: str, template: str, tokenizer: Tokenizer | None = None, system_prompt: str = ""
) -> str:
    """Apply a template: 'chat' uses the tokenizer's chat template (HF tokenizers), anything
    else is a format string with a {prompt} slot, e.g. 'Q: {prompt}\\nA:'."""
    if template != "chat":
        return template.format(prompt=question)
    if not hasattr(tokenizer, "apply_chat_template"):
        raise ValueError("data.template='chat' needs an HF tokenizer with a chat template")
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": question})
    return tokenizer.apply_chat_template(messages)  # type: ignore[union-attr]


def build_examples(
    records: Sequence[dict],
    *,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    template: str = "{prompt}",
    tokenizer: Tokenizer | None = None,
    system_prompt: str = "",
    source: str = "records",
) -> list[Example]:
    """Templated `Example`s from raw records (answers converted to str). A null or blank prompt,
    or a null answer, is an error naming `source`, the record and the field: str() would turn
    it into the text 'None' and the run would train on that."""
    out = []
    for i, r in enumerate(records):
        question, answer = get_field(r, prompt_field), get_field(r, answer_field)
        if question is None or not str(question).strip():
            raise ValueError(f"{source}, record {i + 1}: data.prompt_field {prompt_field!r} is "
                             f"{'null' if question is None else repr(question)}; every prompt "
                             "needs text (fix or remove the record)")
        if answer is None:
            raise ValueError(f"{source}, record {i + 1}: data.answer_field {answer_field!r} is "
                             "null; give every record an answer (fix or remove the record)")
        prompt = format_prompt(str(question), template, tokenizer, system_prompt)
        out.append(Example(prompt=prompt, answer=str(answer), record=dict(r)))
    return out


# ---------------------------------------------------------------------------------------------
# the loader


class PromptLoader:
    """Endless batches of prompts for one DP rank: seeded shuffle per epoch, drop-last.

    Every rank walks the same global permutation; a global batch of `batch_size` prompts is split
    into `dp_size` contiguous slices and rank `dp_rank` gets its slice. After each `next()`,
    `epoch` is the data epoch of the batch just returned (the trainer compares it to trigger
    the per-epoch reference reset). `state_dict()` records the position, so a resumed run (even
    at another DP size, same global batch size) continues with exactly the next batch.
    """

    def __init__(
        self,
        dataset: Sequence[Example],
        batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if batch_size % dp_size:
            raise ValueError(f"data.batch_size={batch_size} must be divisible by dp_size={dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} outside [0, {dp_size})")
        if len(dataset) < batch_size:
            raise ValueError(f"{len(dataset)} prompts cannot fill one batch of {batch_size}")
        self.dataset, self.batch_size, self.seed, self.shuffle = dataset, batch_size, seed, shuffle
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.epoch, self.index = 0, 0  # next batch to serve: batch `index` of epoch `epoch`
        self._order: list[int] = []
        self._order_epoch = -1

    def __len__(self) -> int:
        """Batches per epoch."""
        return len(self.dataset) // self.batch_size

    def __iter__(self) -> Iterator[list[Example]]:
        return self

    def __next__(self) -> list[Example]:
        if self.index >= len(self):
            self.epoch, self.index = self.epoch + 1, 0
        order = self._epoch_order(self.epoch)
        per_rank = self.batch_size // self.dp_size
        start = self.index * self.batch_size + self.dp_rank * per_rank
        self.index += 1
        return [self.dataset[i] for i in order[start:start + per_rank]]

    def _epoch_order(self, epoch: int) -> list[int]:
        if self._order_epoch != epoch:
            self._order = list(range(len(self.dataset)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(self._order)
            self._order_epoch = epoch
        return self._order

    def state_dict(self) -> dict[str, int]:
        """Position and the settings that must match on resume."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed,
                "num_examples": len(self.dataset), "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved position; refuses if the data or batching changed."""
        for key in ("seed", "num_examples", "batch_size"):
            mine = self.state_dict()[key]
            if state[key] != mine:
                raise ValueError(f"loader state has {key}={state[key]} but this loader has {mine}")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def shard(examples: Sequence[Example], dp_rank: int, dp_size: int) -> list[Example]:
    """Strided shard for evaluation: every example lands on exactly one rank, none dropped."""
    return list(examples[dp_rank::dp_size])


# ---------------------------------------------------------------- prompts with images (VLM)
IMAGE_FIELD = "images"
"""The record field naming a prompt's images (paths relative to the data file; the loader makes
them absolute)."""
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
"""Qwen's chat-template placeholder of one image: a record's prompt text carries one per image
(in order); `image_prompt` expands its single image-pad token into the image's token count."""


def load_images(paths: Sequence[str | Path], base: str | Path = ".") -> list:
    """The records' images (PIL, RGB), paths relative to `base`; a file that does not open as
    an image is refused, named."""
    from PIL import Image, UnidentifiedImageError

    out = []
    for p in paths:
        path = Path(base) / p
        try:
            with Image.open(path) as img:
                out.append(img.convert("RGB"))
        except (OSError, UnidentifiedImageError) as e:
            raise ValueError(f"image {str(path)!r} does not open as an image ({e}); fix or "
                             "drop the record's `images` entry") from e
    return out


def load_image_processor(folder: str | Path):
    """The model folder's image processor (`preprocessor_config.json`): transformers' Qwen2-VL
    image processor in its torchvision implementation, the one vLLM's processor builds from
    the same folder. Its PIL twin resizes differently (the normalised pixels of an image it
    shrinks differ): the trainer would score other pixels than vLLM sampled from, and the
    log-prob gap of tests/test_vlm_rollout.py fails."""
    if not (Path(folder) / "preprocessor_config.json").is_file():
        raise ValueError(f"{folder} has no preprocessor_config.json: a vision-language model's "
                         "folder needs its image processor (the export writes one)")
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    return Qwen2VLImageProcessor.from_pretrained(str(folder))


def image_prompt(prompt_ids: Sequence[int], images: Sequence, processor, *,
                 image_token_id: int, merge_size: int):
    """A prompt with images -> (ids, pixel_values [P, D], image_grid_thw [n, 3]).

    `prompt_ids` holds one image-pad token per image (the placeholder, in order); each becomes
    t*h*w / merge_size^2 pads, the count the model's vision tower gives for the image's patch
    grid after the processor's resizing (what vLLM's processor also does). A prompt whose
    placeholders are more or fewer than its images is refused."""
    slots = [i for i, t in enumerate(prompt_ids) if t == image_token_id]
    if len(slots) != len(images):
        raise ValueError(f"the prompt holds {len(slots)} image placeholders "
                         f"({IMAGE_PLACEHOLDER!r}) but the record has {len(images)} images: "
                         "one placeholder per image")
    if not images:
        return list(prompt_ids), None, None
    out = processor(images=list(images), return_tensors="pt")
    grid = out["image_grid_thw"]
    ids: list[int] = []
    start = 0
    for slot, (t, h, w) in zip(slots, grid.tolist()):
        ids += list(prompt_ids[start:slot]) + [image_token_id] * (t * h * w // merge_size ** 2)
        start = slot + 1
    ids += list(prompt_ids[start:])
    return ids, out["pixel_values"], grid
