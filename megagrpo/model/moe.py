"""MoE routing: the policy's routing statistics for the step's metrics, vLLM's routing captured
while it samples, and routing replay (the trainer's forward uses the experts vLLM chose).

`RoutingMonitor` hooks every megatron router of this rank's policy stage and counts, per layer,
how many tokens each expert was chosen for during the update's forward passes (the router's
`routing_map` [tokens, E]), and reads megatron's tracker of the auxiliary losses (the
load-balancing loss before its coefficient, the z-loss). `metrics()` reduces both over the world
(without sequence parallelism TP ranks see the same tokens: only TP rank 0 counts; with it each
TP rank routes its own slice and every rank counts; pipeline stages hold different layers; DP
replicas route their own tokens) into scalars:

- ``moe_max_load`` / ``moe_min_load``: over the MoE layers, the largest (smallest) ratio of an
  expert's tokens to the mean over experts; 1 is a perfectly balanced router, E / k the worst;
- ``moe_tokens_per_expert``: mean tokens per expert per layer over the step's update passes;
- ``moe_load_balancing_loss`` / ``moe_z_loss``: megatron's per-layer losses (without their
  coefficients), averaged over the layers and forward passes; present when enabled. The
  load-balancing loss is E * sum_i f_i P_i with f_i the share of the micro-batch's routed
  (token, slot) pairs on expert i (sum 1) and P_i its mean router probability: 1 for a
  perfectly balanced router (HF's form of the same loss is k times it). Under sequence
  parallelism megatron's per-rank value is the rank's part of the sum (added over TP here), the
  z-loss the rank's token mean (averaged over TP); without it at TP > 1 both are what megatron
  computes there (the load-balancing loss at 1/tp: see `megagrpo.model.gpt._moe_layer_without_sp`);
- with routing replay (`algo.routing_replay`): ``moe_routing_mismatch``, the share of (token,
  MoE layer) pairs of the update whose own top-k differs from the replayed one (vLLM's; before
  the first optimizer step of the step that is the train-inference mismatch itself, after it
  the update's own drift adds to it), and
  ``moe_replay_missing``, the share of replayed (token, layer) rows of real tokens vLLM left
  no route for (filled with experts 0..k-1, as are padding and each sequence's last token,
  which no loss reads).

`RouteCapture` hooks the routers of an in-process vLLM engine: at each forward a pre-hook on
the model reads the runner's batch layout (its requests in order, their query offsets, every
row's position) and hooks on the routers keep each row's top-k experts, so a sequence's
routing is exactly what vLLM computed while it sampled (no re-run). `replay` hands routes to
megatron's router-replay hook (`RouterReplay`, REPLAY_FORWARD) for one forward.
"""
from __future__ import annotations

import bisect
from contextlib import contextmanager

import torch
import torch.distributed as dist

from megagrpo.model.gpt import unwrap

REPLAY_ATTR = "megagrpo_routing_replay"
"""Set on a GPTModel (`enable_replay`) whose forwards replay the batch's vLLM routes: its
`ReplayState`."""


def tp_slices(parallel) -> int:
    """Slices of a micro-batch's tokens the TP ranks route: tp under sequence parallelism
    (each rank its own), else 1 (every TP rank routes them all)."""
    return parallel.tp if parallel.sequence_parallel else 1


def tracked_losses(model_cfg) -> tuple[str, ...]:
    """The names megatron's router tracks this model's enabled auxiliary losses under."""
    return tuple(name for name, coef in (("load_balancing_loss", model_cfg.moe_aux_loss_coef),
                                         ("z_loss", model_cfg.moe_z_loss_coef)) if coef > 0)


class RoutingMonitor:
    """Counts tokens per expert for every MoE layer of `model` (this rank's stage)."""

    def __init__(self, model: torch.nn.Module, num_layers: int, num_experts: int, *,
                 losses: tuple[str, ...] = (), counts_here: bool, group=None,
                 tp_slices: int = 1):
        """`num_layers` / `num_experts`: the whole model's; `losses`: the names megatron
        tracks the enabled auxiliary losses under (the same on every rank); `counts_here`:
        this rank's counts enter the world sum (TP rank 0); `group`: the reduction's group;
        `tp_slices`: tp under sequence parallelism (each TP rank routes its own tokens, so
        every rank's counts and losses enter the sum; `counts_here` then only says whose
        forward calls are counted), else 1."""
        from megatron.core.transformer.moe.router import TopKRouter

        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self.calls = torch.zeros(num_layers, dtype=torch.float64)
        self.counts_here, self.group, self.losses = counts_here, group, losses
        self.tp_slices = tp_slices
        self.mismatch = torch.zeros(3, dtype=torch.float64)
        """(token-layer pairs whose own top-k differs from vLLM's, such pairs compared, pairs
        of real tokens without a vLLM route); the (row, layer) pairs replayed: `replay_rows`."""
        self.replay_rows = 0.0
        self._vllm_rows: torch.Tensor | None = None
        self.routers = [m for m in unwrap(model).modules() if isinstance(m, TopKRouter)]
        for router in self.routers:
            router.register_forward_hook(self._count)

    def _count(self, router, args, output) -> None:
        if not router.training:
            return  # scoring passes (no grad, eval mode) are not the update's routing
        _, routing_map = output
        i = router.layer_number - 1
        self.counts[i] += routing_map.detach().sum(0).to(torch.float64).cpu()
        self.calls[i] += 1
        if self._vllm_rows is not None:
            with torch.no_grad():  # the router's own choice against vLLM's, on its rows
                keep = self._vllm_rows[:, moe_layer_index(router)]
                x = args[0].reshape(-1, router.weight.shape[1])[keep].float()
                own = torch.topk(x @ router.weight.float().t(), router.topk,
                                 dim=-1).indices.sort(-1).values
                used = router.router_replay.target_topk_idx[keep].sort(-1).values
                self.mismatch[0] += float((own != used).any(-1).sum())
                self.mismatch[1] += own.shape[0]

    def replaying(self, vllm_rows: torch.Tensor | None, missing: int = 0) -> None:
        """A replayed forward starts (`vllm_rows` [rows, L_moe] bool: the (row, layer) pairs
        routed as vLLM did; `missing`: real ones vLLM left no route for) or ends (None)."""
        self._vllm_rows = vllm_rows
        if vllm_rows is not None:
            self.replay_rows += vllm_rows.numel()
            self.mismatch[2] += missing

    def reset(self) -> None:
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        self.counts.zero_()
        self.calls.zero_()
        self.mismatch.zero_()
        self.replay_rows = 0.0
        clear_aux_losses_tracker()

    def metrics(self) -> dict[str, float]:
        """The step's routing scalars (collective over `group`; same keys on every rank)."""
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        tracker = get_moe_layer_wise_logging_tracker()
        names = self.losses
        losses = torch.zeros(len(names), dtype=torch.float64)
        sliced = self.tp_slices > 1
        if self.counts_here or sliced:
            for j, name in enumerate(names):
                if name in tracker:  # z-loss: this slice's token mean -> the TP mean
                    div = self.tp_slices if name == "z_loss" else 1
                    losses[j] = tracker[name]["values"].double().sum().cpu() / div
        replay = torch.cat([self.mismatch, torch.tensor([self.replay_rows], dtype=torch.float64)])
        calls = self.calls if self.counts_here else torch.zeros_like(self.calls)
        mine = [self.counts.flatten(), calls, replay]
        flat = torch.cat([*(mine if self.counts_here or sliced
                            else [torch.zeros_like(t) for t in mine]), losses])
        dist.all_reduce(flat, group=self.group)
        n = self.counts.numel()
        counts = flat[:n].view_as(self.counts)
        calls = flat[n:n + len(self.calls)]
        differ, pairs, missing, rows = flat[n + len(self.calls): n + len(self.calls) + 4].tolist()
        losses = flat[n + len(self.calls) + 4:]
        routed = counts.sum(1) > 0
        if not bool(routed.any()):
            return {}
        mean = counts[routed].mean(1, keepdim=True)
        load = counts[routed] / mean
        out = {"moe_max_load": float(load.max()), "moe_min_load": float(load.min()),
               "moe_tokens_per_expert": float(mean.mean())}
        for name, total in zip(names, losses.tolist()):
            out[f"moe_{name}"] = total / max(float(calls.sum()), 1.0)
        if rows:
            out.update(moe_routing_mismatch=differ / max(pairs, 1.0),
                       moe_replay_missing=missing / rows)
        return out


# ------------------------------------------------------------------ vLLM's routing
class RouteCapture:
    """The experts an in-process vLLM engine routes every token to while it generates:
    `routes[request id][position]` = [L_moe][k] sorted expert ids (request ids as vLLM's runner
    names them: the request's id, or `{sample}_{id}` for the samples of an n > 1 request)."""

    def __init__(self, llm, topk: int):
        self.runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        self.topk = topk
        self.routes: dict[str, dict[int, list]] = {}
        self._rows: list[tuple[str, int]] = []
        model = self.runner.get_model()
        self.gates = [m.mlp.gate for m in model.model.layers if hasattr(m.mlp, "gate")]
        for m in model.modules():  # Qwen2-MoE: a router fused with the shared-expert gate
            if getattr(m, "_fse_fuse_gate", False):  # bypasses the gate module: unfuse it
                m._fse_fuse_gate = False
        model.register_forward_pre_hook(self._layout, with_kwargs=True)
        for i, gate in enumerate(self.gates):
            gate.register_forward_hook(self._hook(i))

    @property
    def num_layers(self) -> int:
        """MoE layers (routers) of the model."""
        return len(self.gates)

    def reset(self) -> None:
        self.routes.clear()

    def _layout(self, module, args, kwargs) -> None:
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        batch = self.runner.input_batch
        n = batch.num_reqs
        starts = self.runner.query_start_loc.cpu[: n + 1].tolist()
        # the runner's ids are the request's own id plus "-<random suffix>"
        ids = [r.rsplit("-", 1)[0] for r in batch.req_ids[:n]]
        pos = positions.tolist()
        self._rows = [(ids[bisect.bisect_right(starts, r) - 1], pos[r])
                      for r in range(starts[-1])]

    def _hook(self, layer: int):
        def record(module, args, output) -> None:
            logits = output[0] if isinstance(output, tuple) else output
            top = torch.topk(logits.float(), self.topk, dim=-1).indices.sort(-1).values.tolist()
            for r, (req, p) in enumerate(self._rows):
                per = self.routes.setdefault(req, {}).setdefault(p, [None] * self.num_layers)
                per[layer] = top[r]
        return record

    def sequence(self, request: str, length: int, prompt: dict[int, list] | None = None
                 ) -> torch.Tensor:
        """[length, L_moe, k] int16 routes of positions 0..length-1 of `request`: -1 where
        vLLM computed none, -2 on the last position (no forward reads that token); `prompt`:
        positions another request of the same prompt computed (prefix caching skips them for
        the others)."""
        out = torch.full((length, self.num_layers, self.topk), -1, dtype=torch.int16)
        out[length - 1] = -2
        mine = self.routes.get(request, {})
        for p in range(length - 1):
            per = mine.get(p) or (prompt or {}).get(p)
            if per is not None and all(x is not None for x in per):
                out[p] = torch.tensor(per, dtype=torch.int16)
        return out


# ------------------------------------------------------------------ routing replay
class ReplayState:
    """What a replaying model's forwards report to (the step's routing statistics)."""

    def __init__(self, monitor: RoutingMonitor | None):
        self.monitor = monitor


def enable_replay(model: torch.nn.Module, monitor: RoutingMonitor | None = None) -> None:
    """Makes `model`'s forwards through `megagrpo.train.passes.forward_step` replay the batch's
    routes (the policy's; the reference routes by itself)."""
    setattr(unwrap(model), REPLAY_ATTR, ReplayState(monitor))


def replay_state(model: torch.nn.Module) -> ReplayState | None:
    """The model's `ReplayState` (None: it routes by itself)."""
    return getattr(unwrap(model), REPLAY_ATTR, None)


def token_routes(routes: torch.Tensor, topk: int) -> tuple[torch.Tensor, int]:
    """Router-row routes [rows, L_moe, k] (any order) -> int64 with every negative row
    replaced by experts 0..k-1, and how many of those (token, layer) rows had a real token
    vLLM left no route for (-1; padding and last tokens, -2 / pad -1 rows aside: see
    `Batch.routes`)."""
    fill = (routes < 0).any(-1)
    out = routes.long()
    out[fill] = torch.arange(topk, device=out.device)
    return out, int((routes == -1).any(-1).sum())


def moe_layer_index(router) -> int:
    """Index of `router`'s layer among the model's MoE layers (the routes' L_moe axis)."""
    pattern = router.config.moe_layer_freq
    if isinstance(pattern, int):
        pattern = [int(i % pattern == 0) for i in range(router.config.num_layers)]
    return sum(pattern[: router.layer_number - 1])


@contextmanager
def replay(model: torch.nn.Module, routes: torch.Tensor, monitor: RoutingMonitor | None = None):
    """One forward of `model` routing its tokens by `routes` [rows, L_moe, k] (router-row
    order: megatron's [S, B] flattened, or the packed tokens in order) through megatron's
    RouterReplay (REPLAY_FORWARD) on every router of this stage; `monitor` counts the rows and
    those without a vLLM route."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = [m for m in unwrap(model).modules() if isinstance(m, TopKRouter)]
    target, missing = token_routes(routes, routes.shape[-1])
    for router in routers:
        router.router_replay.set_target_indices(target[:, moe_layer_index(router)])
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    if monitor is not None:
        monitor.replaying((routes >= 0).all(-1), missing)
    try:
        yield
    finally:
        for router in routers:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()
        if monitor is not None:
            monitor.replaying(None)


def check_routing_replay(on: bool, model, pipelined_by: tuple | None) -> None:
    """algo.routing_replay (`on`) needs experts to route (`model`, the run's ModelConfig) and no
    batch drawn ahead (`pipelined_by`: `TrainConfig.pipelined_by()`), whose checkpoint would
    lack its routes."""
    if on and not model.is_moe:
        raise ValueError(f"algo.routing_replay=true: model.architecture={model.architecture!r} "
                         "has no experts to route; set algo.routing_replay=false")
    if on and pipelined_by:
        raise ValueError(f"algo.routing_replay=true with {pipelined_by[1]}: each batch drawn "
                         f"ahead is checkpointed without its routes; set {pipelined_by[2]} or "
                         "algo.routing_replay=false")


class NoRouting:
    """A dense policy's routing statistics: none (`routing_monitor`)."""

    def reset(self) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}


def routing_monitor(policy, model_cfg, parallel, *, replay: bool, tp_rank: int, group
                    ) -> RoutingMonitor | NoRouting:
    """The update's routing statistics of an MoE `policy` (tokens per expert, megatron's
    auxiliary losses; counted on TP rank 0, reduced over `group`), with routing replay
    switched on when `replay` (algo.routing_replay); `NoRouting` for a dense one."""
    if model_cfg is None or not model_cfg.is_moe or policy is None:
        return NoRouting()
    monitor = RoutingMonitor(policy, model_cfg.num_layers, model_cfg.num_experts,
                             losses=tracked_losses(model_cfg), counts_here=tp_rank == 0,
                             group=group, tp_slices=tp_slices(parallel))
    if replay:
        enable_replay(policy, monitor)
    return monitor
