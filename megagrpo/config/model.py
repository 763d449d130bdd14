"""Model architecture and parallel layout."""
from __future__ import annotations

from dataclasses import dataclass

ARCHITECTURES = ("llama", "qwen2", "qwen3")
QK_NORM_ARCHITECTURES = ("qwen3",)
"""Families with an RMSNorm over each query and key head before RoPE (HF q_norm / k_norm)."""
ROPE_TYPES = ("default", "llama3")
MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}
"""What megatron-core's llama3 RoPE scaling hard-codes (only `factor` is an argument of
GPTModel, up to 0.19): Llama-3.1, 3.2 and 3.3 all use these values. Others are refused."""
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(kw_only=True)
class ModelConfig:
    """A dense Llama/Qwen-style decoder: RMSNorm, SwiGLU, RoPE, GQA."""

    architecture: str = "llama"
    """'llama', 'qwen2' (llama + QKV bias) or 'qwen3' (llama + per-head RMSNorm of queries and
    keys, q_norm / k_norm; head_dim may differ from hidden_size / heads)."""
    vocab_size: int = 128
    """Tokenizer vocabulary size (unpadded; padding for TP is derived)."""
    hidden_size: int = 128
    """Model width H."""
    ffn_hidden_size: int = 256
    """SwiGLU inner width (HF intermediate_size)."""
    num_layers: int = 2
    """Number of transformer layers."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: int = 2
    """Key/value heads (GQA groups; HF num_key_value_heads)."""
    head_dim: int = 32
    """Per-head width (vLLM's CPU attention supports 32, 64, 80, 96, 112, 128, ...)."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_type: str = "default"
    """RoPE frequencies: 'default', or 'llama3' (Llama-3.1+ scaling; HF rope_parameters)."""
    rope_factor: float = 8.0
    """llama3 RoPE: `factor` (8 for Llama-3.1/3.3, 32 for Llama-3.2 1B/3B)."""
    rope_low_freq_factor: float = 1.0
    """llama3 RoPE: `low_freq_factor` (megatron-core implements 1 only)."""
    rope_high_freq_factor: float = 4.0
    """llama3 RoPE: `high_freq_factor` (megatron-core implements 4 only)."""
    rope_original_max_position_embeddings: int = 8192
    """llama3 RoPE: `original_max_position_embeddings` (megatron-core implements 8192 only)."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    qkv_bias: bool = False
    """Bias on the QKV projection (Qwen2)."""
    tie_word_embeddings: bool = False
    """Share the input embedding with the output layer."""
    max_position_embeddings: int = 2048
    """Longest sequence the model is built for."""
    init_std: float = 0.02
    """Std of the normal init for freshly initialised weights."""
    dtype: str = "float32"
    """Parameter dtype: float32, bfloat16 or float16."""

    @property
    def qk_norm(self) -> bool:
        """Whether queries and keys get a per-head RMSNorm before RoPE (the architecture's)."""
        return self.architecture in QK_NORM_ARCHITECTURES

    def validate(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"model.architecture={self.architecture!r} is not supported; "
                f"use one of {ARCHITECTURES}"
            )
        if self.qkv_bias and self.architecture == "qwen3":
            raise ValueError("model.qkv_bias=true: Qwen3 has no QKV bias (set it false, or "
                             "model.architecture=qwen2)")
        self._validate_rope()
        if self.dtype not in DTYPES:
            raise ValueError(f"model.dtype={self.dtype!r}: use one of {DTYPES}")
        for f in ("vocab_size", "hidden_size", "ffn_hidden_size", "num_layers",
                  "num_attention_heads", "num_query_groups", "head_dim"):
            if getattr(self, f) <= 0:
                raise ValueError(f"model.{f}={getattr(self, f)} must be positive")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"model.num_query_groups={self.num_query_groups} must divide "
                f"model.num_attention_heads={self.num_attention_heads}"
            )


    def _validate_rope(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"model.rope_type={self.rope_type!r} is not supported; use one of "
                             f"{ROPE_TYPES}")
        if self.rope_type != "llama3":
            return
        if not self.rope_factor >= 1.0:
            raise ValueError(f"model.rope_factor={self.rope_factor}: llama3 RoPE scaling needs "
                             "a factor >= 1 (Llama-3.1: 8)")
        for key, want in MEGATRON_LLAMA3_ROPE.items():
            got = getattr(self, f"rope_{key}")
            if got != want:
                raise ValueError(
                    f"model.rope_{key}={got}: megatron-core's llama3 RoPE scaling hard-codes "
                    f"{key}={want:g} (the value of Llama-3.1/3.2/3.3); other values are not "
                    "supported")


@dataclass(kw_only=True)
class ParallelConfig:
    """How the policy (and the reference, which shares the layout) is sharded."""

    tp: int = 1
    """Tensor-parallel size: divides heads, KV groups and FFN width."""
    pp: int = 1
    """Pipeline-parallel size: divides the number of layers."""
    make_vocab_size_divisible_by: int = 128
    """The padded vocab is a multiple of this times tp (padding is stripped on export)."""
    transformer_impl: str = "auto"
    """'auto' (Transformer Engine when it imports, else local), 'local' or 'transformer_engine'."""
    attention_impl: str = "auto"
    """Local-spec core attention: 'auto' (= sdpa), 'sdpa' (torch's fused SDPA) or 'megatron'."""
    backend: str = "auto"
    """torch.distributed backend: 'auto' (nccl with CUDA, gloo without), 'nccl' or 'gloo'."""
    collective_timeout_s: float = 600.0
    """A collective (or a new group's connect) waiting longer raises; all groups, megatron's too."""

    def validate(self, model: ModelConfig, world_size: int | None = None) -> None:
        """Checks the layout against the model (and the world size when given)."""
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"parallel.tp={self.tp} and parallel.pp={self.pp} must be >= 1")
        tp = self.tp
        for f, n in (("num_attention_heads", model.num_attention_heads),
                     ("num_query_groups", model.num_query_groups),
                     ("ffn_hidden_size", model.ffn_hidden_size)):
            if n % tp:
                ok = [d for d in range(1, n + 1) if n % d == 0]
                raise ValueError(f"parallel.tp={tp} does not divide model.{f}={n}; valid tp: {ok}")
        if model.num_layers % self.pp:
            ok = [d for d in range(1, model.num_layers + 1) if model.num_layers % d == 0]
            raise ValueError(
                f"parallel.pp={self.pp} does not divide model.num_layers={model.num_layers}; "
                f"valid pp: {ok}"
            )
        if self.transformer_impl not in ("auto", "local", "transformer_engine"):
            raise ValueError(
                f"parallel.transformer_impl={self.transformer_impl!r}: use auto, local or "
                "transformer_engine"
            )
        if self.attention_impl not in ("auto", "sdpa", "megatron"):
            raise ValueError(f"parallel.attention_impl={self.attention_impl!r}: use auto, sdpa "
                             "or megatron")
        if self.attention_impl == "sdpa" and self.transformer_impl == "transformer_engine":
            raise ValueError("parallel.attention_impl='sdpa' replaces the local spec's attention; "
                             "with transformer_impl='transformer_engine' use attention_impl="
                             "'auto' (Transformer Engine's own attention)")
        if self.backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"parallel.backend={self.backend!r}: use auto, nccl or gloo")
        if not 0 < self.collective_timeout_s < float("inf"):
            raise ValueError(f"parallel.collective_timeout_s={self.collective_timeout_s}: need a "
                             "finite number of seconds > 0 (default 600)")
        if world_size is not None and world_size % (self.tp * self.pp):
            raise ValueError(
                f"world size {world_size} is not divisible by parallel.tp x parallel.pp = "
                f"{self.tp} x {self.pp}; launch a multiple of {self.tp * self.pp} processes"
            )

    def padded_vocab_size(self, vocab_size: int) -> int:
        """Vocab padded so that every TP rank holds an equal slice."""
        m = self.make_vocab_size_divisible_by * self.tp
        return -(-vocab_size // m) * m
