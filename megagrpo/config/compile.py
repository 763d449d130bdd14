"""compute.compile_layers: where a compiled layer runs, and what 'auto' picks (pure config
rules; `megagrpo.model.compile` does the compiling)."""
from __future__ import annotations

from dataclasses import dataclass

from megagrpo.config.model import ModelConfig, ParallelConfig

AUTO_MAX_HIDDEN = 256
"""'auto' compiles dense models up to this width: whole GRPO steps with the layers compiled and
eager, alternated in one process (`benchmarks/grpo_step.py --compile-ab`,
benchmarks/results/compile_ab_cpu.jsonl, a 2-core AMD EPYC), spent 0.70-0.84x the eager
scoring + update at hidden 64-256 (per-op overhead and element-wise work are much of a small
layer's pass, and fusing them is what compiling buys), 0.97x at 512 and 1.05-1.52x (slower) on
SmolLM2's 30 layers of 576, where the GEMMs set the time."""

AUTO_SAVED_S = 4.5e-9
"""... where the run's work repays the compile: 'auto' counts on saving this many seconds per
token pass (`RunWork`), layer and unit of hidden_size, the least any compile_ab row at hidden
<= 256 saved (report.py --compile's "saved" column: 4.6e-9 on varlen, whose completions
averaged 23 of the 96 tokens the estimate counts; 1.0-2.2e-8 elsewhere, 1.4e-8 on a
small-batch run of 32 sequences of ~21 tokens a step), ..."""

AUTO_COMPILE_S = 21.0
"""... against this many seconds of compile in the first steps (the most measured: 9-21 s on
2 cores, 20.4 s in a new user's run of a 192 x 4-layer model)."""


@dataclass(frozen=True)
class RunWork:
    """What a run passes through each of one rank's layers, estimated at start-up from the
    config and the training prompts' mean length: token passes in forward equivalents (a
    forward 1, a forward + backward 3), per step and over the step caps (the run may stop
    earlier at an accuracy target)."""

    grpo_steps: int
    grpo_step: float
    """Token passes of one GRPO step: sequences per rank x (prompt + completion tokens) x
    (scoring forwards + 3 x algo.mu)."""
    cold_steps: int = 0
    cold_step: float = 0.0
    """Token passes of one cold-start step (a forward + backward over its sequences)."""

    @property
    def tokens(self) -> float:
        return self.grpo_steps * self.grpo_step + self.cold_steps * self.cold_step

    def saved_s(self, model: ModelConfig, layers: int) -> float:
        """Seconds 'auto' expects compiled layers to save over the run."""
        return self.tokens * layers * model.hidden_size * AUTO_SAVED_S


def run_work(cfg, dp: int, prompt_tokens: float) -> RunWork:
    """`RunWork` of a TrainConfig at data-parallel size `dp`, from the training prompts' mean
    token count (the preflight's). A sequence is counted at the prompt + rollout.max_tokens
    (x agent.max_turns for multi-turn rollouts), capped by rollout.max_model_len, in the cold
    start too (its answers are what the rollouts learn to write)."""
    turns = cfg.agent.max_turns if cfg.agent.environment else 1
    seq = min(prompt_tokens + cfg.rollout.max_tokens * turns, cfg.rollout.max_model_len)
    reference = cfg.algo.beta > 0
    forwards = int(reference) + cfg.algo.needs_old_logprobs(
        async_batch=bool(cfg.staleness), kl_in_reward=cfg.algo.kl_in_reward and reference)
    seqs = cfg.data.batch_size * cfg.algo.group_size / dp
    return RunWork(grpo_steps=cfg.run.steps, grpo_step=seqs * seq * (forwards + 3 * cfg.algo.mu),
                   cold_steps=cfg.cold_start.steps,
                   cold_step=cfg.cold_start.batch_size / dp * seq * 3)


def compile_blocker(compute, model: ModelConfig, parallel: ParallelConfig,
                    lora: bool = False) -> str | None:
    """What keeps compute.compile_layers from running on this config (None: nothing)."""
    if model.is_moe:
        return ("a dense model (MoE layers route a data-dependent number of tokens to each "
                "expert: dynamo breaks the graph there)")
    if parallel.tp > 1:
        return ("parallel.tp=1 (dynamo traces megatron's tensor-parallel collectives as "
                "functional collectives on gloo; not checked against eager yet)")
    if compute.recompute == "full":
        return ("compute.recompute none or selective (megatron's full recomputation reruns "
                "the layers inside its own autograd Function; not checked under compile)")
    if lora:
        return "lora.enabled=false (the adapters are not checked against eager under compile)"
    if parallel.transformer_impl == "transformer_engine":
        return "parallel.transformer_impl local or auto (Transformer Engine's layers)"
    return None


def compile_layers_on(compute, model: ModelConfig, parallel: ParallelConfig, *, lora: bool,
                      cuda: bool, work: RunWork) -> bool:
    """Whether the layers are compiled: compute.compile_layers, 'auto' resolved (CPU, fp32,
    no blocker, hidden_size <= AUTO_MAX_HIDDEN, a run whose `work` repays the compile)."""
    if compute.compile_layers == "auto":
        return (compile_blocker(compute, model, parallel, lora) is None
                and auto_reason(model, parallel, work, cuda) is None)
    return bool(compute.compile_layers)


def auto_reason(model: ModelConfig, parallel: ParallelConfig, work: RunWork,
                cuda: bool) -> str | None:
    """Why 'auto' leaves the layers of a config without a blocker eager (console), None where
    it compiles them: the rule itself."""
    if cuda:
        return "auto compiles on CPU only (not measured on GPUs)"
    if model.dtype != "float32":
        return f"auto compiles float32 models only (measured there; this one is {model.dtype})"
    if model.hidden_size > AUTO_MAX_HIDDEN:
        return (f"auto compiles up to hidden_size {AUTO_MAX_HIDDEN}: measured no faster at "
                "512-576, benchmarks/results/compile_ab_cpu.jsonl")
    if (saved := work.saved_s(model, parallel.stage_size(model.num_layers))) < AUTO_COMPILE_S:
        return ("auto compiles where the run repays the compile: this one's "
                f"~{_count(work.tokens)} token passes a layer would save ~{_secs(saved)} s against "
                f"~{AUTO_COMPILE_S:.0f} s of compile; true compiles anyway")
    return None


def auto_note(model: ModelConfig, parallel: ParallelConfig, work: RunWork) -> str:
    """The console's note where 'auto' compiles: what it expects the run to save."""
    saved = work.saved_s(model, parallel.stage_size(model.num_layers))
    return (f"auto: ~{_count(work.tokens)} token passes a layer, ~{_secs(saved)} s expected "
            f"saved against ~{AUTO_COMPILE_S:.0f} s of compile")


def _count(n: float) -> str:
    return f"{n / 1e6:.2g} million" if n >= 1e6 else f"{n:,.0f}"


def _secs(s: float) -> str:
    return f"{s:.0f}" if s >= 10 else f"{s:.2g}"


def check_compile(compute, model: ModelConfig, parallel: ParallelConfig, lora: bool) -> None:
    """compute.compile_layers=true where it cannot run: a ValueError naming the fix."""
    if compute.compile_layers is not True:
        return
    why = compile_blocker(compute, model, parallel, lora)
    if why:
        raise ValueError(f"compute.compile_layers=true needs {why}; set "
                         "compute.compile_layers=auto (it runs these layers eagerly and says "
                         "so) or false")
