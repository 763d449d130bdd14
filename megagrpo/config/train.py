"""The whole run's configuration: one section per concern, loaded from a YAML recipe with
`key.sub=value` overrides, validated before any process group or model exists."""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from megagrpo.config.algo import AlgoConfig
from megagrpo.config.data import ArithmeticConfig, DataConfig, RewardConfig
from megagrpo.config.model import ModelConfig, ParallelConfig
from megagrpo.config.optim import OptimConfig
from megagrpo.config.rollout import RolloutConfig


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
    """Continue from the newest checkpoint in out_dir/checkpoints when one exists."""
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

    def validate(self) -> None:
        if self.steps < 0:
            raise ValueError(f"run.steps={self.steps} must be >= 0")
        if self.kernel_impl not in ("auto", "triton", "torch"):
            raise ValueError(f"run.kernel_impl={self.kernel_impl!r}: use auto, triton or torch")
        for f in ("micro_batch_size", "num_minibatches", "keep_last", "sft_batch_size"):
            if getattr(self, f) < 1:
                raise ValueError(f"run.{f}={getattr(self, f)} must be >= 1")


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
        if self.run.async_rollout and self.rollout.tensor_parallel_size > 1:
            raise ValueError("run.async_rollout needs rollout.tensor_parallel_size=1")
        if self.rollout.tensor_parallel_size > 1:
            raise ValueError("the trainer runs vLLM with rollout.tensor_parallel_size=1 per rank "
                             "(rollouts are data-parallel over all ranks); VLLMEngine itself "
                             "supports tp>1 via external_launcher")


def _build(cls: type, data: dict, where: str):
    """Dataclass `cls` from a nested dict; unknown keys are errors that list the valid ones."""
    if not isinstance(data, dict):
        raise ValueError(f"{where or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise ValueError(f"unknown config key {where + key!r}; valid keys: {sorted(names)}")
        t = hints[key]
        if dataclasses.is_dataclass(t) and isinstance(value, dict):
            value = _build(t, value, f"{where}{key}.")
        kwargs[key] = _coerce(value, t, where + key)
    return cls(**kwargs)


def _coerce(value, hint, name: str):
    """YAML 1.1 reads '1e-3' as a string and '5' where a float is meant as an int: convert
    scalars to the field's declared type, or say which field is wrong."""
    if hint is float and isinstance(value, (int, str)) and not isinstance(value, bool):
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{name}={value!r}: expected a number") from None
    if hint is int and isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{name}={value!r}: expected an integer") from None
    if hint is bool and not isinstance(value, bool):
        raise ValueError(f"{name}={value!r}: expected true or false")
    return value


def _set_dotted(tree: dict, dotted: str, value) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {dotted!r}: {k!r} is not a section")
    node[keys[-1]] = value


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()
                ) -> TrainConfig:
    """A recipe (YAML; `base: other.yaml` inherits, relative to the file) plus `a.b=value`
    overrides (values parsed as YAML)."""
    tree = _read_recipe(Path(path)) if path else {}
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r}: use key.sub=value")
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), yaml.safe_load(raw))
    return _build(TrainConfig, tree, "")


def _read_recipe(path: Path) -> dict:
    if not path.exists():
        raise FileNotFoundError(f"recipe {path} not found")
    tree = yaml.safe_load(path.read_text()) or {}
    base = tree.pop("base", None)
    if base:
        merged = _read_recipe(path.parent / base)
        _merge(merged, tree)
        return merged
    return tree


def _merge(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = v


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)
