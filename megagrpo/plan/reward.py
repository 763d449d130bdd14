"""The planner's reward lines: a `reward_model` source holds a second model on each rollout
engine's leader rank (colocated, beside vLLM). Its parameters are counted from the checkpoint's
safetensors headers (no weights are read), its activations estimated for one scoring batch.
Stdlib only: `megagrpo plan` starts in seconds."""
from __future__ import annotations

import json
import struct
from pathlib import Path

from megagrpo.config.train import TrainConfig
from megagrpo.plan.memory import DTYPE_BYTES, GIB


def parameter_count(path: str) -> tuple[int, str]:
    """(parameters, where the count came from) of an HF folder, from its safetensors headers
    (0 when it holds none)."""
    folder = Path(path).expanduser()
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    total = 0
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                count = 1
                for d in meta["shape"]:
                    count *= d
                total += count
    return total, f"{len(files)} safetensors file(s)" if files else "no safetensors there"


def reward_models(cfg: TrainConfig) -> list[tuple[str, dict]]:
    """(the options' dotted name, options) of each reward_model source of the recipe."""
    r = cfg.reward
    if not r.sources:
        return [("reward.options", r.options)] if r.source == "reward_model" else []
    return [(f"reward.sources[{i}].options", s.options) for i, s in enumerate(r.sources)
            if s.source == "reward_model"]


def reward_model_bytes(cfg: TrainConfig, options: dict) -> tuple[int, int, int]:
    """(parameters, weight bytes, activation bytes of one batch) of a reward_model source.
    Activations (no gradients): per token the hidden state, the MLP's two intermediate
    tensors and one layer's attention scores over the sequence, batch_size x T tokens at once,
    T = options.max_length or rollout.max_model_len."""
    n, _ = parameter_count(str(options.get("path", "")))
    width = DTYPE_BYTES.get(str(options.get("dtype", "float32")), 4)
    config = Path(str(options.get("path", ""))).expanduser() / "config.json"
    hf = json.loads(config.read_text()) if config.is_file() else {}
    tokens = int(options.get("max_length") or cfg.rollout.max_model_len)
    per_token = (hf.get("hidden_size", 0) + 2 * hf.get("intermediate_size", 0)
                 + hf.get("num_attention_heads", 0) * tokens)
    act = int(options.get("batch_size", 8)) * tokens * per_token * width
    return n, n * width, act


def format_reward_models(cfg: TrainConfig) -> tuple[str, int]:
    """The report's lines for the recipe's reward models and their bytes per engine leader."""
    lines, total = [], 0
    for where, options in reward_models(cfg):
        n, weights, act = reward_model_bytes(cfg, options)
        if not n:
            lines.append(f"  reward model ({where}.path={options.get('path', '')!r}): no "
                         "safetensors there, its memory is not counted")
            continue
        total += weights + act
        lines.append(f"  reward model ({where}.path): {n / 1e6:.1f}M params, weights "
                     f"{weights / GIB:.2f} GiB ({options.get('dtype', 'float32')}) + activations "
                     f"{act / GIB:.2f} GiB (batch_size x T tokens) on each engine's leader rank, "
                     "beside vLLM")
    return "\n".join(lines), total
