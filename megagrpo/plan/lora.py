"""The planner's LoRA lines: what a LoRA recipe holds and sends next to full fine-tuning of the
same recipe (`megagrpo plan` prints them when lora.rank > 0). Pure arithmetic, like
`megagrpo.plan`.

Refit bytes per step are what the trainer sends one vLLM engine after an update, in the
policy's dtype (the engine runs in it):
- full fine-tuning, and LoRA where vLLM cannot serve the adapters
  (`megagrpo.sync.adapters.unavailable` says why): the whole model, merged W + s B A for LoRA;
- LoRA between merges: the adapters alone, as the peft folder carries them (one A [r, in] and
  one B [out, r] per HF projection: the fused QKV and gate/up adapters' A repeated per part);
- LoRA on the step after a merge (a reference reset): the base W (adapters off) and the
  adapters.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megagrpo.config.model import ModelConfig, ParallelConfig
from megagrpo.config.params import adapted, param_specs, peft_modules
from megagrpo.config.train import TrainConfig
from megagrpo.plan.memory import DTYPE_BYTES, GIB, RankMemory, rank_memory, total_params


def peft_numel(cfg: TrainConfig, m: ModelConfig) -> int:
    """Adapter elements of the whole model in peft's per-projection layout (what an
    adapter-only refit sends): per HF projection (in, out) of every adapted weight, r * (in +
    out); an MoE layer's every routed expert and its shared expert included."""
    specs = adapted(param_specs(m, ParallelConfig(), 0), cfg.lora.targets)
    return sum(cfg.lora.rank * (i + o) for _, i, o in peft_modules(specs, m))


@dataclass(kw_only=True)
class RefitBytes:
    """Bytes one vLLM engine receives after an update."""

    model: int
    """The whole model in the policy's dtype (full fine-tuning's refit, every step)."""
    adapters: int
    """The adapters in peft's layout (LoRA's refit between merges)."""
    fallback: str
    """Why vLLM cannot serve the adapters ('' when it can): then every step refits the model."""

    @property
    def between_merges(self) -> int:
        """A LoRA step's refit when no merge happened since the last one."""
        return self.model if self.fallback else self.adapters

    @property
    def after_merge(self) -> int:
        """A LoRA step's refit right after a merge (base + adapters, or the merged model)."""
        return self.model if self.fallback else self.model + self.adapters


def refit_bytes(cfg: TrainConfig, m: ModelConfig) -> RefitBytes:
    """The refit sizes of the recipe (see the module docstring)."""
    from megagrpo.sync.adapters import unavailable  # torch: only when planning a LoRA recipe

    b = DTYPE_BYTES[m.dtype]
    return RefitBytes(model=total_params(m) * b, adapters=peft_numel(cfg, m) * b,
                      fallback=unavailable(cfg.lora, cfg.rollout.tensor_parallel_size, m))


def full_finetuning(cfg: TrainConfig) -> TrainConfig:
    """The same recipe with LoRA off."""
    return dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, rank=0))


def merge_schedule(cfg: TrainConfig) -> str:
    """When the reference resets (each reset merges the adapters into the base)."""
    ref = cfg.reference
    if cfg.algo.beta == 0:
        return "algo.beta=0: no reference, no merges"
    when = [f"every {ref.sync_every_steps} steps"] if ref.sync_every_steps else []
    when += ["every epoch"] if ref.sync_every_epoch else []
    when += [f"when the KL passes {ref.sync_kl_threshold:g}"] if ref.sync_kl_threshold else []
    return "merges " + (", ".join(when) if when else "never (no reference.* schedule)")


def size(n: int) -> str:
    """Bytes in GiB, MiB or KiB, whichever keeps 3 significant decimals readable."""
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3f} {unit}"
    return f"{n} B"


def format_lora_vs_full(cfg: TrainConfig, m: ModelConfig, lora: RankMemory, world: int,
                        gpu_mem_gib: float) -> str:
    """LoRA next to full fine-tuning at the recipe's layout: trainable parameters, per-rank
    memory, optimizer state, reference copy, refit bytes per step."""
    full = rank_memory(full_finetuning(cfg), m, lora.tp, lora.pp, world, gpu_mem_gib)
    refit = refit_bytes(cfg, m)
    trainable = cfg.lora.rank_numel(m, 1, m.num_layers)
    rows = [("trainable parameters (whole model)", total_params(m), trainable, False),
            ("peak memory per rank", full.total, lora.total, True),
            ("  weights per rank", full.weights, lora.weights, True),
            ("  grads per rank (fp32)", full.grads, lora.grads, True),
            ("  Adam state per rank", full.optimizer, lora.optimizer, True),
            ("  reference copy per rank (resident)", full.reference, lora.reference, True),
            ("refit per step, between merges", refit.model, refit.between_merges, True),
            ("refit on the step after a merge", refit.model, refit.after_merge, True)]
    lines = [f"LoRA (rank {cfg.lora.rank} on {','.join(cfg.lora.targets)}) vs full fine-tuning "
             f"of the same recipe, tp={lora.tp} pp={lora.pp} dp={lora.dp}:",
             f"  {'':<40}{'full':>13}{'LoRA':>13}{'LoRA/full':>11}"]
    for name, a, b, is_bytes in rows:
        shown = [size(v) if is_bytes else f"{v / 1e6:.1f}M" for v in (a, b)]
        lines.append(f"  {name:<40}{shown[0]:>13}{shown[1]:>13}{b / a if a else 0:>11.2%}")
    if refit.fallback:
        path = (f"refit path: the merged model every step (vLLM does not serve the adapters: "
                f"{refit.fallback})")
    else:
        path = ("refit path: the adapters (vLLM serves them); the base (adapters off) and "
                "the adapters on the step after a merge")
    lines += [f"  {path}; {merge_schedule(cfg)}",
              f"  adapter-only refit{' (not the path that runs)' if refit.fallback else ''}: "
              f"{size(refit.adapters)} = {refit.adapters / refit.model:.3%} of the model's "
              f"{size(refit.model)}"]
    return "\n".join(lines)
