"""Builds the policy (and reference) as a megatron-core `GPTModel` for Llama/Qwen2/Qwen3 configs
(Qwen2.5-VL: the subclass of `megagrpo.model.vlm`, with multimodal RoPE and the vision tower).

Transformer Engine's layer spec is used when TE imports (GPU machines), megatron-core's local
spec otherwise; `layer_spec_name()` says which one runs. All fusions are off on CPU. On the local
spec, `parallel.attention_impl` puts `megagrpo.parallel.attention.SdpaAttention` (torch's fused
SDPA) or megatron's DotProductAttention in the `core_attention` slot; `attention_impl_name()` says
which.
"""
from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F

from megagrpo.config.model import ModelConfig, ParallelConfig
from megagrpo.config.seqpar import megatron_aux_loss_coeff, recompute_fields
from megagrpo.config.train import packing_blocker
from megagrpo.model.vlm import vlm_class
from megagrpo.runtime import rng
from megagrpo.runtime.cpu_compat import megatron_scope

log = logging.getLogger("megagrpo")

DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@functools.lru_cache(maxsize=1)
def transformer_engine_available() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # TE raises various errors without CUDA (see FINDINGS.md)
        return False
    return torch.cuda.is_available()


def layer_spec_name(parallel: ParallelConfig) -> str:
    """'transformer_engine' or 'local': the layer implementation this machine runs."""
    if parallel.transformer_impl == "transformer_engine":
        if not transformer_engine_available():
            raise RuntimeError(
                "parallel.transformer_impl='transformer_engine' but transformer_engine does not "
                "import here; use 'auto' or 'local'"
            )
        return "transformer_engine"
    if parallel.transformer_impl == "local":
        return "local"
    return "transformer_engine" if transformer_engine_available() else "local"


def attention_impl_name(parallel: ParallelConfig) -> str:
    """The core attention that runs: 'transformer_engine' (TE spec, unchanged), 'sdpa' (torch's
    fused kernel, `megagrpo.parallel.attention`) or 'megatron' (the local spec's
    DotProductAttention)."""
    if layer_spec_name(parallel) == "transformer_engine":
        if parallel.attention_impl == "sdpa":
            raise RuntimeError(
                "parallel.attention_impl='sdpa' replaces the local spec's attention, but this "
                "machine runs Transformer Engine's spec; use attention_impl='auto', or "
                "transformer_impl='local'"
            )
        return "transformer_engine"
    # auto = sdpa: never slower than megatron's beyond noise in benchmarks/attention.py (equal at
    # S=13, a few % faster at S~100 in fp32), and it never holds [b, heads, S, S] scores
    return "megatron" if parallel.attention_impl == "megatron" else "sdpa"


def sequence_packing(compute, parallel: ParallelConfig) -> bool:
    """Whether micro-batches are packed end to end (compute.pack_sequences; unset: wherever the
    packed path runs: pp = 1, torch SDPA attention, loss-position logits, trimmed micro-batches
    with a token budget, and cp = 1: under context parallelism packing runs when set, but is
    not measured to pay there). TrainConfig.validate refuses the explicit settings that cannot
    run; Transformer Engine's spec is only known here."""
    can = packing_blocker(compute, parallel) is None and attention_impl_name(parallel) == "sdpa"
    if compute.pack_sequences and not can:
        raise ValueError("compute.pack_sequences=true: packed micro-batches run through "
                         "megagrpo's SDPA attention, but attention here is "
                         f"{attention_impl_name(parallel)!r}"
                         "; set compute.pack_sequences=false")
    if compute.pack_sequences is None:
        return can and parallel.cp == 1
    return compute.pack_sequences


def _layer_spec(model: ModelConfig, parallel: ParallelConfig, config=None):
    """The layer spec (dense) or the decoder block spec (MoE: one spec per layer of this
    pipeline stage, dense or MoE as `model.moe_layer_pattern` says; megatron's own builder)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.spec_utils import ModuleSpec

    te = layer_spec_name(parallel) == "transformer_engine"
    if model.is_moe:
        block = specs.get_gpt_decoder_block_spec(config, use_transformer_engine=te,
                                                 normalization="RMSNorm")
        layers = block.layer_specs
    elif te:
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=model.qk_norm)
    else:
        # qk_layernorm: an RMSNorm of width head_dim on each query / key head, after the QKV
        # split and before RoPE, as Qwen3's q_norm / k_norm
        block = specs.get_gpt_layer_local_spec(normalization="RMSNorm",
                                               qk_layernorm=model.qk_norm)
        layers = [block]
    if parallel.sequence_parallel and not te:  # norms whose weight grads TP sums
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

        from megagrpo.parallel.seqpar import sequence_parallel_norms

        if not model.is_moe:  # a block spec, so that the final norm is ours too (pp = 1)
            block = TransformerBlockSubmodules(layer_specs=[block] * model.num_layers)
        sequence_parallel_norms(layers, block)
    if attention_impl_name(parallel) == "sdpa":
        from megagrpo.parallel.attention import SdpaAttention

        for spec in layers:
            spec.submodules.self_attention.submodules.core_attention = \
                ModuleSpec(module=SdpaAttention)
    return block


def _moe_layer_class():
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return MoELayer


@functools.lru_cache(maxsize=1)
def _moe_layer_without_sp():
    """megatron's MoELayer, allowed to train at TP > 1 without sequence parallelism.

    megatron-core 0.16 raises in `MoELayer.forward` when training with TP and no sequence
    parallelism ("performance may degrade"). With replicated activations the token dispatcher
    gathers every TP rank's (identical) copy of the tokens, each expert TP shard computes on
    all tp copies, and the reduce-scatter hands each rank the full sum for its own copy: the
    output and the input gradient are right, but each routed expert's weight gradient sums tp
    identical copies (measured: exactly 2x at TP=2), which `_divide_expert_grads_by_tp`
    undoes; the experts do tp times their FLOPs, and megatron's load-balancing and z-losses
    (which divide over the TP ranks, assuming each holds different tokens) reach the router
    at 1/tp of their strength. With parallel.sequence_parallel none of this applies (each TP
    rank routes its own tokens) and the layer is megatron's own; without it the guard is
    stepped over (the layer's own `training` flag is read nowhere else in its forward; the
    router and experts keep theirs)."""
    base = _moe_layer_class()

    class MoELayerWithoutSequenceParallel(base):
        def forward(self, *args, **kwargs):
            training, self.training = self.training, False
            try:
                return super().forward(*args, **kwargs)
            finally:
                self.training = training

    return MoELayerWithoutSequenceParallel


def _divide_expert_grads_by_tp(gpt: torch.nn.Module, tp: int) -> None:
    """Scales each routed expert's weight gradient by 1/tp before it is accumulated (see
    `_moe_layer_without_sp`); the shared expert, the router and every dense weight see each
    token once and are left alone."""
    for name, p in gpt.named_parameters():
        if ".mlp.experts." in name and p.requires_grad:
            p.register_hook(functools.partial(torch.mul, other=1.0 / tp))


def _moe_fields(model: ModelConfig, parallel: ParallelConfig) -> dict:
    """TransformerConfig fields of the MoE families (empty for dense models)."""
    if not model.is_moe:
        return {}
    aux = model.moe_aux_loss_coef > 0
    return dict(
        num_moe_experts=model.num_experts,
        moe_router_topk=model.moe_topk,
        moe_ffn_hidden_size=model.moe_ffn_hidden_size,
        # HF: softmax over all experts, top-k, renormalise if norm_topk_prob. megatron's default
        # (top-k of the logits, softmax over those) is exactly the renormalised case;
        # pre_softmax (softmax over all, top-k, no renormalisation) the other
        moe_router_pre_softmax=not model.moe_norm_topk_prob,
        moe_router_dtype="fp32",  # HF routes in fp32 whatever the model's dtype
        moe_layer_freq=model.moe_layer_pattern,
        moe_shared_expert_intermediate_size=model.shared_expert_ffn_hidden_size or None,
        moe_shared_expert_gate=model.shared_expert_ffn_hidden_size > 0,
        moe_router_load_balancing_type="aux_loss" if aux else "none",
        # HF's one loss over all layers as megatron's per-layer coefficient (k / L_moe x HF's)
        moe_aux_loss_coeff=megatron_aux_loss_coeff(model),
        moe_z_loss_coeff=model.moe_z_loss_coef or None,
        moe_token_dispatcher_type="alltoall" if parallel.ep > 1 else "allgather",
        # a RouterReplay per router: idle (routes itself) until routing replay arms it
        moe_enable_routing_replay=True,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.tp,
    )


def transformer_config(model: ModelConfig, parallel: ParallelConfig, *,
                       recompute: tuple[str, int] = ("none", 1)):
    """The megatron TransformerConfig for a Llama/Qwen2/Qwen3-style decoder. `recompute`:
    (compute.recompute, compute.recompute_num_layers) of the model trained (megatron
    recomputes in training mode under autograd only: scoring passes keep nothing anyway)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = DTYPE[model.dtype]
    cuda = torch.cuda.is_available()
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=model.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model.qkv_bias,
        qk_layernorm=model.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_std,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=True,
        sequence_parallel=bool(parallel.sequence_parallel),
        context_parallel_size=parallel.cp,
        bias_activation_fusion=cuda,
        masked_softmax_fusion=False,
        bias_dropout_fusion=cuda,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        mrope_section=list(model.mrope_section) or None,
        **_moe_fields(model, parallel),
        **recompute_fields(*recompute),
    )


@megatron_scope()
def build_model(model: ModelConfig, parallel: ParallelConfig, *, seed: int = 1234,
                recompute: tuple[str, int] = ("none", 1)):
    """Returns this rank's `GPTModel` stage (its TP shard of its PP stage's layers).

    Needs `megagrpo.runtime.distributed.init_distributed` first (which checks `parallel` against
    `model`; a run's preflight checked both before). Weights are randomly initialised from
    `seed` (identically to any other layout's shards of the same model); load real weights with
    `megagrpo.hf.load_hf_weights`. `recompute`: as `transformer_config` (the policy's
    compute.recompute; the reference only scores).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    if model.is_moe:
        _moe_without_transformer_engine()
    rng.seed_model_init(seed)
    config = transformer_config(model, parallel, recompute=recompute)
    # a vision-language model: GPTModel with 3-D RoPE and the vision tower beside its embedding
    cls, extra = (vlm_class(), {"vlm": model}) if model.is_vlm else (GPTModel, {})
    gpt = cls(
        config=config,
        transformer_layer_spec=_layer_spec(model, parallel, config),
        vocab_size=parallel.padded_vocab_size(model.vocab_size),
        max_sequence_length=model.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=model.tie_word_embeddings,
        position_embedding_type="mrope" if model.is_vlm else "rope",
        rotary_base=int(model.rope_theta),
        # megatron's llama3 scaling takes only the factor (ModelConfig refuses other low/high
        # frequency factors and original context lengths than the ones it hard-codes)
        rope_scaling=model.rope_type == "llama3",
        rope_scaling_factor=model.rope_factor,
        parallel_output=True,
        **extra,
    )
    _cast_params(gpt, DTYPE[model.dtype])
    if parallel.cp > 1:
        if layer_spec_name(parallel) == "transformer_engine":
            raise ValueError(f"parallel.cp={parallel.cp}: only megagrpo's own context-parallel "
                             "attention (local spec) is built; Transformer Engine's is not wired "
                             "in; set parallel.transformer_impl=local")
        from megagrpo.parallel.context_parallel import prepare_model

        prepare_model(gpt)
    if model.is_moe and parallel.tp > 1 and not parallel.sequence_parallel:
        # the same on every rank: the console says it once (torchrun's rank 0), the logs all
        say = log.warning if os.environ.get("RANK", "0") == "0" else log.info
        say("MoE at parallel.tp=%d without sequence parallelism: every TP rank routes "
            "every token (%dx the expert compute) and the load-balancing loss reaches "
            "the router at 1/%d; set parallel.sequence_parallel=true", parallel.tp,
            parallel.tp, parallel.tp)
        # built as megatron's MoELayer (its spec, so it gets its process groups), then given
        # the subclass that trains without sequence parallelism
        for m in gpt.modules():
            if type(m) is _moe_layer_class():
                m.__class__ = _moe_layer_without_sp()
        _divide_expert_grads_by_tp(gpt, parallel.tp)
    if torch.cuda.is_available():
        gpt.cuda(torch.cuda.current_device())
    return gpt


def _moe_without_transformer_engine() -> None:
    """megatron-core 0.16's router GEMM (`moe_utils.RouterGatingLinearFunction`) tests
    `te_general_gemm is not None`, a name bound only when Transformer Engine imports: without TE
    it raises NameError. Bind it to None, which selects the function's own torch.mm branch."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _cast_params(gpt: torch.nn.Module, dtype: torch.dtype) -> None:
    """All parameters in `dtype`. megatron-core's local-spec RMSNorm creates fp32 weights whatever
    params_dtype says (megatron's own training wraps the model in Float16Module, megagrpo does
    not): in a bf16 model torch's rms_norm then falls back from its fused kernel on the mixed
    dtypes (and warns at every call site), and vLLM gets fp32 tensors for bf16 parameters."""
    with torch.no_grad():
        for p in gpt.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(module, "module"):
        module = module.module
    return module
