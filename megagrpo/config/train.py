"""The whole run's configuration: one section per concern, loaded from a YAML recipe with
`key.sub=value` overrides, validated before any process group or model exists."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from megagrpo.config.agent import AgentConfig
from megagrpo.config.algo import AlgoConfig
from megagrpo.config.compile import check_compile
from megagrpo.config.context_parallel import check_context_parallel_training
from megagrpo.config.data import ArithmeticConfig, DataConfig, RewardConfig
from megagrpo.config.layout import check_rollout_layout
from megagrpo.config.lora import LoRAConfig
from megagrpo.config.model import ModelConfig, ParallelConfig
from megagrpo.config.optim import OptimConfig
from megagrpo.config.placement import training_world
from megagrpo.config.rollout import RolloutConfig
from megagrpo.config.run import (
    CheckpointConfig,
    ColdStartConfig,
    ComputeConfig,
    EvalConfig,
    LogConfig,
    RunConfig,
    WatchdogConfig,
    check_balance,
)
from megagrpo.config.schema import build_dataclass, check_instance
from megagrpo.config.section import Section
from megagrpo.config.seqpar import check_recompute, check_sequence_parallel
from megagrpo.config.sync import SyncConfig


@dataclass(kw_only=True)
class ReferenceConfig(Section):
    """The KL reference and its iterative re-initialisation (DeepSeekMath Alg. 1, outer loop)."""

    sync_every_steps: int = 0
    """Re-initialise the reference from the policy every N GRPO steps (rollout batches, Alg. 1's
    M; not optimizer steps, of which a step takes algo.mu x algo.num_minibatches); 0 = never."""
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
class TrainConfig(Section):
    """Everything a run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Architecture (ignored when run.init is a checkpoint: read from there)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """TP/PP layout of policy and reference."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and LR schedule."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """vLLM engine and sampling."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    """How the weights reach the engines after each update: transport, dtype."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """GRPO variant."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts and tokenizer."""
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    """The built-in task (data.task=arithmetic)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward terms."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Multi-turn rollouts: environment, tools, turn and token budgets."""
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    """Reference model and its reset schedule."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Low-rank adapters (rank 0: full fine-tuning); the reference is then the adapters off."""
    run: RunConfig = field(default_factory=RunConfig)
    """The loop: steps, seed, out_dir, init, resume."""
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    """Micro-batches and the speed/memory levers of a step's passes."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """When checkpoints are written, how many are kept."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation."""
    cold_start: ColdStartConfig = field(default_factory=ColdStartConfig)
    """Supervised fine-tuning before GRPO (built-in task)."""
    log: LogConfig = field(default_factory=LogConfig)
    """TensorBoard, W&B, console progress."""
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    """Stall and frozen-rank detection."""

    def validate(self, world_size: int | None = None) -> None:
        """Checks every section and the cross-section rules, before anything starts."""
        check_instance(self)  # types first: a config built in Python skipped load_config's
        self.rollout.validate()  # the placement decides how many of the world's ranks train
        world_size = training_world(self.rollout, world_size)
        self.model.validate()
        if self.model.is_vlm:
            self._validate_vlm()
        self.parallel.validate(self.model, world_size)
        self.optim.validate()
        self.optim.check_dtype(self.model.dtype)
        self.rollout.validate()
        self.sync.validate(self.rollout)
        self.sync.check_delta(self.rollout, self.parallel)
        self.algo.validate()
        self.data.validate()
        if self.data.task == "arithmetic":
            self.arithmetic.validate()
        self.reward.validate()
        self.agent.validate()
        self.reference.validate(self.algo.beta)
        self.lora.validate(self.model, self.parallel, reference_offload=self.reference.offload)
        for section in (self.run, self.compute, self.checkpoint, self.eval, self.cold_start,
                        self.watchdog):
            section.validate()
        if world_size is not None:
            dp = world_size // (self.parallel.tp * self.parallel.pp * self.parallel.cp)
            if self.data.batch_size % dp:
                raise ValueError(f"data.batch_size={self.data.batch_size} must be divisible by "
                                 f"the data-parallel size {dp}")
        self._validate_staleness()
        self._validate_sampling()
        if self.algo.overlong_buffer > self.rollout.max_tokens:
            raise ValueError(
                f"algo.overlong_buffer={self.algo.overlong_buffer} is longer than "
                f"rollout.max_tokens={self.rollout.max_tokens}: the penalty ramp would start "
                "before the first token; use algo.overlong_buffer <= rollout.max_tokens")
        if self.compute.micro_batch_tokens and self.parallel.pp > 1:
            raise ValueError(f"compute.micro_batch_tokens={self.compute.micro_batch_tokens} "
                             f"needs parallel.pp=1 (got {self.parallel.pp}: pipeline stages "
                             "exchange fixed micro-batch shapes); set compute.micro_batch_tokens=0")
        check_recompute(self.compute, self.model, self.parallel)
        check_compile(self.compute, self.model, self.parallel, self.lora.enabled)
        check_balance(self.compute.balance_tokens, loss_agg=self.algo.loss_agg,
                      kl_in_reward=self.algo.kl_in_reward and self.algo.beta > 0)
        check_sequence_parallel(self.algo, self.parallel)
        check_context_parallel_training(self.algo, self.compute, self.parallel,
                                        placement=self.rollout.placement)
        why = packing_blocker(self.compute, self.parallel)
        if self.compute.pack_sequences and why:
            raise ValueError(f"compute.pack_sequences=true needs {why}; set "
                             "compute.pack_sequences=false (or leave it unset)")
        if self.cold_start.steps and self.agent.enabled and self.data.task != "arithmetic":
            raise ValueError(f"cold_start.steps={self.cold_start.steps} with the agent on "
                             f"data.task={self.data.task!r}: a file task's cold start trains "
                             "the answer field as the completion, not a multi-turn trajectory; "
                             "set cold_start.steps=0")
        by = self.pipelined_by()
        # separate placement draws on the rollout ranks' main threads, an engine's ranks in
        # lockstep (megagrpo.rollout.serve._agree); in flight they would not be
        ahead_apart = self.rollout.placement == "separate" and not self.rollout.inflight_updates
        if self.rollout.placement == "separate" and self.rollout.tensor_parallel_size > 1:
            # an in-flight load is decided on each rank's generating thread, mid-draw, from
            # the syncs its own main thread has received so far: an engine's ranks, which
            # must load a sync at the same decode step, could decide apart (the top-up count
            # and the syncs between draws are the engine leader's, `_agree`)
            if self.rollout.inflight_updates:
                raise ValueError(
                    "rollout.inflight_updates=true with rollout.tensor_parallel_size="
                    f"{self.rollout.tensor_parallel_size} and rollout.placement=separate: "
                    "every rank of an engine would have to load a sync at the same decode "
                    "step; set rollout.inflight_updates=false (syncs between draws), or "
                    "rollout.tensor_parallel_size=1")
        if by and self.rollout.tensor_parallel_size > 1 and not ahead_apart:
            # the side thread samples from each rank's own generator: an engine's ranks diverge
            raise ValueError(f"{by[0]} needs rollout.tensor_parallel_size=1 (engines of "
                             "k > 1 ranks must sample identical tokens on every rank); set "
                             f"{by[2]} or rollout.tensor_parallel_size=1")
        check_rollout_layout(self.rollout.tensor_parallel_size, self.parallel, self.model,
                             # separate: the engines live on the rollout ranks (checked above)
                             None if self.rollout.placement == "separate" else world_size)


    @property
    def dr_grpo_len(self) -> int:
        """Dr. GRPO's constant normaliser, tokens per sequence: algo.dr_grpo_max_len, else the
        most model tokens a sample can hold: rollout.max_tokens single-turn; multi-turn the
        trajectory's budget, agent.max_total_tokens, or when that is 0 rollout.max_model_len
        (the budget after an empty prompt: a constant, where max_model_len minus each prompt
        is not). Not rollout.max_tokens there: that bounds one turn, and a trajectory of up
        to agent.max_turns of them would scale the loss by up to max_turns."""
        if self.algo.dr_grpo_max_len:
            return self.algo.dr_grpo_max_len
        if not self.agent.enabled:
            return self.rollout.max_tokens
        return self.agent.max_total_tokens or self.rollout.max_model_len

    def length_limits(self, prompt_lengths: list[int]) -> list[int]:
        """The length that truncates each sample, for prompts of these lengths (DAPO's overlong
        penalty measures a sample's length against it): single-turn the completion's budget,
        rollout.max_tokens; multi-turn every token after the prompt (model and environment)
        against the trajectory's budget, agent.max_total_tokens capped by rollout.max_model_len
        minus the prompt (that alone when agent.max_total_tokens is 0)."""
        if not self.agent.enabled:
            return [self.rollout.max_tokens] * len(prompt_lengths)
        cap = self.agent.max_total_tokens or self.rollout.max_model_len
        return [min(self.rollout.max_model_len - n, cap) for n in prompt_lengths]

    @property
    def staleness(self) -> int:
        """k, the most policy versions a sample may lag the trainer (rollout.max_staleness;
        unset: 1 with run.async_rollout, else 0). k >= 1 draws batches ahead on a side thread."""
        return self.rollout.staleness(self.run.async_rollout)

    def pipelined_by(self) -> tuple[str, str, str] | None:
        """Which setting draws batches ahead (None: none does): (its name, as set, the setting
        that turns it off), for the errors that refuse what cannot pipeline."""
        k = self.rollout.max_staleness
        if k is None:
            return (("run.async_rollout", "run.async_rollout=true", "run.async_rollout=false")
                    if self.run.async_rollout else None)
        return (f"rollout.max_staleness={k}",) * 2 + ("rollout.max_staleness=0",) if k else None

    def _validate_vlm(self) -> None:
        """A vision-language model trains colocated and synchronous, its records' images
        carried by the rollout collector (docs/vlm.md); what does not carry them yet is
        refused by field."""
        refusals = (
            (self.rollout.placement == "separate", "rollout.placement='separate'",
             "the rollout ranks' stream sends token ids only", "rollout.placement=colocated"),
            (self.staleness > 0, f"rollout.max_staleness={self.staleness} (or "
             "run.async_rollout)", "a batch drawn ahead is checkpointed without its images",
             "rollout.max_staleness=0 and run.async_rollout=false"),
            (self.rollout.partial_rollouts, "rollout.partial_rollouts=true",
             "paused trajectories are continued without their images",
             "rollout.partial_rollouts=false"),
            (self.rollout.inflight_updates, "rollout.inflight_updates=true",
             "the in-flight loop sends no images", "rollout.inflight_updates=false"),
            (self.rollout.tensor_parallel_size > 1,
             f"rollout.tensor_parallel_size={self.rollout.tensor_parallel_size}",
             "vLLM sampling with images is checked at engine TP 1 only",
             "rollout.tensor_parallel_size=1"),
            (self.agent.enabled, "agent (multi-turn rollouts)",
             "the trajectory runner sends token ids only", "turn the agent off"),
            (self.compute.pack_sequences is True, "compute.pack_sequences=true",
             "the packed path's RoPE is 1-D", "compute.pack_sequences=false (or unset)"),
            (self.compute.balance_tokens is True, "compute.balance_tokens=true",
             "moving rows between replicas does not carry their images",
             "compute.balance_tokens=false (or unset)"),
            (self.cold_start.steps > 0 and self.data.task == "arithmetic",
             f"cold_start.steps={self.cold_start.steps} on data.task=arithmetic",
             "the built-in task has no images", "data.task=file (records with images)"),
        )
        for bad, what, why, fix in refusals:
            if bad:
                raise ValueError(
                    f"{what} with model.architecture={self.model.architecture!r}: {why} "
                    f"(docs/vlm.md); set {fix}")

    def _validate_staleness(self) -> None:
        if self.run.async_rollout and self.rollout.max_staleness == 0:
            raise ValueError("run.async_rollout=true (rollout.max_staleness: 1) contradicts "
                             "rollout.max_staleness=0 (synchronous); drop run.async_rollout, "
                             "or set rollout.max_staleness >= 1")
        if self.rollout.inflight_updates and not self.staleness:
            raise ValueError("rollout.inflight_updates=true loads new weights into a draw that "
                             "runs while a step trains: it needs async rollouts; set "
                             "rollout.max_staleness >= 1 (or run.async_rollout=true), or "
                             "rollout.inflight_updates=false")
        if self.rollout.inflight_updates and self.lora.enabled and self.lora.refit != "merged":
            raise ValueError(f"rollout.inflight_updates=true with lora.refit={self.lora.refit}: "
                             "in-flight loads post the merged weights; set lora.refit=merged")
        self._validate_partial()

    def _validate_partial(self) -> None:
        """rollout.partial_rollouts: what it composes with (docs/async.md, partial rollouts)."""
        r = self.rollout
        if not r.partial_rollouts:
            return
        k = self.staleness
        if not k:
            raise ValueError("rollout.partial_rollouts=true pauses the draw that runs while a "
                             "step trains and continues it after the weight update: it needs "
                             "async rollouts; set rollout.max_staleness >= 1 (or "
                             "run.async_rollout=true), or rollout.partial_rollouts=false")
        if r.partial_max_updates > k:
            raise ValueError(f"rollout.partial_max_updates={r.partial_max_updates} is above "
                             f"rollout.max_staleness={k}: a batch trains k updates after its "
                             "draw started, so no trajectory spans more; set "
                             f"rollout.partial_max_updates <= {k} (0: no cap but k)")
        refusals = (
            (r.inflight_updates, "rollout.inflight_updates=true",
             "rollout.inflight_updates=false (the in-flight slot keeps the KV cache within a "
             "draw; partial rollouts recompute it across the pause)"),
            (r.tensor_parallel_size > 1, f"rollout.tensor_parallel_size={r.tensor_parallel_size}",
             "rollout.tensor_parallel_size=1 (every rank of an engine would have to pause at "
             "the same decode step)"),
            (self.algo.routing_replay, "algo.routing_replay=true", "algo.routing_replay=false"),
            (self.reward.score_chunks > 1, f"reward.score_chunks={self.reward.score_chunks}",
             "reward.score_chunks=1 (a partial batch is scored once it is finished)"),
            (bool(r.stop), "rollout.stop (stop strings)",
             "rollout.stop=[] and end completions with stop token ids (a stop string across "
             "the pause would be missed)"),
        )
        for bad, what, fix in refusals:
            if bad:
                raise ValueError(f"rollout.partial_rollouts=true with {what}: not supported yet; "
                                 f"set {fix}, or rollout.partial_rollouts=false")

    def _validate_sampling(self) -> None:
        """Sampling settings that are valid for the engine alone but wrong for GRPO."""
        temperature, mode = self.rollout.temperature, self.rollout.logprobs_mode
        if temperature == 0:
            raise ValueError(
                "rollout.temperature=0 is greedy decoding: the algo.group_size completions of a "
                "prompt would be identical (zero advantages) and the loss divides logits by the "
                "temperature; GRPO needs sampling: use rollout.temperature > 0 (e.g. 1.0)")
        truncated = self.rollout.top_p < 1.0 or self.rollout.top_k > 0
        if truncated and mode == "processed_logprobs" and self.algo.rollout_is != "none":
            raise ValueError(
                f"rollout.top_p={self.rollout.top_p} / rollout.top_k={self.rollout.top_k} with "
                f"algo.rollout_is={self.algo.rollout_is!r}: vLLM's processed log-probs are of "
                "the truncated, renormalised distribution while the trainer scores the full "
                "softmax, so every IS weight would be off by the nucleus mass; sample with "
                "top_p=1 and top_k=-1 (or 0), or set algo.rollout_is=none")
        by = self.pipelined_by()
        if truncated and mode == "processed_logprobs" and by:
            raise ValueError(
                f"rollout.top_p={self.rollout.top_p} / rollout.top_k={self.rollout.top_k} with "
                f"{by[1]}: the stale batches of async rollouts train with the "
                "decoupled correction (importance weights old/vLLM; algo.rollout_is=none runs "
                "truncate on them), and vLLM's processed log-probs are of the truncated, "
                "renormalised distribution while the trainer scores the full softmax; sample "
                f"with top_p=1 and top_k=-1 (or 0), or set {by[2]}")
        if mode == "raw_logprobs" and temperature != 1.0:
            raise ValueError(
                f"rollout.logprobs_mode=raw_logprobs with rollout.temperature={temperature}: "
                "vLLM's raw log-probs are taken before temperature scaling, the trainer's after, "
                "so the vLLM-vs-trainer ratios would be wrong; use "
                "logprobs_mode=processed_logprobs, or temperature=1.0")


def _set_dotted(tree: dict, dotted: str, value) -> None:
    """`a.b.c=value` into the recipe's tree; a number indexes a list the recipe gives
    (`reward.sources.1.weight=0.5`)."""
    keys = dotted.split(".")
    node = tree
    for i, k in enumerate(keys):
        last = i == len(keys) - 1
        if isinstance(node, list):
            if not k.isdigit() or int(k) >= len(node):
                raise ValueError(f"override {dotted!r}: {'.'.join(keys[:i])} is a list of "
                                 f"{len(node)}; index it with 0..{len(node) - 1}, got {k!r}")
            k = int(k)
        elif not isinstance(node, dict):
            raise ValueError(f"override {dotted!r}: {keys[i - 1]!r} is not a section")
        if last:
            node[k] = value
        else:
            node = node.setdefault(k, {}) if isinstance(node, dict) else node[k]


def packing_blocker(compute: ComputeConfig, parallel: ParallelConfig) -> str | None:
    """What the config lacks for packed micro-batches (None: nothing; whether Transformer
    Engine's spec replaces the attention is known only at start-up: model.sequence_packing)."""
    if parallel.pp > 1:
        return f"parallel.pp=1 (got {parallel.pp}: stages exchange fixed shapes)"
    if parallel.attention_impl == "megatron":
        return ("parallel.attention_impl sdpa or auto (megatron's DotProductAttention has no "
                "packed path)")
    if not compute.logits_at_loss_positions or not compute.trim_micro_batches:
        return "compute.logits_at_loss_positions=true and compute.trim_micro_batches=true"
    if compute.micro_batch_tokens == 0:
        return "a token budget (compute.micro_batch_tokens unset or > 0)"
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
        raise ValueError(f"recipe {path} is empty: give at least one section (e.g. 'run:' "
                         "with steps and out_dir), or leave --config out for the defaults")
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
