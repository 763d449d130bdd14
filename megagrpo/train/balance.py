"""Token-balanced data parallelism: a step's sequences moved between DP replicas so that each
replica computes about the same number of tokens (compute.balance_tokens).

Each replica samples its own prompts, so with long-tailed completion lengths one replica can
hold the longest trajectories and every other replica waits for it at the gradient all-reduce.
After the advantages are set (each replica's groups are whole there), the real rows of every
global minibatch are partitioned over the DP ranks by token count (prompt + completion) with
the greedy LPT rule (longest first, each to the least-loaded rank), then each replica rebuilds
its batch from the rows assigned to it. Only where a sequence is computed changes: the
prompts, completions, rewards and advantages stay as the rollout made them, the global
minibatches keep their members, and the loss normalisers are global sums (`Passes.counts`), so
the GRPO loss (policy and KL terms) and its gradients change by float summation order only.
Deterministic: the partition is a function of the gathered lengths (ties broken by source
replica and row), no RNG is drawn.

One exception, an MoE model's router losses (model.moe_aux_loss_coef, model.moe_z_loss_coef):
megatron computes them per micro-batch from that micro-batch's tokens and averages them over
the M micro-batches and the DP replicas, so they depend on which tokens share a micro-batch,
as they do on compute.micro_batch_size / micro_batch_tokens and on the DP layout. Moving rows
changes them: the z-loss (a token mean of logsumexp(logits)^2 per micro-batch) weighs each token
1 / (M dp T_mb), unchanged only where the micro-batches' token counts are; the load-balancing
loss E sum_i f_i P_i is a product of two micro-batch means and changes with the grouping even
at equal counts (tests/test_balance.py, through megatron's own functions; the review measured
43-67% on the router's aux gradient). Neither is a bias of the GRPO objective: the router
losses are regularisers defined per micro-batch, and any layout (balanced or not) is one
grouping among many. Megatron's `global_aux_loss` (expert shares summed over DP and the
micro-batches so far) would not make them layout-free either: its shares are a running mean
over micro-batches in order, and its all-reduce per micro-batch needs equal micro-batch counts
on every replica, which micro_batch_tokens does not give.

Why LPT and not Karmarkar-Karp: LPT is a few lines, places rows in one pass, and its max load
is within 4/3 - 1/(3k) of the optimum (Graham 1969) and below mean + the longest row, which is
what matters for a long tail (the longest row sets the floor for any partition). Why rows and
not whole groups: a GRPO group is G rows whose lengths vary as much as the batch's, so moving
groups leaves most of the imbalance; once advantages are set a row needs nothing of its group.
Micro-batches within a replica keep the length-sorted plan (`megagrpo.parallel.batch`): they run one
after another on the rank, so their balance does not change its step time, and sorting by
length keeps padding (and the packed attention grid) smallest.
"""
from __future__ import annotations

from dataclasses import fields

import torch
import torch.distributed as dist

from megagrpo.parallel.batch import Batch

_ROW_FILL = {"ids": None, "target": None, "routes": -2}
"""Fill of a padding row per field (None: the pad id); every other field is 0 / False."""


def balance_note(compute_balance: bool | None, *, loss_agg: str, kl_in_reward: bool,
                 dp: int) -> str | None:
    """The console line for a run where compute.balance_tokens left unset stays off although
    there are several replicas (None: nothing to say)."""
    if compute_balance is not None or dp == 1 or balance_enabled(
            None, loss_agg=loss_agg, kl_in_reward=kl_in_reward, dp=dp):
        return None
    why = "algo.loss_agg=bnpo" if loss_agg == "bnpo" else "algo.kl_in_reward"
    return (f"compute.balance_tokens: off with {why} (moving sequences would change the loss); "
            "each DP replica trains on its own rollout")


def lpt_partition(weights: list[int], k: int) -> list[list[int]]:
    """Greedy LPT: items (indices into `weights`) by weight, heaviest first, each to the bin with
    the least load so far (ties: the lower bin). Deterministic; every item in exactly one bin,
    each bin's items in ascending index order. Max load <= sum/k + (1 - 1/k) * max weight and
    <= (4/3 - 1/(3k)) * the optimum."""
    if k < 1:
        raise ValueError(f"lpt_partition: k={k} bins, need >= 1")
    bins: list[list[int]] = [[] for _ in range(k)]
    loads = [0] * k
    for i in sorted(range(len(weights)), key=lambda j: (-weights[j], j)):
        b = min(range(k), key=lambda j: (loads[j], j))
        bins[b].append(i)
        loads[b] += weights[i]
    return [sorted(b) for b in bins]


def imbalance(loads: list[float]) -> float:
    """max / mean of per-rank loads (1.0: perfectly balanced; 1.0 when all are 0)."""
    mean = sum(loads) / max(len(loads), 1)
    return max(loads) / mean if mean > 0 else 1.0


def balance_enabled(compute_balance: bool | None, *, loss_agg: str, kl_in_reward: bool,
                    dp: int) -> bool:
    """compute.balance_tokens resolved: None is on unless the result would change (bnpo
    normalises per micro-batch; KL in the reward sets advantages after scoring, from whole
    groups) or there is one replica."""
    if dp == 1:
        return False
    if compute_balance is None:
        return loss_agg != "bnpo" and not kl_in_reward
    return compute_balance


def _rows_of(batch: Batch, idx: list[int]) -> list[dict]:
    """Rows `idx` of `batch` as dicts of field -> tensor, per-token fields cut to the row's
    length (nothing with a loss lies beyond it), None fields left out."""
    out = []
    for r in idx:
        n = int(batch.lengths[r]) if batch.lengths is not None else batch.ids.shape[1]
        row = {}
        for f in fields(batch):
            v = getattr(batch, f.name)
            if v is not None:
                row[f.name] = v[r, :n].clone() if v.dim() >= 2 else v[r].clone()
        out.append(row)
    return out


def _assemble(template: Batch, blocks: list[list[dict]], pad_id: int, per_micro: int) -> Batch:
    """A batch of len(blocks) equal minibatch blocks from row dicts, each block padded to the
    same row count (a multiple of min(per_micro, that count), at least 1), right-padded to
    the longest row. `template` gives the fields present, their dtypes and trailing shapes."""
    R = max(1, max(len(b) for b in blocks))
    m = max(1, min(per_micro, R))
    R = -(-R // m) * m
    S = max([1] + [int(r["lengths"]) for b in blocks for r in b])
    kw = {}
    for f in fields(template):
        v = getattr(template, f.name)
        if v is None:
            kw[f.name] = None
            continue
        fill = _ROW_FILL.get(f.name, 0)
        fill = pad_id if fill is None else fill
        shape = (R * len(blocks), S, *v.shape[2:]) if v.dim() >= 2 else (R * len(blocks),)
        t = torch.full(shape, fill, dtype=v.dtype)
        for k, block in enumerate(blocks):
            for j, row in enumerate(block):
                x = row[f.name]
                if v.dim() >= 2:
                    t[k * R + j, :x.shape[0]] = x
                else:
                    t[k * R + j] = x
        kw[f.name] = t
    return Batch(**kw)


def balance_batch(batch: Batch, *, num_minibatches: int, per_micro: int, pad_id: int,
                  dp_rank: int, dp: int, group=None, enabled: bool = True
                  ) -> tuple[Batch, dict]:
    """Moves real rows between the DP replicas so each computes about the same tokens.

    `batch` [N, S] holds `num_minibatches` equal row blocks (global minibatch k = block k of
    every replica); each global minibatch's real rows are partitioned over the replicas by
    `lpt_partition` of their lengths (`rebalance`). A collective over `group` (the DP group;
    every rank of a replica passes the same batch and gets the same result). Returns this
    replica's batch and {token_imbalance, token_imbalance_before} (max / mean real tokens per
    replica after and before; equal when not `enabled`)."""
    if batch.images is not None and enabled and dp > 1:  # refused before any collective
        raise ValueError("compute.balance_tokens with a vision-language model: moving rows "
                         "between replicas does not carry their images yet; set "
                         "compute.balance_tokens=false")
    mine = real_rows(batch, num_minibatches)
    lens = [[int(batch.lengths[r]) for r in block] for block in mine]
    gathered = [lens] if dp == 1 else [None] * dp
    if dp > 1:
        dist.all_gather_object(gathered, lens, group=group)
    if not enabled or dp == 1 or not _improves(gathered):
        v = imbalance([float(sum(map(sum, g))) for g in gathered])
        return batch, {"token_imbalance": v, "token_imbalance_before": v}
    packed = [None] * dp  # one tensor a field per replica: pickling rows one by one was the cost
    dist.all_gather_object(packed, _pack_rows(batch, mine), group=group)
    parts = [_unpack_rows(p, g) for p, g in zip(packed, gathered)]
    return rebalance(parts, dp_rank=dp_rank, batch=batch, pad_id=pad_id, per_micro=per_micro)


def _plan(lengths: list[list[list[int]]]) -> tuple[list, list[int], list[int]]:
    """The LPT partition of every minibatch (`lengths[d][k]`: replica d's real rows' lengths in
    minibatch k): per minibatch its items [(source replica, row)] and each replica's item
    indices; the replica loads before and after."""
    dp = len(lengths)
    before, after, plan = [0] * dp, [0] * dp, []
    for k in range(len(lengths[0])):
        items = [(src, j) for src in range(dp) for j in range(len(lengths[src][k]))]
        weights = [lengths[src][k][j] for src, j in items]
        assignment = lpt_partition(weights, dp)
        for (src, _), w in zip(items, weights):
            before[src] += w
        for d in range(dp):
            after[d] += sum(weights[i] for i in assignment[d])
        plan.append((items, assignment))
    return plan, before, after


def _improves(gathered: list[list[list[int]]]) -> bool:
    """Whether `rebalance`'s partition of these lengths lowers the max replica load: the same
    decision it takes, made before any row is sent."""
    _, before, after = _plan(gathered)
    return max(after) < max(before)


def _pack_rows(batch: Batch, mine: list[list[int]]) -> dict[str, dict[str, torch.Tensor]]:
    """This replica's real rows (`mine[k]`: minibatch k's row indices), field by field:
    "rows": the per-row fields [rows]; "tokens": the per-token ones, each row cut to its
    length and the rows laid end to end [sum of lengths, ...]. `_unpack_rows` undoes it."""
    order = torch.tensor([r for block in mine for r in block], dtype=torch.long)
    out: dict[str, dict[str, torch.Tensor]] = {"rows": {}, "tokens": {}}
    for f in fields(batch):
        v = getattr(batch, f.name)
        if v is None:
            continue
        if v.dim() >= 2:  # balance_batch reads batch.lengths: every balanced batch has them
            keep = torch.arange(v.shape[1])[None, :] < batch.lengths[order][:, None]
            out["tokens"][f.name] = v[order][keep]
        else:
            out["rows"][f.name] = v[order]
    return out


def _unpack_rows(packed: dict[str, dict[str, torch.Tensor]], lens: list[list[int]]
                 ) -> list[list[dict]]:
    """`_pack_rows`' fields back into row dicts per minibatch (`lens[k]`: the rows' lengths),
    equal to what `_rows_of` gives (views into `packed`)."""
    out, i, start = [], 0, 0
    for block in lens:
        rows = []
        for n in block:
            row = {name: v[i] for name, v in packed["rows"].items()}
            row.update({name: v[start:start + n] for name, v in packed["tokens"].items()})
            rows.append(row)
            i, start = i + 1, start + n
        out.append(rows)
    return out


def real_rows(batch: Batch, num_minibatches: int) -> list[list[int]]:
    """The real rows' indices in each of the batch's `num_minibatches` equal row blocks."""
    rows = batch.num_seqs // num_minibatches
    return [[r for r in range(k * rows, (k + 1) * rows) if bool(batch.seq_valid[r])]
            for k in range(num_minibatches)]


def rebalance(parts: list[list[list[dict]]], *, dp_rank: int, batch: Batch, pad_id: int,
              per_micro: int) -> tuple[Batch, dict]:
    """The pure step of `balance_batch`: `parts[d][k]` are replica d's real rows (field dicts)
    in minibatch k, `batch` replica `dp_rank`'s own; returns its new batch and the imbalance
    metrics. Where the partition would not lower the max replica load (LPT is within 4/3 of
    the optimum, not always below a lucky split), every replica keeps its own batch."""
    plan, before, after = _plan([[[int(r["lengths"]) for r in block] for block in rows]
                                 for rows in parts])
    blocks = [[parts[items[i][0]][k][items[i][1]] for i in assignment[dp_rank]]
              for k, (items, assignment) in enumerate(plan)]
    if max(after) >= max(before):  # the same decision on every rank: the same loads
        v = imbalance(before)
        return batch, {"token_imbalance": v, "token_imbalance_before": v}
    out = _assemble(batch, blocks, pad_id, per_micro)
    return out, {"token_imbalance": imbalance(after), "token_imbalance_before": imbalance(before)}
