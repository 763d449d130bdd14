"""Model architecture and parallel layout."""
from __future__ import annotations

from dataclasses import dataclass, field

from megagrpo.config.section import Section

ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "qwen2_5_vl")
VLM_ARCHITECTURES = ("qwen2_5_vl",)
"""Vision-language families: a vision tower + merger (`model.vision`) feeding the decoder's
input embeddings at the image-pad tokens, and multimodal (3-D) RoPE (`model.mrope_section`)."""
QK_NORM_ARCHITECTURES = ("qwen3", "qwen3_moe")
MOE_ARCHITECTURES = ("qwen3_moe", "qwen2_moe")
"""Mixture-of-experts families: routed experts (megatron-core's MoE layer); qwen2_moe adds a
shared expert behind a sigmoid gate."""
"""Families with an RMSNorm over each query and key head before RoPE (HF q_norm / k_norm)."""
ROPE_TYPES = ("default", "llama3")
MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}
"""What megatron-core's llama3 RoPE scaling hard-codes (only `factor` is an argument of
GPTModel, up to 0.19): Llama-3.1, 3.2 and 3.3 all use these values. Others are refused."""
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(kw_only=True)
class VisionConfig(Section):
    """Qwen2.5-VL's vision tower and patch merger (HF `vision_config`): a ViT over
    temporal_patch_size x patch_size x patch_size patches with 2-D RoPE, window attention except
    in the full-attention blocks, and a merger (RMSNorm + 2-layer GELU MLP) from each
    spatial_merge_size^2 patches to one token of the decoder's width."""

    depth: int = 2
    """Vision transformer blocks."""
    hidden_size: int = 32
    """Vision width."""
    intermediate_size: int = 64
    """Vision SwiGLU inner width."""
    num_heads: int = 2
    """Vision attention heads (head_dim = hidden_size / num_heads)."""
    in_channels: int = 3
    """Image channels."""
    patch_size: int = 14
    """Spatial patch side in pixels."""
    temporal_patch_size: int = 2
    """Frames per patch (an image is repeated to fill them)."""
    spatial_merge_size: int = 2
    """The merger joins spatial_merge_size x spatial_merge_size patches into one token."""
    window_size: int = 112
    """Window-attention side in pixels."""
    out_hidden_size: int = 64
    """The merger's output width: the decoder's hidden_size."""
    fullatt_block_indexes: list[int] = field(default_factory=list)
    """Blocks with full (not windowed) attention."""
    tokens_per_second: int = 4
    """Temporal position step per second of video (HF's; images do not use it)."""
    rope_theta: float = 10000.0
    """The vision 2-D RoPE base."""

    def validate(self, text_hidden: int) -> None:
        for f in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels",
                  "patch_size", "temporal_patch_size", "spatial_merge_size", "window_size"):
            if getattr(self, f) <= 0:
                raise ValueError(f"model.vision.{f}={getattr(self, f)} must be positive")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"model.vision.num_heads={self.num_heads} must divide "
                             f"model.vision.hidden_size={self.hidden_size}")
        if self.out_hidden_size != text_hidden:
            raise ValueError(f"model.vision.out_hidden_size={self.out_hidden_size} must equal "
                             f"model.hidden_size={text_hidden} (the merger writes decoder "
                             "input embeddings)")
        bad = [i for i in self.fullatt_block_indexes if not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"model.vision.fullatt_block_indexes holds {bad}: block indices "
                             f"are 0..{self.depth - 1}")


@dataclass(kw_only=True)
class ModelConfig(Section):
    """A dense Llama/Qwen-style decoder: RMSNorm, SwiGLU, RoPE, GQA."""

    architecture: str = "llama"
    """'llama', 'qwen2' (llama + QKV bias), 'qwen3' (llama + per-head RMSNorm of queries and
    keys, q_norm / k_norm; head_dim may differ from hidden_size / heads), 'qwen3_moe' (qwen3
    with routed experts) or 'qwen2_moe' (qwen2 with routed experts and a gated shared expert)."""
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
    num_experts: int = 0
    """Routed experts per MoE layer (HF num_experts); 0 for a dense model."""
    moe_topk: int = 2
    """Experts each token is routed to (HF num_experts_per_tok)."""
    moe_ffn_hidden_size: int = 0
    """SwiGLU inner width of one routed expert (HF moe_intermediate_size)."""
    moe_norm_topk_prob: bool = True
    """Renormalise the top-k routing probabilities to sum to 1 (HF norm_topk_prob; Qwen3-MoE:
    true, Qwen2-MoE: false = softmax over all experts, top-k kept as they are)."""
    moe_sparse_step: int = 1
    """Every moe_sparse_step-th layer is an MoE layer (HF decoder_sparse_step)."""
    moe_dense_layers: list[int] = field(default_factory=list)
    """Layer indices with a dense MLP (ffn_hidden_size) instead of experts (HF mlp_only_layers)."""
    shared_expert_ffn_hidden_size: int = 0
    """qwen2_moe: width of the shared expert every token goes through, scaled by a sigmoid gate
    (HF shared_expert_intermediate_size); 0: none."""
    moe_aux_loss_coef: float = 0.001
    """Load-balancing auxiliary loss coefficient in HF's form (router_aux_loss_coef: one loss
    over all MoE layers; 0 turns it off). megatron gets coef x moe_topk / (MoE layers) per
    layer, the same router gradient for routing alike in every layer (docs/usage.md)."""
    moe_z_loss_coef: float = 0.0
    """Router z-loss coefficient (0: off)."""
    max_position_embeddings: int = 2048
    """Longest sequence the model is built for."""
    init_std: float = 0.02
    """Std of the normal init for freshly initialised weights."""
    dtype: str = "float32"
    """Parameter dtype: float32, bfloat16 or float16."""
    vision: VisionConfig | None = None
    """qwen2_5_vl: the vision tower and merger (HF vision_config); None for text-only models."""
    freeze_vision: bool = True
    """qwen2_5_vl: the vision tower and merger stay as loaded (no gradients, no optimizer
    state); false trains them with the decoder."""
    mrope_section: list[int] = field(default_factory=list)
    """qwen2_5_vl: multimodal RoPE, how many of the head_dim/2 rotary frequencies follow the
    temporal, height and width position (HF rope_parameters.mrope_section; sums to
    head_dim/2); empty for 1-D RoPE."""
    image_token_id: int = -1
    """qwen2_5_vl: the image-pad token, one per merged image patch (HF image_token_id)."""
    video_token_id: int = -1
    """qwen2_5_vl: the video-pad token (HF video_token_id; video input is not implemented)."""
    vision_start_token_id: int = -1
    """qwen2_5_vl: the token before an image's pads (HF vision_start_token_id)."""
    vision_end_token_id: int = -1
    """qwen2_5_vl: the token after an image's pads (HF vision_end_token_id)."""

    @property
    def qk_norm(self) -> bool:
        """Whether queries and keys get a per-head RMSNorm before RoPE (the architecture's)."""
        return self.architecture in QK_NORM_ARCHITECTURES

    @property
    def is_vlm(self) -> bool:
        """A vision-language family (vision tower + merger, multimodal RoPE)."""
        return self.architecture in VLM_ARCHITECTURES

    @property
    def is_moe(self) -> bool:
        """A mixture-of-experts family (routed experts in the MoE layers)."""
        return self.architecture in MOE_ARCHITECTURES

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer `layer` (0-based) routes to experts (HF's rule: not in
        mlp_only_layers, and (layer + 1) divisible by decoder_sparse_step)."""
        return (self.is_moe and layer not in self.moe_dense_layers
                and (layer + 1) % self.moe_sparse_step == 0)

    @property
    def moe_layer_pattern(self) -> list[int]:
        """1 for an MoE layer, 0 for a dense one, per layer (megatron's moe_layer_freq list)."""
        return [int(self.is_moe_layer(i)) for i in range(self.num_layers)]

    def validate(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"model.architecture={self.architecture!r} is not supported; "
                f"use one of {ARCHITECTURES}"
            )
        if self.qkv_bias and self.architecture in ("qwen3", "qwen3_moe"):
            family = "Qwen3" if self.architecture == "qwen3" else "Qwen3-MoE"
            raise ValueError(f"model.qkv_bias=true: {family} has no QKV bias (set it false, or "
                             "model.architecture=qwen2)")
        self._validate_moe()
        self._validate_rope()
        self._validate_vlm()
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

    def _validate_vlm(self) -> None:
        if not self.is_vlm:
            fields = [f for f in ("vision", "mrope_section") if getattr(self, f)]
            if fields:
                raise ValueError(f"model.{fields[0]} is set but model.architecture="
                                 f"{self.architecture!r} is text-only; use one of "
                                 f"{VLM_ARCHITECTURES} or leave model.{fields[0]} unset")
            return
        if self.vision is None:
            raise ValueError(f"model.vision is missing: model.architecture="
                             f"{self.architecture!r} needs the vision tower's settings (read "
                             "from config.json's vision_config)")
        self.vision.validate(self.hidden_size)
        if len(self.mrope_section) != 3 or sum(self.mrope_section) != self.head_dim // 2:
            raise ValueError(f"model.mrope_section={self.mrope_section}: three sizes "
                             "(temporal, height, width) summing to head_dim/2 = "
                             f"{self.head_dim // 2} are needed")
        for f in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
            if not 0 <= getattr(self, f) < self.vocab_size:
                raise ValueError(f"model.{f}={getattr(self, f)} must be a token id in "
                                 f"0..{self.vocab_size - 1}")
        if self.rope_type != "default":
            raise ValueError(f"model.rope_type={self.rope_type!r}: multimodal RoPE is built on "
                             "the default frequencies only; set rope_type=default")

    def _validate_moe(self) -> None:
        if not self.is_moe:
            if self.num_experts:
                raise ValueError(f"model.num_experts={self.num_experts} with the dense "
                                 f"architecture {self.architecture!r}: use one of "
                                 f"{MOE_ARCHITECTURES} for experts, or num_experts=0")
            return
        if self.num_experts < 2:
            raise ValueError(f"model.num_experts={self.num_experts}: model.architecture="
                             f"{self.architecture!r} routes to experts; set num_experts >= 2")
        if not 1 <= self.moe_topk <= self.num_experts:
            raise ValueError(f"model.moe_topk={self.moe_topk} must be in 1..model.num_experts="
                             f"{self.num_experts}")
        if self.moe_ffn_hidden_size <= 0:
            raise ValueError(f"model.moe_ffn_hidden_size={self.moe_ffn_hidden_size} must be "
                             "positive (HF moe_intermediate_size)")
        if self.moe_sparse_step < 1:
            raise ValueError(f"model.moe_sparse_step={self.moe_sparse_step} must be >= 1")
        bad = [i for i in self.moe_dense_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"model.moe_dense_layers holds {bad}: layer indices are "
                             f"0..{self.num_layers - 1}")
        if self.shared_expert_ffn_hidden_size and self.architecture != "qwen2_moe":
            raise ValueError("model.shared_expert_ffn_hidden_size: only qwen2_moe has a shared "
                             "expert; set it to 0")
        if self.architecture == "qwen2_moe" and self.shared_expert_ffn_hidden_size <= 0:
            raise ValueError("model.shared_expert_ffn_hidden_size must be positive for qwen2_moe "
                             "(HF shared_expert_intermediate_size)")
        for f in ("moe_aux_loss_coef", "moe_z_loss_coef"):
            if getattr(self, f) < 0:
                raise ValueError(f"model.{f}={getattr(self, f)} must be >= 0")

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
class ParallelConfig(Section):
    """How the policy (and the reference, which shares the layout) is sharded."""

    tp: int = 1
    """Tensor-parallel size: divides heads, KV groups and FFN width."""
    pp: int = 1
    """Pipeline-parallel size: divides the number of layers."""
    ep: int = 1
    """Expert-parallel size (MoE models): each rank holds num_experts / ep routed experts.
    megatron's layout: the EP groups are carved out of the data-parallel ranks (DP x EP), so
    ep divides the DP size; each expert is split over the TP ranks like a dense MLP (expert
    tensor parallelism = tp)."""
    sequence_parallel: bool | None = None
    """Sequence parallelism (megatron-core's, tp > 1): the norms, residuals and the MoE token
    dispatch work on [S/tp, b, h], each TP rank on its own slice of the sequence, so the
    experts see every token once (without it every TP rank routes all tokens: tp x the expert
    compute) and the load-balancing and z-losses act at full strength. Micro-batches are
    padded to a multiple of tp (a packed one's stream of rows with tokens of no row, left out
    of attention, loss and load-balancing loss); pipeline parallelism and routing replay are
    refused. None (auto): on for mixture-of-experts models at tp > 1 where it runs (pp = 1,
    cp = 1, no routing replay, compute.compile_layers not set true), off for dense models (it
    saves activation memory at the same communication volume but measured no faster packed at
    TP=2 on the CPU: benchmarks/results/dense_sp_packed_epyc_cpu.jsonl); the
    console says which and why (`megagrpo.config.seqpar.sequence_parallel_auto`)."""
    cp: int = 1
    """Context-parallel size: each sequence is split over cp ranks (2*cp load-balanced chunks,
    rank r holding chunks r and 2*cp-1-r), which attend to the whole sequence's keys and values
    (all-gathered over the CP group); the weights are replicated over CP like over DP, and DP =
    world / (tp x pp x cp). On CPU megagrpo's SDPA attention computes it (padded or packed
    rows, each packed row cut into its own chunks; pp = 1, dense models; routing replay and
    sequence parallelism refused). 1 = off."""
    make_vocab_size_divisible_by: int = 128
    """The padded vocab is a multiple of this times tp (padding is stripped on export)."""
    transformer_impl: str = "auto"
    """'auto' (Transformer Engine when it imports, else local), 'local' or 'transformer_engine'."""
    attention_impl: str = "auto"
    """Local-spec core attention: 'auto' (= sdpa), 'sdpa' (torch's fused SDPA) or 'megatron'."""
    backend: str = "auto"
    """torch.distributed backend: 'auto' or 'nccl' (with CUDA: NCCL for CUDA tensors, gloo for
    CPU ones; 'auto' without CUDA: gloo) or 'gloo'."""
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
        self._validate_ep(model)
        self._validate_vlm(model)
        self._validate_sequence_parallel()
        self._validate_cp(model)
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
        mp = self.tp * self.pp * self.cp
        if world_size is not None and world_size % mp:
            names, sizes = ("parallel.tp x parallel.pp", f"{self.tp} x {self.pp}")
            if self.cp > 1:
                names, sizes = names + " x parallel.cp", sizes + f" x {self.cp}"
            raise ValueError(
                f"world size {world_size} is not divisible by {names} = {sizes}; launch a "
                f"multiple of {mp} processes"
            )
        if world_size is not None and (world_size // mp) % self.ep:
            dp = world_size // mp
            raise ValueError(
                f"parallel.ep={self.ep} does not divide the data-parallel size {dp} (world "
                f"{world_size} / (tp {self.tp} x pp {self.pp})): megatron carves the expert-"
                f"parallel groups out of the DP ranks; launch a multiple of "
                f"{self.tp * self.pp * self.ep} processes, or lower parallel.ep")

    def _validate_vlm(self, model: ModelConfig) -> None:
        """A vision-language model runs at pp = 1, cp = 1, without sequence parallelism: the
        vision tower sits beside the first stage's embedding and its features are written
        into whole (unsplit) sequences of input embeddings."""
        if not model.is_vlm:
            return
        for f, value, ok in (("pp", self.pp, 1), ("cp", self.cp, 1)):
            if value != ok:
                raise ValueError(f"parallel.{f}={value} with model.architecture="
                                 f"{model.architecture!r}: the vision-language model runs at "
                                 f"{f}=1 only so far (docs/vlm.md); set parallel.{f}=1")
        if self.sequence_parallel:
            raise ValueError(f"parallel.sequence_parallel=true with model.architecture="
                             f"{model.architecture!r}: the image features are written into "
                             "whole sequences; set parallel.sequence_parallel=false")

    def _validate_cp(self, model: ModelConfig) -> None:
        """The layout's part: cp >= 1; cp > 1 only with pp = 1, a dense model, no sequence
        parallelism and megagrpo's SDPA attention on the local spec."""
        cp = self.cp
        if cp < 1:
            raise ValueError(f"parallel.cp={cp} must be >= 1 (1 = no context parallelism)")
        if cp == 1:
            return
        refusals = (
            (self.pp > 1, f"parallel.pp={self.pp}: the chunked sequences are not passed "
                          "between pipeline stages; set parallel.pp=1"),
            (model.is_moe, f"model.architecture={model.architecture!r} (mixture of experts): "
                           "the router's load-balancing statistics are not reduced over CP; "
                           "use a dense model"),
            (self.sequence_parallel, "parallel.sequence_parallel=true: not combined with "
                                     "context parallelism yet; set sequence_parallel=false"),
            (self.attention_impl == "megatron", "parallel.attention_impl='megatron': its "
                                                "DotProductAttention has no context-parallel "
                                                "path; set attention_impl=auto or sdpa"),
            (self.transformer_impl == "transformer_engine",
             "parallel.transformer_impl='transformer_engine': Transformer Engine's context-"
             "parallel attention is not wired in; set transformer_impl=local"),
        )
        for refused, why in refusals:
            if refused:
                raise ValueError(f"parallel.cp={cp} with {why}")

    def _validate_sequence_parallel(self) -> None:
        if not self.sequence_parallel:
            return
        if self.tp == 1:
            raise ValueError("parallel.sequence_parallel=true needs parallel.tp > 1 (it splits "
                             "the sequence over the TP ranks); set sequence_parallel=false")
        if self.pp > 1:
            raise ValueError(f"parallel.sequence_parallel=true with parallel.pp={self.pp}: "
                             "megagrpo pads micro-batches to a multiple of tp only at pp = 1; "
                             "set parallel.pp=1 or sequence_parallel=false")

    def _validate_ep(self, model: ModelConfig) -> None:
        if self.ep < 1:
            raise ValueError(f"parallel.ep={self.ep} must be >= 1")
        if not model.is_moe:
            if self.ep > 1:
                raise ValueError(f"parallel.ep={self.ep}: expert parallelism needs a mixture-"
                                 f"of-experts model, and model.architecture="
                                 f"{model.architecture!r} is dense; set parallel.ep=1")
            return
        if model.num_experts % self.ep:
            ok = [d for d in range(1, model.num_experts + 1) if model.num_experts % d == 0]
            raise ValueError(f"parallel.ep={self.ep} does not divide model.num_experts="
                             f"{model.num_experts}; valid ep: {ok}")
        for f in ("moe_ffn_hidden_size", "shared_expert_ffn_hidden_size"):
            n = getattr(model, f)
            if n % self.tp:
                ok = [d for d in range(1, n + 1) if n % d == 0]
                raise ValueError(f"parallel.tp={self.tp} does not divide model.{f}={n} (each "
                                 f"expert is split over the TP ranks); valid tp: {ok}")

    def stage_size(self, num_layers: int) -> int:
        """Layers one pipeline stage holds: megatron-core's even split (`validate` checks that
        pp divides num_layers); `megagrpo.config.params.stage_layers` says which."""
        return num_layers // max(self.pp, 1)

    def padded_vocab_size(self, vocab_size: int) -> int:
        """Vocab padded so that every TP rank holds an equal slice."""
        m = self.make_vocab_size_divisible_by * self.tp
        return -(-vocab_size // m) * m
