"""The whole run's configuration: one section per concern, loaded from a YAML recipe with
`key.sub=value` overrides, validated before any process group or model exists."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from megagrpo.config.algo import AlgoConfig
from megagrpo.config.data import ArithmeticConfig, DataConfig, RewardConfig
from megagrpo.config.layout import check_rollout_layout
from megagrpo.config.model import ModelConfig, ParallelConfig
from megagrpo.config.optim import OptimConfig
from megagrpo.config.rollout import RolloutConfig
from megagrpo.config.schema import build_dataclass, check_instance


@dataclass(kw_only=True)
class ReferenceConfig:
    """The KL reference and its iterative re-initialisation (DeepSeekMath Alg. 1, outer loop)."""

    sync_every_steps: int = 0
    """Re-initialise the reference from the policy every N optimizer steps (0 = never)."""
    sync_every_epoch: bool = False
    """Re-initialise at the start of every data epoch."""
    sync_kl_threshold: float = 0.0
    """Re-initialise when the step's mean KL to the reference exceeds this (0 = off)."""
    alpha: float = 1.0
    """Mixing: ref <- alpha * policy + (1 - alpha) * ref; 1.0 is DeepSeekMath's reset."""
    offload: bool = False
    """Keep the reference in CPU memory between scoring passes (GPU only; no-op on CPU)."""

    def validate(self, beta: float) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"reference.alpha={self.alpha}: need 0 < alpha <= 1")
        if self.sync_every_steps < 0 or self.sync_kl_threshold < 0:
            raise ValueError("reference.sync_every_steps and reference.sync_kl_threshold must be "
                             ">= 0 (0 disables)")
        scheduled = self.sync_every_steps or self.sync_every_epoch or self.sync_kl_threshold
        if beta == 0.0 and scheduled:
            raise ValueError(
                "reference.sync_* is set but algo.beta=0 builds no reference model: set "
                "algo.beta > 0 or drop the reference schedule")


@dataclass(kw_only=True)
class RunConfig:
    """Loop length, batching inside a step, checkpoints, evaluation and logging."""

    steps: int = 20
    """GRPO steps (one rollout batch each)."""
    seed: int = 1234
    """Seed of model init, sampling and data order."""
    out_dir: str = "runs/default"
    """Metrics, checkpoints, summary and plots go here."""
    init: str = "random"
    """'random', an HF checkpoint directory, or a megagrpo checkpoint directory."""
    micro_batch_size: int = 16
    """Sequences per forward/backward micro-batch."""
    micro_batch_tokens: int | None = None
    """Token budget of a micro-batch (rows x its longest row, at most micro_batch_size rows) of
    length-sorted sequences; None: 1024 at parallel.pp = 1, off under pipeline parallelism;
    0: off."""
    trim_micro_batches: bool = True
    """Sort sequences by length and cut each micro-batch to its longest one (pp = 1 only:
    pipeline stages exchange fixed shapes)."""
    skip_zero_advantage: bool = True
    """Without a KL term in the loss (beta = 0 or algo.kl_in_reward), skip the forward and
    backward of sequences whose advantage is 0: they add exactly nothing to the gradient
    (entropy and clip metrics then cover the trained sequences)."""
    logits_at_loss_positions: bool = True
    """Run the output layer and the vocab pass only at completion tokens (not at prompt or
    padding positions)."""
    reuse_equal_reference: bool = True
    """When the reference's weights are bitwise the policy's at scoring time (a reset with
    reference.alpha = 1 and no update since) and the policy's old log-probs are scored anyway,
    take the reference log-probs from them instead of running the reference's forward pass."""
    pack_sequences: bool | None = None
    """Lay each micro-batch's sequences end to end (megatron's `thd` layout) so the dense layers
    process no padding; the micro-batch is then cut by its summed tokens
    (run.micro_batch_tokens), not by micro_batch_size. None: on where it can run (parallel.pp =
    1, torch SDPA attention, the levers above on); true where it cannot is an error."""
    num_minibatches: int = 1
    """Optimizer steps per pass over a rollout batch (PPO-style minibatches)."""
    async_rollout: bool = False
    """One-step off-policy: the rollout of step t+1 overlaps the update of step t."""
    kernel_impl: str = "auto"
    """Fused-kernel path: 'auto' (Triton on CUDA, torch otherwise), 'triton' or 'torch'."""
    inplace_backward: bool = True
    """Let the loss kernel write the logits gradient into the logits buffer."""
    checkpoint_every: int = 0
    """Save every N steps (0 = only at the end when checkpoint_at_end)."""
    checkpoint_at_end: bool = False
    """Save once more after the last step."""
    keep_last: int = 2
    """Checkpoints kept on disk."""
    resume: bool = True
    """Continue from the newest intact checkpoint in out_dir/checkpoints when one exists."""
    overwrite: bool = False
    """Delete an earlier run in out_dir and start over (else it is resumed, or refused)."""
    eval_every: int = 0
    """Greedy held-out accuracy every N steps (0 = only before and after)."""
    eval_max_tokens: int = 16
    """Generation length for evaluation."""
    sft_steps: int = 0
    """Supervised cold-start steps before GRPO (built-in task only)."""
    sft_batch_size: int = 64
    """Sequences per cold-start step (global)."""
    sft_lr: float = 1e-3
    """Cold-start learning rate."""
    tensorboard: bool = True
    """Write TensorBoard scalars when tensorboard is installed."""
    wandb: bool = False
    """Log to Weights & Biases when wandb is installed (offline unless configured)."""
    progress: bool = True
    """One-line progress per step on the console."""
    max_bad_steps: int = 3
    """Stop with a checkpoint after this many steps in a row skipped for bad values; 0 = never."""
    stall_timeout_s: float = 1800.0
    """One phase (setup, rollout, update, eval, ...) running longer stops the run; 0 = off."""
    heartbeat_timeout_s: float = 120.0
    """A rank whose heartbeat stops this long (frozen) stops the run, naming it; 0 = off."""
    heartbeat_interval_s: float = 5.0
    """Period of each rank's heartbeat and of the stall checks."""

    def validate(self) -> None:
        if self.steps < 0:
            raise ValueError(f"run.steps={self.steps} must be >= 0")
        if self.kernel_impl not in ("auto", "triton", "torch"):
            raise ValueError(f"run.kernel_impl={self.kernel_impl!r}: use auto, triton or torch")
        for f in ("micro_batch_size", "num_minibatches", "keep_last", "sft_batch_size",
                  "eval_max_tokens"):
            if getattr(self, f) < 1:
                raise ValueError(f"run.{f}={getattr(self, f)} must be >= 1")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 0:
            raise ValueError(f"run.micro_batch_tokens={self.micro_batch_tokens} must be >= 0 "
                             "(0 = off, unset = automatic)")
        for f in ("checkpoint_every", "eval_every", "sft_steps", "max_bad_steps"):
            if getattr(self, f) < 0:
                raise ValueError(f"run.{f}={getattr(self, f)} must be >= 0 (0 = off)")
        if self.sft_lr <= 0:
            raise ValueError(f"run.sft_lr={self.sft_lr} must be > 0")
        if not self.out_dir.strip():
            raise ValueError("run.out_dir is empty: give a folder for metrics and checkpoints")
        self._validate_watchdog()

    def _validate_watchdog(self) -> None:
        interval = self.heartbeat_interval_s
        if not 0 < interval < float("inf"):
            raise ValueError(f"run.heartbeat_interval_s={interval}: need a finite number > 0")
        for f, beats in (("heartbeat_timeout_s", 3), ("stall_timeout_s", 2)):
            v = getattr(self, f)
            if not (v == 0 or beats * interval <= v < float("inf")):
                raise ValueError(
                    f"run.{f}={v}: need 0 (off) or a finite number >= {beats} x "
                    f"run.heartbeat_interval_s = {beats * interval:g} (a check needs a few beats)")


@dataclass(kw_only=True)
class TrainConfig:
    """Everything a run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Architecture (ignored when run.init is a checkpoint: read from there)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """TP/PP layout of policy and reference."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and LR schedule."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """vLLM engine and sampling."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """GRPO variant."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts and tokenizer."""
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    """The built-in task (data.task=arithmetic)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward terms."""
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    """Reference model and its reset schedule."""
    run: RunConfig = field(default_factory=RunConfig)
    """Loop, checkpoints, logging."""

    def validate(self, world_size: int | None = None) -> None:
        """Checks every section and the cross-section rules, before anything starts."""
        check_instance(self)  # types first: a config built in Python skipped load_config's
        self.model.validate()
        self.parallel.validate(self.model, world_size)
        self.optim.validate()
        self.rollout.validate()
        self.algo.validate()
        self.data.validate()
        if self.data.task == "arithmetic":
            self.arithmetic.validate()
        self.reward.validate()
        self.reference.validate(self.algo.beta)
        self.run.validate()
        if world_size is not None:
            dp = world_size // (self.parallel.tp * self.parallel.pp)
            if self.data.batch_size % dp:
                raise ValueError(f"data.batch_size={self.data.batch_size} must be divisible by "
                                 f"the data-parallel size {dp}")
        self._validate_sampling()
        if self.run.micro_batch_tokens and self.parallel.pp > 1:
            raise ValueError(f"run.micro_batch_tokens={self.run.micro_batch_tokens} needs "
                             f"parallel.pp=1 (got {self.parallel.pp}: pipeline stages exchange "
                             "fixed micro-batch shapes); set run.micro_batch_tokens=0")
        if self.run.pack_sequences and (why := packing_blocker(self.run, self.parallel)):
            raise ValueError(f"run.pack_sequences=true needs {why}; set "
                             "run.pack_sequences=false (or leave it unset)")
        if self.run.sft_steps and self.data.task != "arithmetic":
            raise ValueError(f"run.sft_steps={self.run.sft_steps}: the supervised cold start "
                             "exists for data.task=arithmetic only; set run.sft_steps=0")
        if self.run.async_rollout and self.rollout.tensor_parallel_size > 1:
            # the side thread samples from each rank's own generator: an engine's ranks diverge
            raise ValueError("run.async_rollout needs rollout.tensor_parallel_size=1 (engines of "
                             "k > 1 ranks must sample identical tokens on every rank)")
        check_rollout_layout(self.rollout.tensor_parallel_size, self.parallel, self.model,
                             world_size)


    def _validate_sampling(self) -> None:
        """Sampling settings that are valid for the engine alone but wrong for GRPO."""
        temperature, mode = self.rollout.temperature, self.rollout.logprobs_mode
        if temperature == 0:
            raise ValueError(
                "rollout.temperature=0 is greedy decoding: the algo.group_size completions of a "
                "prompt would be identical (zero advantages) and the loss divides logits by the "
                "temperature; GRPO needs sampling: use rollout.temperature > 0 (e.g. 1.0)")
        if mode == "raw_logprobs" and temperature != 1.0:
            raise ValueError(
                f"rollout.logprobs_mode=raw_logprobs with rollout.temperature={temperature}: "
                "vLLM's raw log-probs are taken before temperature scaling, the trainer's after, "
                "so the vLLM-vs-trainer ratios would be wrong; use "
                "logprobs_mode=processed_logprobs, or temperature=1.0")


def _set_dotted(tree: dict, dotted: str, value) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {dotted!r}: {k!r} is not a section")
    node[keys[-1]] = value


def packing_blocker(run: RunConfig, parallel: ParallelConfig) -> str | None:
    """What the config lacks for packed micro-batches (None: nothing; whether Transformer
    Engine's spec replaces the attention is known only at start-up: model.sequence_packing)."""
    if parallel.pp > 1:
        return f"parallel.pp=1 (got {parallel.pp}: stages exchange fixed shapes)"
    if parallel.attention_impl == "megatron":
        return ("parallel.attention_impl sdpa or auto (megatron's DotProductAttention has no "
                "packed path)")
    if not run.logits_at_loss_positions or not run.trim_micro_batches:
        return "run.logits_at_loss_positions=true and run.trim_micro_batches=true"
    if run.micro_batch_tokens == 0:
        return "a token budget (run.micro_batch_tokens unset or > 0)"
    return None


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()
                ) -> TrainConfig:
    """A recipe (YAML; `base: other.yaml` inherits, relative to the file) plus `a.b=value`
    overrides (values parsed as YAML). Every value is type-checked against its field (see
    `megagrpo.config.schema`); call `validate()` for the range and cross-section rules."""
    tree = _read_recipe(Path(path)) if path else {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"override {item!r}: use key.sub=value")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ValueError(f"override {item!r}: the value is not valid YAML "
                             f"({getattr(e, 'problem', None) or e})") from None
        _set_dotted(tree, key.strip(), value)
    return build_dataclass(TrainConfig, tree, "")


def _read_recipe(path: Path, chain: tuple[Path, ...] = ()) -> dict:
    """The recipe at `path` merged over its `base:` chain; `chain` holds the files that
    inherit from it (a cycle would recurse forever)."""
    if not path.is_file():
        raise FileNotFoundError(f"recipe {path} not found")
    if path.resolve() in chain:
        raise ValueError(f"recipe {path}: base: inheritance loops back to itself")
    text = path.read_text()
    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(yaml_error_message(path, text, e)) from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ValueError(f"recipe {path}: the top level must be a mapping of sections "
                         f"(model:, run:, ...), got {type(tree).__name__} {tree!r:.60}")
    base = tree.pop("base", None)
    if base is None:
        return tree
    if not isinstance(base, str) or not base:
        raise ValueError(f"recipe {path}: base={base!r} must be a path to another recipe")
    merged = _read_recipe(path.parent / base, (*chain, path.resolve()))
    _merge(merged, tree)
    return merged


def yaml_error_message(path: Path, text: str, err: yaml.YAMLError) -> str:
    """'file:line:column: problem' for a YAML syntax error; a tab on the offending line gets
    the actual fix (YAML forbids tabs in indentation, and PyYAML's wording hides that)."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    problem = getattr(err, "problem", None) or str(err)
    if mark is None:
        return f"{path}: not valid YAML ({problem})"
    lines = text.splitlines()
    line = lines[mark.line] if mark.line < len(lines) else ""
    if "\t" in line or "'\\t'" in problem:
        problem = "tabs are not allowed in YAML, indent with spaces"
    return f"{path}:{mark.line + 1}:{mark.column + 1}: {problem}"


def _merge(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = v


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)
