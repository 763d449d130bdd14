"""Run on local ranks (2 processes, gloo) by tests/test_attention.py; one launch covers:

1. Module level (TP=1; rank 0 fp32, rank 1 bf16): SdpaAttention and megatron's
   DotProductAttention against a float64 naive softmax attention, output and input gradients,
   GQA shapes, right-padded rows; padded positions perturbed must not change earlier ones; the
   RNG state after forward + backward.
2. GPTModel (tiny HF Llama weights prepared by the parent) at TP=1 with attention_impl megatron
   and sdpa: logits (the parent compares them with transformers') and the gradients of a CE loss.
3. The same at TP=2 with sdpa: logits gathered over the vocab shards, layer-0 attention weight
   gradients gathered over the TP shards (the parent compares them with TP=1).
Rank 0 writes WORK/results.json (module figures) and WORK/tensors.pt (logits and gradients).
"""
import argparse
import os

import torch
import torch.distributed as dist

from tests.support.launch import write_results

SHAPES = [(4, 2), (4, 4), (4, 1)]  # (query heads, KV groups) at head_dim 32
LENGTHS = [12, 7, 3]  # right-padded rows, S = 12


def naive_attention(q, k, v, scale):
    """float64 causal softmax attention. q [S, b, np, hn], k/v [S, b, ng, hn] -> [S, b, np*hn]."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) * scale
    s = q.shape[0]
    future = torch.ones(s, s, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    out = torch.einsum("bhst,tbhd->sbhd", probs, v)
    return out.reshape(s, q.shape[1], -1)


def _fwd_bwd(fn, q, k, v, grad):
    """(output, dq, dk, dv) of fn on leaf copies of q, k, v."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(grad.to(out.dtype))
    return [out.detach(), *(t.grad for t in leaves)]


def _rel(a, ref):
    return ((a.double() - ref).abs().max() / ref.abs().max()).item()


def module_case(dtype, nh, ng, seed):
    """One shape and dtype: relative errors vs float64, padding invariance, RNG state."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megagrpo.config.model import ModelConfig, ParallelConfig
    from megagrpo.model.gpt import DTYPE, transformer_config
    from megagrpo.parallel.attention import SdpaAttention

    mcfg = ModelConfig(num_attention_heads=nh, num_query_groups=ng, head_dim=32,
                       hidden_size=nh * 32, dtype=dtype)
    cfg = transformer_config(mcfg, ParallelConfig())
    mods = {cls.__name__: cls(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
                              attention_type="self")
            for cls in (SdpaAttention, DotProductAttention)}
    g = torch.Generator().manual_seed(seed)
    s, b = LENGTHS[0], len(LENGTHS)
    q, k, v = (torch.randn(s, b, n, 32, generator=g, dtype=torch.float64) for n in (nh, ng, ng))
    valid = (torch.arange(s)[:, None] < torch.tensor(LENGTHS)[None, :])  # [S, b]
    grad = torch.randn(s, b, nh * 32, generator=g, dtype=torch.float64) * valid[..., None]
    ref = _fwd_bwd(lambda *t: naive_attention(*t, 32 ** -0.5), q, k, v, grad)
    low = [t.to(DTYPE[dtype]) for t in (q, k, v)]
    # padded positions replaced by other values: nothing at a valid position may change
    noisy = [torch.where(valid[..., None, None], t, torch.randn(t.shape, generator=g).to(t.dtype))
             for t in low]
    rec = {"dtype": dtype, "nh": nh, "ng": ng}
    for name, mod in mods.items():
        rng = torch.get_rng_state()
        got = _fwd_bwd(lambda *t, m=mod: m(*t, None), *low, grad)
        rec[f"{name}_rng_unchanged"] = torch.equal(rng, torch.get_rng_state())
        for label, a, r in zip(("out", "dq", "dk", "dv"), got, ref):
            rec[f"{name}_{label}_rel_err"] = _rel(a, r)
        again = _fwd_bwd(lambda *t, m=mod: m(*t, None), *noisy, grad)
        # valid [S, b] indexes the leading dims of out, dq, dk, dv alike
        rec[f"{name}_pad_max_diff"] = max((a[valid].double() - c[valid].double()).abs().max().item()
                                          for a, c in zip(got, again))
    return rec


def model_pass(work, ref, tp, impl, tensors):
    """Logits and CE-loss gradients of the tiny Llama at this TP with attention_impl=impl."""
    from megatron.core import parallel_state as ps

    from megagrpo.config.model import ParallelConfig
    from megagrpo.hf import load_hf_weights, model_config_from_hf
    from megagrpo.model.gpt import build_model
    from megagrpo.runtime.distributed import init_distributed

    hf_dir = os.path.join(work, "llama")
    mcfg = model_config_from_hf(hf_dir)
    parallel = ParallelConfig(tp=tp, attention_impl=impl, make_vocab_size_divisible_by=56)
    info = init_distributed(parallel, mcfg)
    gpt = build_model(mcfg, parallel, seed=3)
    load_hf_weights(gpt, hf_dir, mcfg, parallel, tp_rank=info.tp_rank, pp_rank=0)
    ids, labels = ref["ids"], ref["labels"]
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    logits = gpt(ids, pos, None)  # [B, S, V/tp]
    gpt(ids, pos, None, labels=labels).mean().backward()
    group = ps.get_tensor_model_parallel_group()
    attn = gpt.decoder.layers[0].self_attention
    out = {"class": type(attn.core_attention).__name__,
           "logits": _gather(logits.detach(), -1, tp, group)[..., : mcfg.vocab_size],
           "qkv_grad": _gather(attn.linear_qkv.weight.grad, 0, tp, group),
           "proj_grad": _gather(attn.linear_proj.weight.grad, 1, tp, group)}
    if tp == 1:
        out["grads"] = {n: p.grad.clone() for n, p in gpt.named_parameters()}
    tensors[f"tp{tp}_{impl}"] = out


def _gather(t, dim, tp, group):
    if tp == 1:
        return t.clone()
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    from megagrpo.config.model import ParallelConfig
    from megagrpo.runtime.distributed import init_distributed

    torch.set_num_threads(1)
    info = init_distributed(ParallelConfig())
    dtype = ("float32", "bfloat16")[info.rank % 2]
    results = [module_case(dtype, nh, ng, seed=i) for i, (nh, ng) in enumerate(SHAPES)]
    ref = torch.load(os.path.join(args.work, "ref.pt"))
    tensors = {}
    for tp, impl in ((1, "megatron"), (1, "sdpa"), (2, "sdpa")):
        model_pass(args.work, ref, tp, impl, tensors)
    if info.rank == 0:
        torch.save(tensors, os.path.join(args.work, "tensors.pt"))
    write_results(results, args.work, flat=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
