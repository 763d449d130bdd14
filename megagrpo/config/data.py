"""Prompt data, tokenizer, the built-in arithmetic task, and reward functions."""
from __future__ import annotations

from dataclasses import dataclass, field

from megagrpo.config.section import Section

DATA_FORMATS = ("auto", "jsonl", "parquet", "datasets")
TASKS = ("arithmetic", "file")
REWARD_ISOLATION = ("thread", "process", "none")
OVERLONG_PROMPTS = ("error", "drop")


@dataclass(kw_only=True)
class DataConfig(Section):
    """Where prompts come from, how they are templated and tokenised, and how they are batched."""

    task: str = "arithmetic"
    """'arithmetic' (built-in synthetic task, no downloads) or 'file' (read `path`)."""
    path: str = ""
    """task=file: a .jsonl / .parquet file, or a `datasets.save_to_disk` folder."""
    eval_path: str = ""
    """task=file: optional held-out prompts in the same format (empty = no eval set)."""
    format: str = "auto"
    """File format: auto (by suffix / folder), jsonl, parquet or datasets."""
    split: str = "train"
    """Split to read when `path` holds a datasets DatasetDict."""
    prompt_field: str = "prompt"
    """Record field holding the question (dotted paths reach nested fields: 'q.text')."""
    answer_field: str = "answer"
    """Record field holding the reference answer (converted to str)."""
    template: str = "{prompt}"
    """'chat' (the tokenizer's chat template) or a format string with a {prompt} slot."""
    system_prompt: str = ""
    """template=chat: optional system message."""
    tokenizer: str = ""
    """A sentencepiece .model file or an HF tokenizer folder; empty = the task's built-in one."""
    batch_size: int = 16
    """Prompts per step over all DP ranks (each prompt yields group_size completions)."""
    seed: int = 0
    """Seed of the per-epoch shuffle."""
    shuffle: bool = True
    """Reshuffle the prompts every data epoch."""
    overlong_prompts: str = "error"
    """Prompts whose tokens + rollout.max_tokens exceed rollout.max_model_len: 'error' or 'drop'."""

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field and what would be valid."""
        if self.task not in TASKS:
            raise ValueError(f"data.task={self.task!r}: use one of {TASKS}")
        if self.format not in DATA_FORMATS:
            raise ValueError(f"data.format={self.format!r}: use one of {DATA_FORMATS}")
        if self.task == "file" and not self.path:
            raise ValueError("data.path is empty: task=file needs a .jsonl/.parquet/dataset path")
        if self.template != "chat" and "{prompt}" not in self.template:
            raise ValueError(
                f"data.template={self.template!r}: use 'chat' or a format string with {{prompt}}"
            )
        if self.batch_size < 1:
            raise ValueError(f"data.batch_size={self.batch_size}: need >= 1")
        if self.system_prompt and self.template != "chat":
            raise ValueError(f"data.system_prompt is set but data.template={self.template!r}: a "
                             "system message needs template=chat (or put the text in template)")
        if self.overlong_prompts not in OVERLONG_PROMPTS:
            raise ValueError(f"data.overlong_prompts={self.overlong_prompts!r}: use one of "
                             f"{OVERLONG_PROMPTS}")
        for name in ("prompt_field", "answer_field"):
            if not getattr(self, name):
                raise ValueError(f"data.{name} is empty: name the record field to read")


@dataclass(kw_only=True)
class ArithmeticConfig(Section):
    """The built-in synthetic task: 'a+b=' prompts, the completion is the number and EOS."""

    digits: int = 2
    """Operands are uniform in [0, 10**digits)."""
    operators: str = "+"
    """Operators to draw from, any of '+', '-', '*'."""
    allow_negative: bool = False
    """Subtraction may go below zero (else operands are ordered so a >= b)."""
    eval_fraction: float = 0.05
    """Share of all problems reserved for the held-out split (chosen by a stable hash)."""
    num_eval: int = 200
    """Held-out problems used for evaluation."""
    num_train: int = 20000
    """Training prompts drawn (with replacement) from the non-held-out problems."""
    seed: int = 0
    """Seed of the train/eval samples."""
    tokenizer_dir: str = "~/.cache/megagrpo/arithmetic"
    """Where the task's sentencepiece model is trained on first use and cached."""
    reverse_answer: bool = False
    """Write answers least-significant digit first ('12+79=' -> '19', i.e. 91 reversed): carries
    then flow left to right, which a tiny model learns far faster (Lee et al., 2023)."""
    tools: bool = False
    """The tool task (megagrpo.tasks.arithmetic_tools): the model calls a calculator,
    `<calc>a*b</calc>`, the environment answers `<result>v</result>`, the model writes v. Needs
    agent.environment=megagrpo.tasks.arithmetic_tools:CalculatorEnvironment and
    model.vocab_size >= 23 (the tags are pieces of the task's tokenizer)."""

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field and what would be valid."""
        if not 1 <= self.digits <= 6:
            raise ValueError(f"arithmetic.digits={self.digits}: use 1..6")
        if not self.operators or set(self.operators) - set("+-*"):
            raise ValueError(f"arithmetic.operators={self.operators!r}: use characters of '+-*'")
        if self.tools and self.reverse_answer:
            raise ValueError("arithmetic.tools=true with arithmetic.reverse_answer=true: the "
                             "answer is copied from the calculator's result, in its order; "
                             "set reverse_answer=false")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"arithmetic.eval_fraction={self.eval_fraction}: need 0 < f < 1")
        if self.num_eval < 1 or self.num_train < 1:
            raise ValueError(
                f"arithmetic.num_eval={self.num_eval}, arithmetic.num_train={self.num_train}: "
                "need >= 1"
            )
        space = len(set(self.operators)) * 10 ** (2 * self.digits)
        if self.num_eval > 0.5 * self.eval_fraction * space:
            raise ValueError(
                f"arithmetic.num_eval={self.num_eval} is too many for {space} problems with "
                f"eval_fraction={self.eval_fraction}: lower it or raise digits/eval_fraction"
            )


@dataclass(kw_only=True)
class RewardTermConfig(Section):
    """One reward function and its weight in the sum."""

    name: str
    """Built-in (math, exact_match, format, arithmetic) or an import string 'module:function'."""
    weight: float = 1.0
    """Multiplier of this term in the summed reward."""
    kwargs: dict = field(default_factory=dict)
    """Extra keyword arguments for the function (e.g. format: {pattern: '...'})."""
    correctness: bool = False
    """Eval accuracy counts this term's unweighted value >= 1 as correct (none marked: 1st term)."""

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field and what would be valid."""
        if not self.name:
            raise ValueError("reward.terms[].name is empty: a built-in name or 'module:function'")


@dataclass(kw_only=True)
class RewardSourceConfig(Section):
    """One reward source of a weighted combination (`reward.sources`)."""

    source: str
    """Its kind: 'rules' (reward.terms), 'remote', 'reward_model', 'judge', another registered
    name or 'module:Class' (as reward.source)."""
    weight: float = 1.0
    """Multiplier of this source's reward in the summed reward."""
    options: dict = field(default_factory=dict)
    """Its own keyword options (as reward.options for a single source)."""
    label: str = ""
    """Name in the metrics (`reward/<label>`) and per-term values; empty = the source's name
    (suffixed '#k' from its second occurrence on)."""
    correctness: bool = False
    """Held-out accuracy is this source's verdict (none marked: the first source's)."""

    def validate(self, where: str) -> None:
        """Raise ValueError naming the first invalid field (`where` = reward.sources[i])."""
        if not self.source:
            raise ValueError(f"{where}.source is empty: use 'rules', 'remote', 'reward_model', "
                             "'judge', a registered name or 'module:Class'")
        if self.source == "rules" and self.options:
            raise ValueError(f"{where}.options={self.options} with {where}.source=rules: the "
                             "rules source reads reward.terms; drop these options")


@dataclass(kw_only=True)
class RewardConfig(Section):
    """Rewards: a source scoring whole samples (default 'rules': a weighted sum of rule terms,
    each call under a deadline)."""

    source: str = "rules"
    """Reward source (megagrpo.reward, docs/rewards.md): 'rules' (the terms below), 'remote' (an
    HTTP endpoint), 'reward_model' (an HF sequence-classification model), 'judge' (the rollout
    engine as an LLM judge), another registered name (a module of megagrpo/reward/ registering
    it) or 'module:Class'. Ignored when `sources` is set."""
    options: dict = field(default_factory=dict)
    """Keyword options of a source other than 'rules' (it reads them from this section)."""
    sources: list[RewardSourceConfig] = field(default_factory=list)
    """Several sources in one recipe, their rewards summed with weights:
    [{source, weight, options, label, correctness}, ...]; empty = the single `source`."""
    score_chunks: int = 1
    """Sample each engine's share of a batch in this many consecutive slices, each scored as
    soon as it is sampled: a source answering with a future (remote, reward_model) scores the
    first groups while the later ones sample (smaller vLLM batches; 1 = one call)."""
    terms: list[RewardTermConfig] = field(
        default_factory=lambda: [RewardTermConfig(name="arithmetic")]
    )
    """Reward terms (dicts from YAML are converted): [{name, weight, kwargs}, ...]."""
    timeout_s: float = 2.0
    """Deadline per call (one completion, one term); a timeout scores 0 and is counted."""
    isolation: str = "thread"
    """'thread' (a thread per call), 'process' (killable worker pool) or 'none' (no deadline)."""
    num_workers: int = 2
    """isolation=process: worker processes (calls run this many at a time)."""
    max_stuck_threads: int = 8
    """isolation=thread: timed-out calls left running before the run switches to process."""

    def __post_init__(self) -> None:
        self.terms = [RewardTermConfig(**t) if isinstance(t, dict) else t for t in self.terms]
        self.sources = [RewardSourceConfig(**s) if isinstance(s, dict) else s
                        for s in self.sources]

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field and what would be valid."""
        if not self.source:
            raise ValueError("reward.source is empty: use 'rules' (the terms) or a registered "
                             "source name")
        if self.source == "rules" and self.options:
            raise ValueError(f"reward.options={self.options} with reward.source=rules: the rules "
                             "source reads reward.terms (put keyword arguments in a term's "
                             "kwargs) or name the source these options are for")
        if self.sources and (self.source != "rules" or self.options):
            raise ValueError(f"reward.sources is set together with reward.source="
                             f"{self.source!r} / reward.options: name every source in "
                             "reward.sources (with its options there) and leave reward.source "
                             "and reward.options unset")
        for i, s in enumerate(self.sources):
            s.validate(f"reward.sources[{i}]")
        marked = [i for i, s in enumerate(self.sources) if s.correctness]
        if len(marked) > 1:
            raise ValueError(f"reward.sources[{marked[1]}].correctness and reward.sources"
                             f"[{marked[0]}].correctness are both true: mark at most one source "
                             "(held-out accuracy is measured on it)")
        if self.score_chunks < 1:
            raise ValueError(f"reward.score_chunks={self.score_chunks}: need >= 1 (1 = sample "
                             "a batch in one call)")
        if not self.terms:
            raise ValueError("reward.terms is empty: give at least one {name, weight, kwargs}")
        for term in self.terms:
            term.validate()
        marked = [t.name for t in self.terms if t.correctness]
        if len(marked) > 1:
            raise ValueError(f"reward.terms[].correctness is true for {marked}: mark at most one "
                             "term (held-out accuracy is measured on it)")
        if self.timeout_s <= 0:
            raise ValueError(f"reward.timeout_s={self.timeout_s}: need > 0")
        if self.num_workers < 1:
            raise ValueError(f"reward.num_workers={self.num_workers}: need >= 1")
        if self.max_stuck_threads < 1:
            raise ValueError(f"reward.max_stuck_threads={self.max_stuck_threads}: need >= 1 "
                             "(abandoned calls kept in threads before switching to processes)")
        if self.isolation not in REWARD_ISOLATION:
            raise ValueError(f"reward.isolation={self.isolation!r}: use one of {REWARD_ISOLATION}")
