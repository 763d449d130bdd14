"""The weight sync's transforms: what happens to the weights between the source and the
transport. A transform may act on the stage's megatron parameters before they are streamed
(`parameters`: the LoRA merge W + s B A) and on the (HF name, tensor) pairs streamed
(`pairs`: a dtype cast; later a quantisation with scale tensors, a delta against what the
engine last received), and declares what it emits (`emits`), so what an engine's feed expects
is `megagrpo.config.params` plus the transforms' declarations (`expected_feed`), never a second
table. The default of each hook passes everything through unchanged.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from megagrpo.config.model import ModelConfig
from megagrpo.config.params import hf_shapes

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The dtypes a weight sync may carry, by their config names."""

Pairs = Iterator[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class TensorMeta:
    """What an engine's feed expects of one tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype


class Transform:
    """One step between the source and the transport (the hooks' defaults change nothing)."""

    def parameters(self, gpt: torch.nn.Module, params: Mapping[str, torch.Tensor]
                   ) -> Mapping[str, torch.Tensor]:
        """The stage's megatron parameters by local name, as the source should stream them."""
        return params

    def pairs(self, pairs: Pairs) -> Pairs:
        """The streamed (HF name, tensor) pairs, as the transport should deliver them."""
        return pairs

    def emits(self, expected: dict[str, TensorMeta]) -> dict[str, TensorMeta]:
        """What this transform's output holds, given what its input holds."""
        return expected


@dataclass(frozen=True)
class CastDtype(Transform):
    """Every streamed tensor cast to `dtype` (sync.dtype): an engine kept in another precision
    than training's, or fewer bytes on the wire."""

    dtype: torch.dtype

    def pairs(self, pairs: Pairs) -> Pairs:
        for name, tensor in pairs:
            yield name, tensor.to(self.dtype)

    def emits(self, expected: dict[str, TensorMeta]) -> dict[str, TensorMeta]:
        return {n: TensorMeta(m.shape, self.dtype) for n, m in expected.items()}


def expected_feed(model: ModelConfig, transforms: Sequence[Transform] = ()
                  ) -> dict[str, TensorMeta]:
    """HF name -> shape and dtype of every tensor a sync through `transforms` delivers: the HF
    checkpoint's tensors in the model's dtype (`megagrpo.config.params.hf_shapes`), then each
    transform's declaration in order."""
    dtype = DTYPES[model.dtype]
    out = {n: TensorMeta(tuple(s), dtype) for n, s in hf_shapes(model).items()}
    for t in transforms:
        out = t.emits(out)
    return out


__all__ = ["DTYPES", "CastDtype", "TensorMeta", "Transform", "expected_feed"]
