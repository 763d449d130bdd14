"""The weight sync's LoRA side: adapter-only vLLM refits (`AdapterSource`) and the merge
(`MergeAdapters`, a transform) for a LoRA policy.

vLLM serves the adapters itself (`enable_lora`, a `LoRARequest` on every generate): its engine
holds the base W and the current adapter, and computes W x + s B A x like the trainer. After an
update only the adapters change, so a refit writes them as a peft folder (a few MB, in the
engine's own directory) and vLLM loads it as a new adapter, replacing the last one; at
rollout.placement=separate training rank 0 broadcasts them to the rollout ranks, which write
and load the folder themselves (`Transport.deliver_adapter`). The base is
refit (W, adapters off) only when it changed: at the start and after a merge (a reference
reset, `AdapterSource.base_changed`). A merge leaves the policy unchanged, so vLLM's old base and
old adapter still sample the policy until the next refit sends both.

When vLLM cannot serve the adapters (`unavailable` says why) the merged weights W + s B A are
refit after each update instead, as for full fine-tuning: the `MergeAdapters` transform hands
the source `megagrpo.lora.layers.parameters_for_refit`'s merged view of the stage's parameters.
"""
from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from pathlib import Path

import torch

from megagrpo.config.lora import LoRAConfig
from megagrpo.config.model import ModelConfig
from megagrpo.lora.export import gather_adapters, save_peft_adapter
from megagrpo.lora.layers import adapters_disabled, parameters_for_refit
from megagrpo.model.gpt import unwrap
from megagrpo.sync.source import Feed, FullWeights
from megagrpo.sync.transforms import Transform
from megagrpo.sync.transports import Transport

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 accepts as max_lora_rank (vllm/config/lora.py, MaxLoRARanks)."""


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds `rank` (0: none does)."""
    return next((r for r in VLLM_LORA_RANKS if r >= rank), 0)


def unavailable(lora: LoRAConfig, rollout_tp: int, model: ModelConfig | None = None, *,
                on_cpu: bool = False) -> str:
    """'' when vLLM serves this run's adapters, else why it does not (the merged weights are
    refit then). `model`: the policy's (MoE expert adapters are not served); `on_cpu`: the
    engines are vLLM's CPU build (`lora.refit=auto` refits merged there). The same answer
    colocated and at rollout.placement=separate (whose rollout ranks are sent the adapters
    alone by the `shards` or `collective` transport). Raises ValueError when
    `lora.refit=adapter` asks for what cannot be served."""
    if not lora.enabled:
        return "lora.rank=0"
    if lora.refit == "merged":
        return "lora.refit=merged"
    why = _cannot_serve(lora, rollout_tp, model)
    if not why and on_cpu and model is not None and model.is_moe:
        # measured (tests/test_placement.py's MoE run with lora.refit=adapter): with LoRA on,
        # vLLM 0.32 runs the experts through its Triton fused-MoE kernels, even beside
        # attention-only adapters, and its CPU build has no Triton ("triton.language has no
        # attribute float32" in triton_moe.py at the first generate)
        why = ("an MoE model on vLLM's CPU build, whose experts run through Triton kernels it "
               "lacks once LoRA is on")
    if why and lora.refit == "adapter":
        raise ValueError(f"lora.refit=adapter, but {why}; set lora.refit=auto or merged")
    if not why and on_cpu and lora.refit == "auto":
        why = ("lora.refit=auto on vLLM's CPU build, whose LoRA decode is several times slower "
               "than the merged model's (benchmarks/lora_decode.py); lora.refit=adapter serves "
               "the adapters anyway")
    return why


def vllm_on_cpu() -> bool:
    """Whether this process's vLLM is the CPU build."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _cannot_serve(lora: LoRAConfig, rollout_tp: int, model: ModelConfig | None) -> str:
    """Why vLLM cannot serve the adapters here ('' when it can)."""
    expert = [t for t in lora.targets if t in ("fc1", "fc2")]
    if model is not None and model.is_moe and expert:
        # vLLM 0.32's FusedMoEWithLoRA runs through punica's fused-MoE LoRA ops, which its CPU
        # wrapper (PunicaWrapperCPU) does not implement, and its CPU experts do not support LoRA
        return (f"lora.targets {expert} adapt MoE experts, which vLLM's LoRA on fused-MoE "
                "layers cannot serve in this build (no CPU fused-MoE LoRA kernels)")
    if not vllm_max_lora_rank(lora.rank):
        return f"lora.rank={lora.rank} exceeds vLLM's largest max_lora_rank ({VLLM_LORA_RANKS[-1]})"
    return ""


class MergeAdapters(Transform):
    """A LoRA policy whose engine does not serve its adapters: the source streams the merged
    weights W + s B A (read one tensor at a time, `megagrpo.lora.layers.MergedParams`) under the
    base's names, so names, shapes and dtypes are the base's (`emits` is the default)."""

    def parameters(self, gpt: torch.nn.Module, params: Mapping[str, torch.Tensor] | None
                   ) -> Mapping[str, torch.Tensor]:
        return parameters_for_refit(unwrap(gpt))


class AdapterSource:
    """The refit of a LoRA policy into a vLLM engine started with its LoRA support: the base
    through the weight stream (`base`, adapters off) when it changed, then the adapters, which
    the engine loads as a new LoRA adapter (a peft folder): the transport's `deliver_adapter`
    moves both, into this rank's engine (`reload`) or to rollout ranks of their own (`shards`,
    `collective`), whose engines write and load the folder themselves. A checkpoint part
    (`checkpoint_parts`): a merge not refit yet."""

    def __init__(self, cfg: LoRAConfig, folder: str | Path, engine, base: FullWeights,
                 transport: Transport):
        self.cfg = cfg
        self.folder = Path(folder)
        self.engine = engine
        self.base = base
        """The weight stream of the base (full weights or shard slices)."""
        self.transport = transport
        """What moves a refit (`Transport.deliver_adapter`)."""
        self.base_stale = True
        """Whether vLLM's base differs from the policy's (start, after a merge)."""
        self._count = 0
        self._stale_after_first = False
        """A resumed run: whether the run it continues had a merge pending its refit."""

    def feed(self, policy: torch.nn.Module, params: Mapping[str, torch.Tensor] | None) -> Feed:
        """The base's stream: the stage's parameters without the adapters (their merged view,
        which `refit` reads with the adapters off: W)."""
        return self.base.feed(policy, parameters_for_refit(unwrap(policy)) if params is None
                              else params)

    def base_changed(self) -> None:
        """A merge edited W: the next refit sends the base too."""
        self.base_stale = True

    def checkpoint_parts(self) -> dict[str, AdapterSource]:
        return {"adapter_refit": self}

    def state_dict(self) -> dict:
        """For the checkpoint (a key of trainer_state.json): a merge not refit yet."""
        return {"adapter_base_stale": self.base_stale}

    def load_state_dict(self, state: dict) -> None:
        """A resumed run's engine is new, so its first refit sends the base whatever the
        checkpoint says; the refit after it sends the base again when the run it continues
        would have (a merge since that run's last refit), so vLLM gets the same refits and
        samples the same log-probs bitwise as uninterrupted (the base once more, at a resume
        right after a merge)."""
        self._stale_after_first = bool(state.get("adapter_base_stale", False))

    def refit(self, policy, feed: Callable[[], Feed], deliver: Callable[[Feed], dict]) -> dict:
        """The base (the stream run with the adapters off) when it changed, then the adapters
        as a new LoRA adapter of the engine(s), both through the transport's
        `deliver_adapter` (`deliver`, the transport's plain delivery, is not used). Collective
        over the model-parallel group. Returns the sync metrics (sync_bytes: base +
        adapters)."""
        base = self.base_stale
        t0 = time.perf_counter()
        tensors = gather_adapters(policy, self.base.model, self.base.parallel)
        t1 = time.perf_counter()
        with adapters_disabled(policy) if base else nullcontext():  # the feed streams W
            out = self.transport.deliver_adapter(feed() if base else None, tensors,
                                                 self.load_local)
        if base:
            self.base_stale, self._stale_after_first = self._stale_after_first, False
        nbytes = adapter_bytes(tensors)
        out.update(sync_bytes=out["sync_bytes"] + nbytes, sync_adapter_bytes=nbytes,
                   sync_base=float(base), sync_gather_s=out["sync_gather_s"] + t1 - t0,
                   sync_load_s=out["sync_load_s"] + time.perf_counter() - t1)
        return out

    def load_local(self, tensors: dict[str, torch.Tensor]) -> None:
        """The adapters as a peft folder in this rank's engine folder, loaded by its engine
        (the colocated transport's part of `deliver_adapter`)."""
        self._count += 1
        folder = self.folder / f"adapter_{self._count}"
        save_peft_adapter(folder, tensors, self.cfg, base="")
        self.engine.load_adapter(str(folder))
        shutil.rmtree(self.folder / f"adapter_{self._count - 1}", ignore_errors=True)


def adapter_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes of the tensors (what an adapter refit moves)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())
