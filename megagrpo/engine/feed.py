"""The names and shapes an engine's weight update accepts (the HF checkpoint tensors of its
config) and the checked feed that hands them to vLLM's in-place reload: every (name, tensor) is
checked before vLLM sees it, and fused layers (q/k/v, gate/up) get all of their parts or none."""
from __future__ import annotations

import difflib
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch


def expected_hf_params(hf_config) -> tuple[dict[str, torch.Size], set[str]]:
    """Names and shapes of the HF checkpoint tensors for `hf_config` (a transformers config),
    derived from megagrpo's parameter layout (`megagrpo.config.params.vllm_feed_shapes`). Returns
    (required, optional): tied output weights (`lm_head.weight` when tie_word_embeddings) are
    optional, since vLLM reuses the embedding."""
    from megagrpo.config.params import vllm_feed_shapes
    from megagrpo.hf.config import MODEL_TYPES, model_config_from_hf_dict

    cfg = hf_config.to_dict()
    if not cfg.get("architectures") and cfg.get("model_type") in MODEL_TYPES:
        cfg["architectures"] = [MODEL_TYPES[cfg["model_type"]]]  # a config built in memory
    model = model_config_from_hf_dict(cfg, f"{type(hf_config).__name__}")
    shapes, optional = vllm_feed_shapes(model)
    return {name: torch.Size(shape) for name, shape in shapes.items()}, optional


class _WeightFeed:
    """Checks each (name, tensor) from the source before vLLM sees it, and hands vLLM only
    whole fused groups (q/k/v, gate/up of one layer), so a feed stopped early leaves every vLLM
    layer either fully updated or untouched. On the first bad item it records the error and ends
    the stream cleanly (vLLM then finishes its reload and restores the layers it did not get).
    `dtypes`: what the sender declared it emits, name by name (`megagrpo.sync`'s transforms);
    a tensor of another dtype, or one it did not declare, is refused."""

    def __init__(self, source: Iterable[tuple[str, torch.Tensor]], shapes: dict[str, torch.Size],
                 optional: set[str], packed: Mapping[str, Sequence[str]],
                 dtypes: Mapping[str, torch.dtype] | None = None):
        self.source, self.shapes, self.optional, self.packed = source, shapes, optional, packed
        self.dtypes = dtypes
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
        if self.dtypes is not None and self.dtypes.get(name) != tensor.dtype:
            declared = self.dtypes.get(name, "nothing: the sync did not declare it")
            raise ValueError(f"update_weights: {name!r} arrived as {tensor.dtype}; the sync "
                             f"declared {declared} (a transform's `emits` and `pairs` disagree)")
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
