"""Run on local ranks (1 process, gloo) by tests/test_compile.py: a 2-layer megatron-core GPT
(megagrpo's model, local spec, SDPA, fp32), every parameter's gradient of a fixed loss on
micro-batches of three shapes (rows x length) and one no-grad forward, eager; then the same
with compute.compile_layers (`megagrpo.model.compile.compile_layers`), counting the graphs dynamo
made and its graph breaks at each pass. Rank 0 writes WORK/results.json."""
import argparse

import torch

from tests.support.launch import write_results

SHAPES = [(2, 12), (3, 20), (2, 7)]  # (rows, length): the later ones must not recompile
VOCAB = 128  # a multiple of the padding, so the logits are [b, s, VOCAB]


def build():
    from megagrpo.config.model import ModelConfig, ParallelConfig
    from megagrpo.model.gpt import build_model
    from megagrpo.runtime.distributed import init_distributed

    m = ModelConfig(hidden_size=64, ffn_hidden_size=128, num_layers=2, num_attention_heads=4,
                    num_query_groups=2, head_dim=16, vocab_size=VOCAB,
                    max_position_embeddings=64)
    par = ParallelConfig()
    init_distributed(par, m)
    return build_model(m, par)


def batch(rows: int, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids [b, s], positions [b, s] and a fixed weighting of the logits [b, s, V]."""
    g = torch.Generator().manual_seed(rows * 100 + length)
    ids = torch.randint(0, VOCAB, (rows, length), generator=g)
    pos = torch.arange(length).expand(rows, length)
    return ids, pos, torch.randn(rows, length, VOCAB, generator=g)


def grads(model, rows: int, length: int) -> list[torch.Tensor]:
    """Every parameter's gradient of sum(logits * weights) on one micro-batch."""
    ids, pos, w = batch(rows, length)
    model.zero_grad(set_to_none=True)
    (model(ids, pos, None) * w).sum().backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def no_grad_logits(model) -> torch.Tensor:
    ids, pos, _ = batch(*SHAPES[0])
    with torch.no_grad():
        return model(ids, pos, None)


def packed_plan() -> list:
    """Packed micro-batches (megagrpo.parallel.batch.PackedRows: rows end to end, SDPA over a padded
    grid) of 7 sequences of varied lengths, 2 micro-batches of different sizes and grids."""
    from megagrpo.parallel.batch import pack, plan_micro_batches

    g = torch.Generator().manual_seed(5)
    lens = torch.randint(2, 12, (7, 2), generator=g).tolist()
    prompts = [[1 + (i + j) % 50 for j in range(p)] for i, (p, _) in enumerate(lens)]
    comps = [[3 + (i * j) % 60 for j in range(c)] for i, (_, c) in enumerate(lens)]
    lps = [[-0.1] * len(c) for c in comps]
    b = pack(prompts, comps, lps, torch.linspace(-1, 1, 7), pad_id=0)
    return plan_micro_batches(b, 4, token_budget=64, packed=True)


def packed_grads(model, plan: list) -> list[torch.Tensor]:
    """Every parameter's gradient of a fixed weighting of the logits at the loss positions,
    summed over the packed micro-batches (megagrpo's forward_step: positions, rotary hook)."""
    from megagrpo.train.passes import forward_step

    model.zero_grad(set_to_none=True)
    for i, mb in enumerate(plan):
        out, _ = forward_step(mb, model, loss_fn=lambda *a, **k: None)
        g = torch.Generator().manual_seed(i)
        (out * torch.randn(out.shape, generator=g)).sum().backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Largest max |a - b| / max |b| over the tensors."""
    return max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-30)) for x, y in zip(a, b))


def weights_changed_in_place(model) -> dict[str, dict]:
    """After tracing, the weights change in place as a run changes them (an optimizer step;
    a reference reset copying the policy into the compiled reference): the compiled layers'
    gradients and no-grad logits against the eager ones at the new weights, and the graphs
    each made (none: the parameters are the graphs' inputs, not constants)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    grads(model, *SHAPES[1])
    opt.step()
    out = {"step": _compiled_vs_eager(model)}
    g = torch.Generator().manual_seed(11)
    source = [p.detach() * 0.9 + 0.02 * torch.randn(p.shape, generator=g)
              for p in model.parameters()]
    with torch.no_grad():
        for p, src in zip(model.parameters(), source):
            p.copy_(src)
    out["reset"] = _compiled_vs_eager(model)
    return out


def _compiled_vs_eager(model) -> dict:
    from megagrpo.model.compile import graph_count, use_compiled

    use_compiled(model, False)
    want, want_logits = grads(model, *SHAPES[1]), no_grad_logits(model)
    use_compiled(model, True)
    before = graph_count()
    got, got_logits = grads(model, *SHAPES[1]), no_grad_logits(model)
    return {"grad_rel_diff": rel(got, want), "no_grad_rel_diff": rel([got_logits], [want_logits]),
            "new_graphs": graph_count() - before}


def main() -> None:
    from torch._dynamo.utils import counters

    from megagrpo.model.compile import compile_layers, graph_count, use_compiled

    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    model = build()
    eager = [grads(model, *s) for s in SHAPES]
    eager_logits = no_grad_logits(model)
    plan = packed_plan()
    eager_packed = packed_grads(model, plan)
    layers = compile_layers(model)
    out = {"layers": layers, "passes": []}
    for shape, want in zip(SHAPES, eager):
        before = graph_count()
        got = grads(model, *shape)
        out["passes"].append({"shape": shape, "grad_rel_diff": rel(got, want),
                              "new_graphs": graph_count() - before})
    before = graph_count()
    out["no_grad_rel_diff"] = rel([no_grad_logits(model)], [eager_logits])
    out["no_grad_new_graphs"] = graph_count() - before
    before = graph_count()
    try:
        out["packed_rel_diff"] = rel(packed_grads(model, plan), eager_packed)
    except Exception as e:  # reported by the test, after the other checks
        out["packed_error"] = repr(e)[:2000]
    out["packed_new_graphs"] = graph_count() - before
    out["packed_grids"] = [list(mb.packed.grid) for mb in plan]
    # use_compiled: the eager forward back (the eager gradients to the bit), then the compiled
    # one again from dynamo's cache (no new graph, the compiled gradients)
    out["switched_off"] = use_compiled(model, False)
    out["switched_eager_bitwise"] = all(
        torch.equal(a, b) for a, b in zip(grads(model, *SHAPES[0]), eager[0]))
    before = graph_count()
    out["switched_on"] = use_compiled(model, True)
    out["switched_compiled_rel_diff"] = rel(grads(model, *SHAPES[0]), eager[0])
    out["switched_new_graphs"] = graph_count() - before
    out["changed"] = weights_changed_in_place(model)
    out["graph_breaks"] = sum(counters["graph_break"].values())
    out["counters"] = {k: {str(n): v for n, v in c.items()} for k, c in counters.items()}
    write_results(out, args.work)


if __name__ == "__main__":
    main()
