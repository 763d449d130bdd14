"""The run-level sections: the loop (`run`), compute levers inside a step (`compute`),
checkpoints, evaluation, the supervised cold start, logging and the stall watchdog."""
from __future__ import annotations

from dataclasses import dataclass

from megagrpo.config.section import Section


@dataclass(kw_only=True)
class RunConfig(Section):
    """The loop: how long, from what, where to, and when to stop on bad steps."""

    steps: int = 20
    """GRPO steps (one rollout batch each)."""
    seed: int = 1234
    """Seed of a random model init, torch's and numpy's RNGs and the cold start's sampling.
    vLLM's sampling is `rollout.seed` and the data order `data.seed`: a run from a real
    checkpoint varies with those, not with this."""
    out_dir: str = "runs/default"
    """Metrics, checkpoints, summary and plots go here."""
    init: str = "random"
    """'random', an HF checkpoint directory, or a megagrpo checkpoint directory."""
    resume: bool = True
    """Continue from the newest intact checkpoint in out_dir/checkpoints when one exists."""
    overwrite: bool = False
    """Delete an earlier run in out_dir and start over (else it is resumed, or refused)."""
    async_rollout: bool = False
    """One-step off-policy: the rollout of step t+1 overlaps the update of step t (the same as
    rollout.max_staleness: 1, which also allows k >= 2)."""
    max_bad_steps: int = 3
    """Stop with a checkpoint after this many steps in a row skipped for bad values; 0 = never."""

    def validate(self) -> None:
        if self.steps < 0:
            raise ValueError(f"run.steps={self.steps} must be >= 0")
        if self.max_bad_steps < 0:
            raise ValueError(f"run.max_bad_steps={self.max_bad_steps} must be >= 0 (0 = off)")
        if not self.out_dir.strip():
            raise ValueError("run.out_dir is empty: give a folder for metrics and checkpoints")


@dataclass(kw_only=True)
class ComputeConfig(Section):
    """How a step's forward and backward passes are laid out: micro-batches and the levers
    that change speed and memory, never the result (each is tested against the plain layout)."""

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
    take the reference log-probs from them instead of running the reference's forward pass.
    Never under algo.routing_replay: the policy's scoring routes by vLLM's experts, the
    reference by itself."""
    pack_sequences: bool | None = None
    """Lay each micro-batch's sequences end to end (megatron's `thd` layout) so the dense layers
    process no padding; the micro-batch is then cut by its summed tokens
    (compute.micro_batch_tokens), not by micro_batch_size. None: on where it can run
    (parallel.pp = 1, torch SDPA attention, the levers above on) at parallel.cp = 1 (under
    context parallelism it runs only when set true); true where it cannot is an error."""
    kernel_impl: str = "auto"
    """Fused-kernel path: 'auto' (Triton on CUDA, torch otherwise), 'triton' or 'torch'."""
    inplace_backward: bool = True
    """Let the loss kernel write the logits gradient into the logits buffer."""
    fused_output_layer: bool | str = "auto"
    """Compute log-probs, entropy and the loss straight from the final hidden states and the
    output weight in chunks, so no [tokens, vocab] logits exist (scoring, update, cold start);
    'auto': wherever it runs (not beside an output-layer bias or multi-token prediction), except
    on a GPU while a micro-batch's logits fit in 1/4 of the free memory (the logits path is the
    faster one there, docs/performance.md); false: megatron's output layer and the logits
    kernels."""

    balance_tokens: bool | None = None
    """Move a step's sequences between DP replicas so each computes about the same number of
    tokens (LPT partition of every minibatch by length, `megagrpo.train.balance`); the GRPO loss and
    its gradients change by float summation order only (an MoE model's router aux and z-loss,
    computed per micro-batch by megatron, change with the grouping). None: on at DP > 1
    except with algo.loss_agg=bnpo (a per-micro-batch mean) or algo.kl_in_reward (advantages
    set after scoring, from whole groups), where true is an error."""

    compile_layers: bool | str = "auto"
    """`torch.compile` (inductor) each transformer layer's forward as one graph, for the update
    and the scoring passes (`megagrpo.model.compile`): fuses RMSNorm, RoPE, SwiGLU and the residual
    adds, same gradients to float rounding; the first steps pay the compile (9-21 s on 2
    cores). 'auto' (default): on where whole steps were measured faster, dense fp32 models on
    CPU up to hidden_size 256, in runs whose tokens x layers repay the compile at the least
    rate measured (`megagrpo.config.compile`, docs/performance.md "Compiled layers"), off
    elsewhere; true; false."""

    recompute: str = "none"
    """Activation recomputation of the update pass (megatron-core's, forward-only scoring
    keeps none): 'none'; 'selective' (each layer's core attention is recomputed in backward);
    'full' (a whole transformer layer's activations, `recompute_num_layers` layers per
    recomputed chunk, keep only their input)."""
    recompute_num_layers: int = 1
    """compute.recompute='full': layers per uniformly recomputed chunk (1 keeps the least; at
    most the layers of a pipeline stage)."""

    def validate(self) -> None:
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"compute.recompute={self.recompute!r}: use none, selective or full")
        if self.recompute_num_layers < 1:
            raise ValueError(f"compute.recompute_num_layers={self.recompute_num_layers} must be "
                             ">= 1")
        if self.kernel_impl not in ("auto", "triton", "torch"):
            raise ValueError(f"compute.kernel_impl={self.kernel_impl!r}: use auto, triton or "
                             "torch")
        if self.fused_output_layer not in ("auto", True, False):
            raise ValueError(f"compute.fused_output_layer={self.fused_output_layer!r}: use auto, "
                             "true or false")
        if self.compile_layers not in ("auto", True, False):
            raise ValueError(f"compute.compile_layers={self.compile_layers!r}: use auto, true or "
                             "false")
        if self.micro_batch_size < 1:
            raise ValueError(f"compute.micro_batch_size={self.micro_batch_size} must be >= 1")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 0:
            raise ValueError(f"compute.micro_batch_tokens={self.micro_batch_tokens} must be "
                             ">= 0 (0 = off, unset = automatic)")


def check_balance(compute_balance: bool | None, *, loss_agg: str, kl_in_reward: bool) -> None:
    """compute.balance_tokens=true where moving rows would change the result: a ValueError."""
    if compute_balance is not True:
        return
    if loss_agg == "bnpo":
        raise ValueError("compute.balance_tokens=true with algo.loss_agg=bnpo: bnpo takes a token "
                         "mean per micro-batch, so moving sequences changes the loss; set "
                         "compute.balance_tokens=false (or leave it unset)")
    if kl_in_reward:
        raise ValueError("compute.balance_tokens=true with algo.kl_in_reward: the advantages are "
                         "set after scoring from whole groups, which balancing splits; set "
                         "compute.balance_tokens=false (or leave it unset)")


@dataclass(kw_only=True)
class CheckpointConfig(Section):
    """When checkpoints are written and how many are kept (resume: run.resume)."""

    every: int = 0
    """Save every N steps (0 = only at the end when checkpoint.at_end)."""
    at_end: bool = False
    """Save once more after the last step."""
    keep_last: int = 2
    """Checkpoints kept on disk."""

    def validate(self) -> None:
        if self.every < 0:
            raise ValueError(f"checkpoint.every={self.every} must be >= 0 (0 = off)")
        if self.keep_last < 1:
            raise ValueError(f"checkpoint.keep_last={self.keep_last} must be >= 1")


@dataclass(kw_only=True)
class EvalConfig(Section):
    """Greedy held-out accuracy on the task's evaluation examples."""

    every: int = 0
    """Evaluate every N steps (0 = only before and after)."""
    max_tokens: int = 16
    """Generation length for evaluation."""
    target_accuracy: float = 0.0
    """Stop GRPO once greedy held-out accuracy reaches this at an evaluation (every
    `eval.every` steps; `run.steps` is then the most it runs; 0 = always run all of them). As
    `cold_start.target_accuracy`: float rounding differs between CPUs, so a run ends at a skill,
    not a step count. The summary's `eval_target_step` says after which step (null: not
    reached); a resumed run that had reached it runs no further step. Without periodic
    evaluations (eval.every = 0, or a task without held-out prompts) every step runs, and the
    console says so."""

    def validate(self) -> None:
        if self.every < 0:
            raise ValueError(f"eval.every={self.every} must be >= 0 (0 = off)")
        if self.max_tokens < 1:
            raise ValueError(f"eval.max_tokens={self.max_tokens} must be >= 1")
        if not 0.0 <= self.target_accuracy <= 1.0:
            raise ValueError(f"eval.target_accuracy={self.target_accuracy} must be in [0, 1] "
                             "(0 = run all run.steps)")


@dataclass(kw_only=True)
class ColdStartConfig(Section):
    """Supervised fine-tuning before GRPO, as DeepSeek-R1's cold start: on the built-in task, or
    on a file task's training records (the answer field as the completion, with its images)."""

    steps: int = 0
    """Supervised cold-start steps before GRPO (0 = none)."""
    batch_size: int = 64
    """Sequences per cold-start step (global)."""
    lr: float = 1e-3
    """Cold-start learning rate."""
    target_accuracy: float = 0.0
    """Stop the cold start once greedy held-out accuracy reaches this, checked every
    `cold_start.check_every` steps (`cold_start.steps` is then the most it runs; 0 = always
    run all of them). The cold start ends at a skill, not a step count: float rounding differs
    between CPUs, and with it where a fixed number of steps ends."""
    check_every: int = 50
    """Cold-start steps between held-out checks when `cold_start.target_accuracy` > 0."""

    def validate(self) -> None:
        if self.steps < 0:
            raise ValueError(f"cold_start.steps={self.steps} must be >= 0 (0 = off)")
        if not 0.0 <= self.target_accuracy <= 1.0:
            raise ValueError(f"cold_start.target_accuracy={self.target_accuracy} must be in "
                             "[0, 1] (0 = run all cold_start.steps)")
        if self.check_every < 1:
            raise ValueError(f"cold_start.check_every={self.check_every} must be >= 1")
        if self.batch_size < 1:
            raise ValueError(f"cold_start.batch_size={self.batch_size} must be >= 1")
        if self.lr <= 0:
            raise ValueError(f"cold_start.lr={self.lr} must be > 0")


@dataclass(kw_only=True)
class LogConfig(Section):
    """Where metrics go besides out_dir/metrics.jsonl."""

    tensorboard: bool = True
    """Write TensorBoard scalars when tensorboard is installed."""
    wandb: bool = False
    """Log to Weights & Biases when wandb is installed (offline unless configured)."""
    progress: bool = True
    """One-line progress per step on the console."""


@dataclass(kw_only=True)
class WatchdogConfig(Section):
    """The stall watchdog: a frozen rank or a phase that never ends stops the run, named."""

    stall_timeout_s: float = 1800.0
    """One phase (setup, rollout, update, eval, ...) running longer stops the run; 0 = off."""
    heartbeat_timeout_s: float = 120.0
    """A rank whose heartbeat stops this long (frozen) stops the run, naming it; 0 = off."""
    heartbeat_interval_s: float = 5.0
    """Period of each rank's heartbeat and of the stall checks."""

    def validate(self) -> None:
        interval = self.heartbeat_interval_s
        if not 0 < interval < float("inf"):
            raise ValueError(f"watchdog.heartbeat_interval_s={interval}: need a finite number "
                             "> 0")
        for f, beats in (("heartbeat_timeout_s", 3), ("stall_timeout_s", 2)):
            v = getattr(self, f)
            if not (v == 0 or beats * interval <= v < float("inf")):
                raise ValueError(
                    f"watchdog.{f}={v}: need 0 (off) or a finite number >= {beats} x "
                    f"watchdog.heartbeat_interval_s = {beats * interval:g} (a check needs a few "
                    "beats)")


MOVED_RUN_KEYS: dict[str, str] = {
    "micro_batch_size": "compute.micro_batch_size",
    "micro_batch_tokens": "compute.micro_batch_tokens",
    "trim_micro_batches": "compute.trim_micro_batches",
    "skip_zero_advantage": "compute.skip_zero_advantage",
    "logits_at_loss_positions": "compute.logits_at_loss_positions",
    "reuse_equal_reference": "compute.reuse_equal_reference",
    "pack_sequences": "compute.pack_sequences",
    "kernel_impl": "compute.kernel_impl",
    "inplace_backward": "compute.inplace_backward",
    "num_minibatches": "algo.num_minibatches",
    "checkpoint_every": "checkpoint.every",
    "checkpoint_at_end": "checkpoint.at_end",
    "keep_last": "checkpoint.keep_last",
    "eval_every": "eval.every",
    "eval_max_tokens": "eval.max_tokens",
    "sft_steps": "cold_start.steps",
    "sft_batch_size": "cold_start.batch_size",
    "sft_lr": "cold_start.lr",
    "tensorboard": "log.tensorboard",
    "wandb": "log.wandb",
    "progress": "log.progress",
    "stall_timeout_s": "watchdog.stall_timeout_s",
    "heartbeat_timeout_s": "watchdog.heartbeat_timeout_s",
    "heartbeat_interval_s": "watchdog.heartbeat_interval_s",
}
"""run.* keys of megagrpo <= 0.1 (one 32-field section) and their new homes."""
