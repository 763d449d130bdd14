"""LoRA adapters on the policy's linear layers (megagrpo.lora.layers)."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from megagrpo.config.model import ModelConfig, ParallelConfig
from megagrpo.config.params import adapted, adapter_numel, layer_specs, param_specs
from megagrpo.config.section import Section

LORA_TARGETS = ("qkv", "proj", "fc1", "fc2")
"""The linears an adapter can sit beside: the fused QKV projection, the attention output
projection, the fused gate/up projection and the down projection of an MLP (on MoE models:
every routed expert's, the shared expert's and the dense layers' MLP; never the router)."""


@dataclass(kw_only=True)
class LoRAConfig(Section):
    """Low-rank adapters: W x + (alpha / rank) * B A x, base weights frozen; the reference is
    the network with the adapters off, and a reference reset merges them into the base."""

    rank: int = 0
    """Adapter rank r (0: off, full fine-tuning)."""
    alpha: float = 16.0
    """Adapter scale numerator: the update is (alpha / rank) * B A."""
    dropout: float = 0.0
    """Dropout on the adapters' input (parallel.tp = 1 only)."""
    targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Linears that get an adapter, among qkv, proj, fc1, fc2 (on MoE models fc1/fc2 adapt
    every expert, the shared expert and dense layers' MLPs; the router never)."""
    refit: str = "auto"
    """How vLLM gets the policy after an update: 'adapter' (vLLM serves the adapters; only they
    are refit, the base only after a merge), 'merged' (W + s B A refit like a full model), or
    'auto': adapter, except where vLLM cannot serve them (the console says why) and on vLLM's
    CPU build, whose LoRA decode is several times slower than the merged model's
    (benchmarks/lora_decode.py). The same under rollout.placement=separate, whose rollout
    ranks are sent the adapters alone."""

    @property
    def enabled(self) -> bool:
        """Whether adapters are built (rank > 0)."""
        return self.rank > 0

    @property
    def scale(self) -> float:
        """s = alpha / rank, the factor of B A."""
        return self.alpha / self.rank if self.rank else 0.0

    def validate(self, model: ModelConfig, parallel: ParallelConfig, *,
                 reference_offload: bool = False) -> None:
        """Raise ValueError naming the first invalid field and what would be valid."""
        if self.rank < 0:
            raise ValueError(f"lora.rank={self.rank}: need rank >= 1 (or 0: LoRA off)")
        if not self.enabled:
            return
        if self.refit not in ("auto", "adapter", "merged"):
            raise ValueError(f"lora.refit={self.refit!r}: choose auto, adapter or merged")
        if not self.alpha > 0:
            raise ValueError(f"lora.alpha={self.alpha} must be > 0 (the scale is alpha / rank)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout={self.dropout}: need 0 <= dropout < 1")
        if self.dropout > 0 and parallel.tp > 1:
            raise ValueError(
                f"lora.dropout={self.dropout} at parallel.tp={parallel.tp}: a column-parallel "
                "layer's input is replicated over the TP ranks and its dropout mask would have "
                "to agree between them, which is not arranged; set lora.dropout=0 or "
                "parallel.tp=1")
        self._validate_targets(model)
        self._validate_experts(model, parallel)
        if self.rank > (smallest := self._smallest_dim(model)):
            raise ValueError(
                f"lora.rank={self.rank} exceeds the smallest dimension ({smallest}) of a "
                f"targeted weight ({self.targets}): B A could not have that rank; use "
                f"lora.rank <= {smallest}")
        if reference_offload:
            raise ValueError(
                "reference.offload=true with lora.rank > 0: the reference is the policy with "
                "its adapters off, so there is no reference model to offload; set "
                "reference.offload=false")
        if parallel.transformer_impl == "transformer_engine":
            raise ValueError(
                "lora.rank > 0 with parallel.transformer_impl='transformer_engine': adapters sit "
                "beside megatron-core's local linears; set parallel.transformer_impl=local")

    def _validate_targets(self, model: ModelConfig) -> None:
        if not self.targets:
            raise ValueError(f"lora.targets is empty; use some of {LORA_TARGETS}")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown:
            raise ValueError(f"lora.targets holds {unknown}: unknown; use some of "
                             f"{LORA_TARGETS}")
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"lora.targets={self.targets} names a target twice")

    def _validate_experts(self, model: ModelConfig, parallel: ParallelConfig) -> None:
        """Expert adapters are built for megatron's SequentialMLP at expert TP = 1 only."""
        mlp = [t for t in self.targets if t in ("fc1", "fc2")]
        if model.is_moe and mlp and parallel.tp > 1:
            raise ValueError(
                f"lora.targets holds {mlp} on an MoE model at parallel.tp={parallel.tp}: "
                "adapters on experts split over expert tensor parallelism (whose TP "
                "communication megatron's token dispatcher does) are not built; use "
                "parallel.tp=1 (with parallel.ep for the experts), or lora.targets=[qkv, proj]")

    def rank_numel(self, model: ModelConfig, tp: int, layers: int | Iterable[int], *,
                   ep: int = 1) -> int:
        """Adapter elements one rank holds for `layers` (a count from layer 0, or the global
        indices of a stage's layers): per column-parallel target (qkv, fc1) r * in + out / tp *
        r, per row-parallel one (proj, fc2) r * in / tp + out * r (see megagrpo.lora.layers); an MoE
        layer's fc1 / fc2 once per routed expert of this EP rank (num_experts / ep, expert TP
        1) plus the shared expert; 0 when off."""
        if not self.enabled:
            return 0
        layers = range(layers) if isinstance(layers, int) else layers
        specs = [s for g in layers for s in layer_specs(model, g, 0, ep=ep, ep_rank=0)]
        return sum(adapter_numel(s, self.rank, tp) for s in adapted(specs, self.targets))

    def _smallest_dim(self, model: ModelConfig) -> int:
        """The narrowest side of any weight an adapter sits beside (the rank's upper bound)."""
        specs = param_specs(model, ParallelConfig(), 0)
        return min(d for s in adapted(specs, self.targets) for d in s.full_shape)
