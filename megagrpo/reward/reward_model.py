"""The `reward_model` source: an HF sequence-classification reward model (the layout of
Skywork-Reward / Qwen reward-model checkpoints: `*ForSequenceClassification`, a `score` head on
the base model) scores each (prompt, completion), batched, through transformers.

Each sample is rendered with the reward model's own tokenizer: `template: chat` applies its chat
template to [system (optional), user = the question, assistant = the completion] (the question
is the data record's `prompt_field`, or with `prompt_field: ''` the prompt text the policy
continued); any other template is a format string with {prompt} and {completion}. Batches of
`batch_size` are padded on the right and each sample's score is the head's output at its last
real token (what transformers computes for one unpadded sample). A multi-turn trajectory is
scored on its last assistant turn (`Sample.completion`).

The model runs in this process, on the rollout engine's leader rank (colocated: one copy per
engine, loaded by the first batch it scores, so other ranks hold none; its memory is a line of
`megagrpo plan`), in a thread of its own: `score` returns a
future, so scoring a batch overlaps what the rank does next (with rollout.max_staleness >= 1,
sampling the next batch). vLLM's pooling API is not used here: the CPU build serves no
classification heads we could check against (docs/rewards.md).
"""
from __future__ import annotations

import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from megagrpo.config.data import RewardConfig
from megagrpo.reward.options import parse_options
from megagrpo.reward.sample import Sample
from megagrpo.reward.source import Scores, register_source

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICES = ("auto", "cpu", "cuda")


@dataclass(kw_only=True)
class RewardModelOptions:
    """`reward.options` of the `reward_model` source."""

    path: str
    """HF folder of the reward model (config.json, weights, tokenizer)."""
    batch_size: int = 8
    """Samples per forward pass."""
    template: str = "chat"
    """'chat' (the reward model's chat template) or a format string with {prompt} and
    {completion}."""
    prompt_field: str = "prompt"
    """The data record's field holding the question; '' = the prompt text the policy saw."""
    system_prompt: str = ""
    """template=chat: an optional system message."""
    max_length: int = 0
    """Tokens kept per sample (the last ones; counted in reward_model_truncated); 0 = all."""
    label: int = 0
    """Which output of the head is the reward (a head of num_labels outputs)."""
    dtype: str = "float32"
    """The model's dtype: float32, bfloat16 or float16."""
    device: str = "auto"
    """'auto' (this rank's GPU when there is one, else CPU), 'cpu' or 'cuda'."""

    def check(self, where: str) -> None:
        folder = Path(self.path).expanduser()
        if not self.path or not (folder / "config.json").is_file():
            raise ValueError(f"{where}.path={self.path!r}: no config.json there; give the HF "
                             "folder of a sequence-classification reward model")
        arch = json.loads((folder / "config.json").read_text()).get("architectures") or ["?"]
        if not any(a.endswith("ForSequenceClassification") for a in arch):
            raise ValueError(f"{where}.path={self.path!r} holds {arch[0]}: the reward_model "
                             "source needs a *ForSequenceClassification checkpoint (a causal LM "
                             "can judge instead: a generative judge)")
        if self.template != "chat" and ("{completion}" not in self.template
                                        or "{prompt}" not in self.template):
            raise ValueError(f"{where}.template={self.template!r}: use 'chat' or a format "
                             "string with {prompt} and {completion}")
        if self.system_prompt and self.template != "chat":
            raise ValueError(f"{where}.system_prompt is set but {where}.template is not 'chat'")
        for name, low in (("batch_size", 1), ("max_length", 0), ("label", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"{where}.{name}={getattr(self, name)}: need >= {low}")
        if self.dtype not in DTYPES:
            raise ValueError(f"{where}.dtype={self.dtype!r}: use one of {sorted(DTYPES)}")
        if self.device not in DEVICES:
            raise ValueError(f"{where}.device={self.device!r}: use one of {DEVICES}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"{where}.device=cuda but this machine has no CUDA device; use "
                             "auto or cpu")


@register_source("reward_model")
class RewardModelSource:
    """Scores samples with an HF sequence-classification model (module docstring)."""

    @staticmethod
    def check(cfg: RewardConfig) -> None:
        parse_options(RewardModelOptions, cfg.options)

    def __init__(self, cfg: RewardConfig) -> None:
        from transformers import AutoTokenizer

        self.opts = o = parse_options(RewardModelOptions, cfg.options)
        device = ("cuda" if torch.cuda.is_available() else "cpu") if o.device == "auto" \
            else o.device
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(Path(o.path).expanduser())
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        self.model: torch.nn.Module | None = None
        """Loaded by the first `score` (only an engine's leader rank scores: no other rank
        holds the weights)."""
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="megagrpo-reward-model")

    def _load(self) -> torch.nn.Module:
        from transformers import AutoModelForSequenceClassification

        o = self.opts
        model = AutoModelForSequenceClassification.from_pretrained(
            Path(o.path).expanduser(), dtype=DTYPES[o.dtype]).to(self.device).eval()
        if not hasattr(model, "score"):
            raise ValueError(f"reward.options.path={o.path!r}: {type(model).__name__} has no "
                             "`score` head (transformers' *ForSequenceClassification layout)")
        if o.label >= model.score.out_features:
            raise ValueError(f"reward.options.label={o.label}: the head has "
                             f"{model.score.out_features} output(s)")
        return model

    def score(self, samples: list[Sample]) -> Future[Scores]:
        """A future of the samples' scores (computed in this source's thread)."""
        return self.pool.submit(self.score_now, samples)

    def score_now(self, samples: list[Sample]) -> Scores:
        """The samples' scores, computed here (the model loaded on first use)."""
        start = time.perf_counter()
        if self.model is None:
            self.model = self._load()
        ids = [self.encode(s) for s in samples]
        keep = self.opts.max_length
        truncated = sum(keep > 0 and len(x) > keep for x in ids)
        ids = [x[-keep:] if keep else x for x in ids]
        out = torch.cat([self.forward(ids[i:i + self.opts.batch_size])
                         for i in range(0, len(ids), self.opts.batch_size)]) if ids \
            else torch.zeros(0)
        return Scores(rewards=out, per_term={"reward_model": out},
                      metrics={"reward/reward_model": float(out.mean()) if len(out) else 0.0,
                               "reward_model_truncated": float(truncated),
                               "reward_model_time_s": time.perf_counter() - start})

    def encode(self, s: Sample) -> list[int]:
        """The sample as the reward model's token ids."""
        o, tok = self.opts, self.tokenizer
        if o.prompt_field:
            if o.prompt_field not in s.record:
                raise ValueError(f"reward.options.prompt_field={o.prompt_field!r}: a data record "
                                 f"has no such field (it has {sorted(s.record)}); name the "
                                 "question's field, or '' for the prompt text the policy saw")
            question = str(s.record[o.prompt_field])
        else:
            question = s.prompt
        if o.template != "chat":
            text = o.template.format(prompt=question, completion=s.completion)
            return list(tok(text)["input_ids"])
        messages = ([{"role": "system", "content": o.system_prompt}] if o.system_prompt else [])
        messages += [{"role": "user", "content": question},
                     {"role": "assistant", "content": s.completion}]
        text = tok.apply_chat_template(messages, tokenize=False)
        return list(tok(text, add_special_tokens=False)["input_ids"])

    @torch.no_grad()
    def forward(self, batch: list[list[int]]) -> torch.Tensor:
        """[b] float32 rewards: right-padded batch, the head at each sample's last token."""
        lengths = torch.tensor([len(x) for x in batch])
        width = int(lengths.max())
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        for i, x in enumerate(batch):
            ids[i, :len(x)] = torch.tensor(x)
        mask = torch.arange(width)[None, :] < lengths[:, None]
        assert self.model is not None  # score_now loads it
        base = getattr(self.model, self.model.base_model_prefix)
        hidden = base(input_ids=ids.to(self.device),
                      attention_mask=mask.long().to(self.device)).last_hidden_state
        last = hidden[torch.arange(len(batch)), (lengths - 1).to(self.device)]
        return self.model.score(last)[:, self.opts.label].float().cpu()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

