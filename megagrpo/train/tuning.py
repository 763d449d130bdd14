"""What a run trains: every parameter of the policy, or LoRA adapters beside a frozen base
(lora.rank > 0). `build_tuning` chooses once from the lora section; the run asks the choice for
the parts that differ (adapters added before DDP, the KL reference, the models' checkpoint
parts), so building a run branches on LoRA here only."""
from __future__ import annotations

import dataclasses
import logging

import torch

from megagrpo.checkpoint import ModelState
from megagrpo.config.lora import LoRAConfig
from megagrpo.config.model import ModelConfig
from megagrpo.config.train import TrainConfig
from megagrpo.lora.checkpoint import lora_parts
from megagrpo.lora.layers import LoRAReference, add_adapters, describe
from megagrpo.model.reference import Reference
from megagrpo.sync.adapters import unavailable, vllm_max_lora_rank, vllm_on_cpu

log = logging.getLogger("megagrpo")


class FullTuning:
    """Every parameter trains; the reference is a second model of the policy's layout."""

    def prepare(self, gpt: torch.nn.Module, model: ModelConfig, rollout_tp: int, *, seed: int,
                loud: bool) -> None:
        """Nothing to add before DDP."""

    def engine_lora_rank(self, rollout_tp: int, model: ModelConfig) -> int:
        """The engine serves no adapter."""
        return 0

    def reference(self, policy, model: ModelConfig, cfg: TrainConfig) -> Reference:
        return Reference(policy, model, cfg.parallel, cfg.reference, seed=cfg.run.seed)

    def model_parts(self, tr) -> dict[str, ModelState]:
        """The checkpoint's model parts (`tr`: the Trainer): the policy, and the reference model
        when the run has one (algo.beta > 0)."""
        parts = {"policy": ModelState(tr.policy, tr.model_cfg, tokenizer=tr.tokenizer)}
        if tr.reference is not None:
            parts["reference"] = ModelState(tr.reference.model, tr.model_cfg, if_missing="")
        return parts


@dataclasses.dataclass(frozen=True)
class LoRATuning:
    """Adapters beside megatron's linears train, the base frozen; the reference is the policy
    with its adapters off, and a reset merges ([lora.md](../../docs/lora.md))."""

    lora: LoRAConfig

    def prepare(self, gpt: torch.nn.Module, model: ModelConfig, rollout_tp: int, *, seed: int,
                loud: bool) -> None:
        """The adapters added and the base frozen before DDP (grad buffers and Adam for the
        adapters only); `loud`: one console line on what trains and how vLLM gets it."""
        n = add_adapters(gpt, self.lora, seed=seed)
        if loud:
            why = unavailable(self.lora, rollout_tp, model, on_cpu=vllm_on_cpu())
            log.info("%s", describe(n, sum(p.numel() for p in gpt.parameters()), self.lora, why))

    def engine_lora_rank(self, rollout_tp: int, model: ModelConfig) -> int:
        """The max_lora_rank the engines start with: the adapters' (vLLM's next size) where
        vLLM serves them, 0 where the merged weights are refit instead."""
        if unavailable(self.lora, rollout_tp, model, on_cpu=vllm_on_cpu()):
            return 0
        return vllm_max_lora_rank(self.lora.rank)

    def reference(self, policy, model: ModelConfig, cfg: TrainConfig) -> LoRAReference:
        return LoRAReference(policy, cfg.reference)

    def model_parts(self, tr) -> dict[str, ModelState]:
        """The adapters in policy/, the frozen base only after a merge (`tr`: the Trainer); the
        reference is the base with the adapters off, no part of its own."""
        return lora_parts(tr.policy, tr.model_cfg,
                          lambda: tr.reference.merges if tr.reference is not None else 0,
                          tokenizer=tr.tokenizer, extra={"lora": dataclasses.asdict(self.lora)})


def build_tuning(lora: LoRAConfig) -> FullTuning | LoRATuning:
    """LoRA's tuning when lora.rank > 0, else full-parameter training."""
    return LoRATuning(lora) if lora.enabled else FullTuning()


__all__ = ["FullTuning", "LoRATuning", "build_tuning"]
