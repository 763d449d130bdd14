"""Float64 oracles, test-case builders and the TP worker shared by the kernel tests.

The oracles work on the UNSHARDED logits with a full float64 log_softmax: they share no code
with megagrpo.kernels, so they check both the Triton and the chunked torch path independently.
The TP worker runs in spawned gloo processes (tests.support.launch.spawn_ranks); it must live
in an importable module (not a test file) so that torch.multiprocessing can pickle it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tests.support.launch import count_collectives, gloo_rank, save_rank

GRPO_OPTIONS: dict[str, dict] = {
    "ppo_clip": dict(eps_low=0.2, eps_high=0.28),
    "ppo_dual_clip": dict(eps_low=0.2, eps_high=0.2, dual_clip_c=1.5),
    "kl_k1": dict(beta=0.1, kl_estimator="k1"),
    "kl_k2": dict(beta=0.1, kl_estimator="k2"),
    "kl_k3_clamped": dict(beta=0.3, kl_estimator="k3", kl_clamp=(1.0, 0.5)),
    "gspo_sequence": dict(ratio_level="sequence", eps_low=3e-2, eps_high=4e-2),
    "is_weight_cap": dict(is_cap=1.5, beta=0.05),
    "cispo": dict(policy_loss="cispo", eps_high=0.25),
}
# the two loss types test_loss_spec.py checks against their papers' float64 formulas
SAPO_STEEP = dict(policy_loss="sapo", sapo_tau_pos=0.5, sapo_tau_neg=3.0)
K3_IS = dict(beta=0.3, kl_estimator="k3_is", eps_low=0.2, eps_high=0.28)


# ------------------------------------------------------------------------------ case builders
def make_logits(n: int, v: int, dtype: torch.dtype, seed: int, extreme: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=g) * 3.0
    if extreme:
        sign = torch.where(torch.rand(n, v, generator=g) < 0.5, -1e4, 1e4)
        x = sign * torch.rand(n, v, generator=g)
        x[:, 7] = 1e4
        x[1] = -1e4
    return x.to(dtype)


def edge_targets(n: int, v: int, tp: int, seed: int) -> torch.Tensor:
    """Targets at every shard's first and last id, then random ones."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, v, (n,), generator=g)
    v_local = v // tp
    edges = [e for r in range(tp) for e in (r * v_local, (r + 1) * v_local - 1)]
    t[: len(edges)] = torch.tensor(edges)[:n]
    return t


def put_max_in_other_shard(x: torch.Tensor, target: torch.Tensor, tp: int) -> None:
    """Rows 0..3: the row maximum sits in a shard that does not hold the target."""
    v_local = x.shape[1] // tp
    for row in range(min(4, x.shape[0])):
        owner = int(target[row]) // v_local
        other = (owner + 1) % tp if tp > 1 else owner
        col = other * v_local + (row * 13) % v_local
        if col != int(target[row]):
            x[row, col] = x[row].float().max() + 8.0


def logprob_case(n, v, tp, dtype, seed, temperature=1.0, extreme=False, masked=True):
    x = make_logits(n, v, dtype, seed, extreme)
    target = edge_targets(n, v, tp, seed)
    put_max_in_other_shard(x, target, tp)
    mask = torch.zeros(n, dtype=torch.bool)
    if masked:
        mask[2::5] = True
        target[mask] = -100  # garbage ids where ignored, as collators produce
    g = torch.Generator().manual_seed(seed + 1)
    return dict(kind="logprob", logits=x, target=target, mask=mask, temperature=temperature,
                g=torch.randn(n, generator=g), h=torch.randn(n, generator=g))


def grpo_case(n, v, tp, dtype, seed, options: dict):
    base = logprob_case(n, v, tp, dtype, seed, temperature=0.9)
    mask = ~base["mask"]
    target = base["target"].clamp_min(0)
    g = torch.Generator().manual_seed(seed + 2)
    true = oracle_logprob(base["logits"], target, 0.9, ~mask)[0].float()
    scale = 0.12 if options.get("ratio_level") == "sequence" else 0.6
    old = true + scale * torch.randn(n, generator=g)
    ref = true + 0.5 * torch.randn(n, generator=g)
    adv = torch.randn(n, generator=g)
    old[~mask] = float("inf")  # garbage at masked tokens must not leak
    seq_ids = torch.arange(n) // 6
    is_weight = torch.rand(n, generator=g) * 2.5
    kwargs = dict(options)
    if kwargs.get("ratio_level") == "sequence":
        kwargs["seq_ids"] = seq_ids
    if "is_cap" in kwargs:
        kwargs["is_weight"] = is_weight
    if kwargs.get("beta", 0.0) != 0.0:
        kwargs["ref_logp"] = ref
    return dict(kind="grpo", logits=base["logits"], target=target, mask=mask, old_logp=old,
                advantages=adv, temperature=0.9, kwargs=kwargs,
                g=torch.randn(n, generator=g))


# ------------------------------------------------------------------------------ float64 oracles
def oracle_logprob(logits, target, temperature, ignore_mask, g=None, h=None):
    """Full float64 log_softmax: (logp, entropy, grad of sum(g*logp + h*entropy))."""
    x = logits.detach().double().requires_grad_(g is not None)
    logsm = torch.log_softmax(x / temperature, dim=-1)
    logp = logsm.gather(1, target.clamp(0, x.shape[1] - 1)[:, None]).squeeze(1)
    ent = -(logsm.exp() * logsm).sum(dim=-1)
    logp = torch.where(ignore_mask, 0.0, logp)
    ent = torch.where(ignore_mask, 0.0, ent)
    if g is None:
        return logp.detach(), ent.detach(), None
    (logp * g.double() + ent * h.double()).sum().backward()
    return logp.detach(), ent.detach(), x.grad


def oracle_grpo(case) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Per-token loss, grad w.r.t. the full logits, and clip flags, written token by token."""
    o = case["kwargs"]
    x = case["logits"].detach().double().requires_grad_()
    logsm = torch.log_softmax(x / case["temperature"], dim=-1)
    logp = logsm.gather(1, case["target"][:, None]).squeeze(1)
    mask, adv, old = case["mask"], case["advantages"].double(), case["old_logp"].double()
    n = logp.shape[0]
    lr = [logp[i] - old[i] if mask[i] else logp.new_zeros(()) for i in range(n)]
    if o.get("ratio_level") == "sequence":
        ids = o["seq_ids"]
        seq_lr = {}
        for s in ids.unique().tolist():
            toks = [i for i in range(n) if ids[i] == s and mask[i]]
            seq_lr[s] = sum(lr[i] for i in toks) / max(len(toks), 1)
        lr = [seq_lr[int(ids[i])] for i in range(n)]
    lo, hi = 1 - o.get("eps_low", 0.2), 1 + o.get("eps_high", 0.2)
    losses, low, high = [], [], []
    for i in range(n):
        if not mask[i]:
            losses.append(logp.new_zeros(()))
            low.append(False)
            high.append(False)
            continue
        r, a = torch.exp(lr[i]), adv[i]
        if o.get("policy_loss", "ppo") == "cispo":
            term = -torch.clamp(r, max=hi).detach() * a * logp[i]
            low.append(False)
            high.append(bool(r > hi))
        else:
            obj = torch.minimum(r * a, torch.clamp(r, lo, hi) * a)
            if o.get("dual_clip_c") is not None and a < 0:
                obj = torch.maximum(obj, o["dual_clip_c"] * a)
            term = -obj
            low.append(bool(r < lo and a < 0))
            high.append(bool(r > hi and a > 0))
        if o.get("beta", 0.0):
            est = o.get("kl_estimator", "k3")
            # documented defaults: k3 clamped (20, 10) against exp overflow, k1/k2 unclamped
            default = (20.0, 10.0) if est == "k3" else (float("inf"), float("inf"))
            c_in, c_out = o.get("kl_clamp") or default
            d = torch.clamp(logp[i] - o["ref_logp"][i].double(), -c_in, c_in)
            kls = {"k1": d, "k2": d * d / 2, "k3": torch.exp(-d) + d - 1}
            term = term + o["beta"] * torch.clamp(kls[est], -c_out, c_out)
        if "is_weight" in o:  # the whole token loss: the KL term's samples are mu's too
            term = term * min(float(o["is_weight"][i]), o.get("is_cap") or float("inf"))
        losses.append(term)
    loss = torch.stack(losses)
    (loss * case["g"].double()).sum().backward()
    flags = dict(clipped_low=torch.tensor(low), clipped_high=torch.tensor(high))
    return loss.detach(), x.grad, flags


# ------------------------------------------------------------------------------ tolerances
def tolerance(ref: torch.Tensor, out_dtype: torch.dtype, row_scale: torch.Tensor) -> torch.Tensor:
    """fp32 compute error (grows with the row's logit magnitude and the value) + 1 bf16 ulp."""
    scale = row_scale.double().reshape(-1, *([1] * (ref.dim() - 1)))
    tol = 2e-5 + 2e-6 * scale + 1e-5 * ref.abs()
    if out_dtype in (torch.bfloat16, torch.float16):
        tol = tol + torch.finfo(out_dtype).eps * ref.abs()
    return tol


def assert_close(actual, ref, row_scale, what=""):
    actual = actual.detach()
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = (actual.double() - ref.double()).abs()
    tol = tolerance(ref, actual.dtype, row_scale)
    bad = err > tol
    assert not bad.any(), (f"{what}: {int(bad.sum())} mismatches, max err {err.max():.3g}, "
                           f"worst excess {(err - tol).max():.3g}")


def row_scale(case) -> torch.Tensor:
    return case["logits"].double().abs().amax(dim=1) / case["temperature"]


# ------------------------------------------------------------------------------ runners
def run_case(case, impl: str, group=None, rank: int = 0, tp: int = 1, inplace=False) -> dict:
    """Run one case on this rank's vocab shard; returns outputs and the local logits grad."""
    from megagrpo.kernels import grpo_token_loss, vocab_parallel_logprob

    v_local = case["logits"].shape[1] // tp
    leaf = case["logits"][:, rank * v_local:(rank + 1) * v_local].clone().requires_grad_()
    x = leaf.clone()  # non-leaf, as the output layer's logits are
    if case["kind"] == "logprob":
        logp, ent = vocab_parallel_logprob(
            x, case["target"], temperature=case["temperature"], group=group,
            ignore_mask=case["mask"], with_entropy=True, inplace_backward=inplace, impl=impl)
        (logp * case["g"] + ent * case["h"]).sum().backward()
        return dict(logp=logp.detach(), entropy=ent.detach(), grad=leaf.grad)
    loss, metrics = grpo_token_loss(
        x, case["target"], case["old_logp"], case["advantages"], case["mask"], group=group,
        temperature=case["temperature"], impl=impl, inplace_backward=inplace, **case["kwargs"])
    (loss * case["g"]).sum().backward()
    return dict(loss=loss.detach(), grad=leaf.grad, **metrics)


def run_cases(cases: dict, group, rank: int, tp: int, calls: list[int]) -> dict:
    """Every case with both impls on this rank's shard; each output records how many
    collectives its call made (`calls`: a `count_collectives` counter)."""
    results = {}
    for name, case in cases.items():
        for impl in ("triton", "torch"):
            before = calls[0]
            out = run_case(case, impl, group, rank, tp, inplace=impl == "torch")
            out["collectives"] = calls[0] - before
            results[(name, impl)] = out
    return results


def tp_sizes_worker(rank: int, world: int, rdzv: str, payload_path: str, out_dir: str) -> None:
    """Spawned gloo rank of one world that runs several TP sizes: for each `tp` of the payload
    {tp: [cases of group 0, cases of group 1, ...]} the world splits into groups of `tp`
    consecutive ranks (the whole world when tp == world), and each group runs its own cases,
    so the groups of a size run side by side and a kernel that reduced over the world instead
    of its group would mix them. Saves {(tp, case, impl): outputs} for the parent."""
    with gloo_rank(rank, world, rdzv) as world_group:
        calls = count_collectives()
        results = {}
        for tp, per_group in sorted(torch.load(payload_path, weights_only=False).items()):
            groups = [dist.new_group(list(range(i, i + tp))) if tp < world else world_group
                      for i in range(0, world, tp)]  # every rank creates every group
            mine = rank // tp
            out = run_cases(per_group[mine], groups[mine], rank % tp, tp, calls)
            results.update({(tp, *key): v for key, v in out.items()})
        save_rank(results, out_dir, rank)
