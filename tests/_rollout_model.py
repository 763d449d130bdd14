"""A tiny random HF Llama with a character-level tokenizer, and a transformers greedy oracle.
Shared by tests/test_rollout.py and the torchrun worker tests/_rollout_worker.py."""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 128
EOS = 1


def build_tiny_llama(model_dir: str | Path, *, seed: int = 0, tie: bool = False):
    """Save config + tokenizer of a 2-layer Llama (head_dim 32, GQA 4/2) to `model_dir` and
    return the HF model with random weights (fp32, eval mode; weights are not saved)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<unk>"]
    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    extra = [f"<x{i}>" for i in range(VOCAB - len(specials) - len(chars))]
    vocab = {tok: i for i, tok in enumerate(specials + chars + extra)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, bos_token_id=0, eos_token_id=EOS,
                      tie_word_embeddings=tie, rms_norm_eps=1e-6)
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger logits than the 0.02 init, so greedy paths are not near-ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    cfg.save_pretrained(model_dir)
    fast.save_pretrained(model_dir)
    return model, fast


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """Plain argmax loop with transformers: tokens and their log_softmax, stopping at EOS."""
    ids = torch.tensor([prompt])
    out, lps = [], []
    for _ in range(max_tokens):
        logp = model(ids).logits[0, -1].double().log_softmax(-1)
        tok = int(logp.argmax())
        out.append(tok)
        lps.append(float(logp[tok]))
        if tok == EOS:
            break
        ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
    return out, lps


@torch.no_grad()
def hf_token_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    """log p(completion[i] | prompt, completion[:i]) under the HF model (teacher forcing)."""
    ids = torch.tensor([prompt + completion])
    logp = model(ids).logits[0].double().log_softmax(-1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
    return logp[pos, torch.tensor(completion)].tolist()
