"""The names and shapes an engine's weight update accepts (the HF checkpoint tensors of its
config) and the checked feed that hands them to vLLM's in-place reload: every (name, tensor) is
checked before vLLM sees it, and fused layers (q/k/v, gate/up) get all of their parts or none."""
from __future__ import annotations

import difflib
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch


def expected_hf_params(hf_config) -> tuple[dict[str, torch.Size], set[str]]:
    """Names and shapes of the HF checkpoint tensors for `hf_config`, read from the HF model
    built on the meta device (no memory). Returns (required, optional): tied output weights
    (`lm_head.weight` when tie_word_embeddings) are optional, since vLLM reuses the embedding."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    shapes = _checkpoint_shapes({name: t.shape for name, t in model.state_dict().items()})
    optional: set[str] = set()
    tied_keys = getattr(model, "_tied_weights_keys", None) or {}
    if getattr(hf_config, "tie_word_embeddings", False):
        optional |= {k for k in (tied_keys if isinstance(tied_keys, (list, dict, set)) else [])
                     if k in shapes}
        if "lm_head.weight" in shapes:
            optional.add("lm_head.weight")
    return shapes, optional


def _checkpoint_shapes(shapes: dict[str, torch.Size]) -> dict[str, torch.Size]:
    """transformers 5 holds an MoE layer's routed experts as 3D tensors (`mlp.experts.gate_up_proj`
    [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) but saves and loads checkpoints, and vLLM
    reads them, per expert (`mlp.experts.{e}.gate_proj.weight` [I, H], ...): the per-expert
    names."""
    out: dict[str, torch.Size] = {}
    for name, shape in shapes.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base, (E, two_i, H) = name[: -len("gate_up_proj")], shape
            for e in range(E):
                out[f"{base}{e}.gate_proj.weight"] = torch.Size((two_i // 2, H))
                out[f"{base}{e}.up_proj.weight"] = torch.Size((two_i // 2, H))
        elif name.endswith("mlp.experts.down_proj"):
            base, (E, H, inter) = name[: -len("down_proj")], shape
            for e in range(E):
                out[f"{base}{e}.down_proj.weight"] = torch.Size((H, inter))
        else:
            out[name] = shape
    return out


class _WeightFeed:
    """Checks each (name, tensor) from the source before vLLM sees it, and hands vLLM only
    whole fused groups (q/k/v, gate/up of one layer), so a feed stopped early leaves every vLLM
    layer either fully updated or untouched. On the first bad item it records the error and ends
    the stream cleanly (vLLM then finishes its reload and restores the layers it did not get)."""

    def __init__(self, source: Iterable[tuple[str, torch.Tensor]], shapes: dict[str, torch.Size],
                 optional: set[str], packed: Mapping[str, Sequence[str]]):
        self.source, self.shapes, self.optional, self.packed = source, shapes, optional, packed
        self.seen: set[str] = set()
        self.error: BaseException | None = None
        self.tensors = self.bytes = 0
        self.source_seconds = 0.0

    def check(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self.shapes:
            near = difflib.get_close_matches(name, list(self.shapes), n=1) or list(self.shapes)
            raise ValueError(f"update_weights: unknown parameter name {name!r} (not in the HF "
                             f"state dict of the engine's config; nearest: {near[0]!r})")
        if name in self.seen:
            raise ValueError(f"update_weights: parameter {name!r} given twice")
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise ValueError(f"update_weights: {name!r} must be a floating-point tensor")
        if tuple(tensor.shape) != tuple(self.shapes[name]):
            raise ValueError(f"update_weights: {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(self.shapes[name])}")
        self.seen.add(name)

    def _group(self, name: str) -> tuple[str, set[str]] | None:
        for fused, parts in self.packed.items():
            for part in parts:
                if f".{part}." in name:
                    members = {name.replace(f".{part}.", f".{p}.") for p in parts}
                    return name.replace(f".{part}.", f".{fused}."), members & self.shapes.keys()
        return None

    def _count(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        self.tensors += 1
        self.bytes += tensor.numel() * tensor.element_size()
        return name, tensor

    def _pull(self, it: Iterator[tuple[str, torch.Tensor]]) -> tuple[str, torch.Tensor] | None:
        t0 = time.perf_counter()
        try:
            return next(it)
        except StopIteration:
            return None
        finally:
            self.source_seconds += time.perf_counter() - t0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        pending: dict[str, dict[str, torch.Tensor]] = {}
        it = _pairs(self.source)
        try:
            while (item := self._pull(it)) is not None:
                name, tensor = item
                self.check(name, tensor)
                if name in self.optional:
                    continue  # tied to the embedding: vLLM does not load it
                group = self._group(name)
                if group is None:
                    yield self._count(name, tensor)
                    continue
                key, members = group
                pending.setdefault(key, {})[name] = tensor
                if pending[key].keys() == members:
                    for pair in pending.pop(key).items():
                        yield self._count(*pair)
            if pending:
                parts = sorted(n for group in pending.values() for n in group)
                raise ValueError(f"update_weights: fused layers got only some of their parts "
                                 f"(not loaded): {parts[:4]}")
        except Exception as exc:  # noqa: BLE001 - re-raised by update_weights after vLLM finishes
            self.error = exc

    def missing(self) -> list[str]:
        return sorted(self.shapes.keys() - self.optional - self.seen)


def _pairs(source: Iterable) -> Iterator[tuple[str, torch.Tensor]]:
    """Accept (name, tensor) pairs or buckets of them (lists, as iter_hf_weights yields)."""
    for item in source:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            yield item
        else:
            yield from item
