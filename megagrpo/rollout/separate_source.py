"""The trainer's side of separate placement: `SeparateSource`, the
`megagrpo.rollout.stream.RolloutSource` the rollout ranks feed, and `InFlightState`, the
rollout ranks' part of a checkpoint (`megagrpo.rollout.placement`'s module docstring)."""
from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from megagrpo.rollout.collect import dynamic_sampling
from megagrpo.rollout.in_flight import receive_state
from megagrpo.rollout.placement import Placement, RemoteEngine
from megagrpo.rollout.sample_channel import TensorChannel, merged
from megagrpo.rollout.stream import StreamStats

if TYPE_CHECKING:
    from megagrpo.config.train import TrainConfig
    from megagrpo.data import PromptLoader
    from megagrpo.rollout.stream import Rollout
    from megagrpo.runtime.distributed import Groups, Ranks

log = logging.getLogger("megagrpo")


# ---------------------------------------------------------------------- the trainer's source
@dataclass(frozen=True)
class SeparateLayout:
    """What the trainer reads of a rollout layout under separate placement: the feed is full
    tensors (the rollout ranks' TP is 1)."""

    shard_to_shard: bool = False


@dataclass(kw_only=True)
class SeparateSource:
    """The separate-placement `megagrpo.rollout.stream.RolloutSource`: the trainer's side of the
    stream the rollout ranks feed (module docstring)."""

    cfg: TrainConfig
    place: Placement
    engine: RemoteEngine
    loader: PromptLoader
    """This replica's prompts, walked batch by batch in step with the rollout ranks: its
    position is the next untrained batch (checkpointed as in colocated runs)."""
    tokenizer: object
    ranks: Ranks
    groups: Groups
    layout: SeparateLayout = field(default_factory=SeparateLayout)
    stats: StreamStats = field(default_factory=StreamStats)
    taken: int = 0
    """Batches taken in this launch (the next one's index in the store)."""
    versions: dict[int, int] = field(default_factory=dict)
    """Sync index -> the policy version it carried."""
    queue: list = field(default_factory=list)
    """Always empty: batches sampled ahead stay with the rollout ranks (a checkpoint holds them
    as the rollout ranks' in-flight state, `InFlightState`)."""
    channel: TensorChannel | None = None
    """This rank's end of the sample channel (built from `place` when not given)."""
    topups: int = 0
    """Dynamic-sampling top-ups asked for in this launch (the next one's index in the store)."""
    said_out: set = field(default_factory=set)
    said_no_restart: bool = False

    def __post_init__(self) -> None:
        if self.channel is None:
            self.channel = self.place.channel(self.cfg.data.batch_size,
                                              (self.ranks.dp_rank, self.ranks.dp))

    def next(self, version: int) -> Rollout:
        """This step's rollout: the next batch from the rollout ranks; with dynamic sampling
        (algo.dynamic_sampling) its groups with reward spread, topped up by the next batches
        the rollout ranks draw, as the colocated collector does. `version` is what the last
        sync carried (Trainer.engine_version)."""
        ro = self._take(version)
        if not self.cfg.algo.dynamic_sampling:
            return ro
        return dynamic_sampling(ro, functools.partial(self._top_up, version), self.cfg.algo,
                                self.groups.world)

    def _top_up(self, version: int) -> Rollout:
        """A dynamic-sampling top-up: training rank 0 asks the rollout ranks for it in the store
        (they draw it with the weights of the step it tops up), then every training rank takes
        it as the stream's next batch."""
        if self.ranks.rank == 0:
            self.place.store.set(f"topup/{self.topups}", "1")
        self.topups += 1
        return self._take(version)

    def _take(self, version: int) -> Rollout:
        """Batch `taken` from the rollout ranks (waits for it), this replica's slice."""
        from megagrpo.rollout.stream import Rollout

        i = self.taken
        self._map_syncs(version)
        before = self.loader.state_dict()
        examples = next(self.loader)
        parts = self.channel.take(i)
        bad = [p.loader for p in parts if _position(p.loader) != _position(before)]
        if bad:
            raise RuntimeError(f"separate placement: rollout ranks sampled batch {bad[0]} where "
                               f"the trainer expected {before}")
        n, R = len(examples), self.place.rollout_ranks
        lo = self.ranks.dp_rank * n
        comps, rewards = merged(parts, lo, lo + n, self.versions)
        metrics = {}
        for p in parts:  # counts over the whole batch: per replica on average
            for key, v in p.metrics.items():
                metrics[key] = metrics.get(key, 0.0) + v / self.ranks.dp
        if self.place.failover:
            self._say_outs()
            metrics["rollout_ranks_out"] = float(len(self.channel.outs))
            metrics["rollout_makeups"] = float(sum(p.by is not None for p in parts))
        self.stats = StreamStats(queue_depth=self._waiting(i + 1),
                                 draw_s=max(p.draw_s for p in parts) if R else 0.0)
        if self.ranks.rank == 0 and i >= 2:
            self.channel.forget(i - 2)
        self.taken += 1
        return Rollout(prompts=[_encode(self.tokenizer, e.prompt) for e in examples],
                       answers=[e.answer for e in examples], completions=comps,
                       rewards=torch.tensor(rewards),
                       version=int(comps.column("version").min()) if len(comps) else version,
                       epoch=self.loader.epoch, metrics=metrics)

    def _say_outs(self) -> None:
        """Training rank 0: a console line for each rollout rank newly seen out."""
        for j, gone in sorted(self.channel.outs.items()):
            if j in self.said_out or self.ranks.rank != 0:
                continue
            self.said_out.add(j)
            live = self.place.rollout_ranks - len(self.channel.outs)
            log.warning("rollout rank %d is out: its engine (pid %d) %s at batch %d; its "
                        "prompts go to the %d other rollout rank(s) until the next checkpoint "
                        "(rollout.engine_failure=continue)", self.place.train_world + j,
                        gone["pid"], gone["how"], gone["batch"], live)

    @property
    def degraded(self) -> bool:
        """Training rank 0: a rollout rank is out (its view; `ends_attempt` agrees it)."""
        return any(self.channel.out(j) is not None for j in range(self.place.rollout_ranks))

    def ends_attempt(self, attempt) -> bool:
        """Every training rank, after a checkpoint: whether this torchrun attempt ends here
        (rollout.engine_failure=continue, a rollout rank out and a restart left, so that the job
        goes on with every rollout rank). Rank 0's view decides, broadcast over the training
        ranks."""
        if not self.place.failover:
            return False
        flag = torch.tensor([int(self.ranks.rank == 0 and self.degraded)], dtype=torch.int64)
        dist.broadcast(flag, 0, group=self.groups.world)
        if not flag.item():
            return False
        self._say_outs()
        if attempt.number < attempt.max_restarts:
            return True
        if self.ranks.rank == 0 and not self.said_no_restart:
            log.warning("rollout.engine_failure=continue: no torchrun restart left (--max-"
                        "restarts=%d): the run goes on with %d of %d rollout ranks to its end",
                        attempt.max_restarts, self.place.rollout_ranks - len(self.channel.outs),
                        self.place.rollout_ranks)
        self.said_no_restart = True
        return False

    def _map_syncs(self, version: int) -> None:
        """The syncs sent since the last step carried `version` (what the last one carried)."""
        for s in range(len(self.versions), self.engine.syncs):
            self.versions[s] = version

    def in_flight(self, version: int) -> list[dict]:
        """Training rank 0, at a checkpoint (`version`: what the last sync carried): every
        rollout rank's in-flight state (`save_in_flight`), in rollout-rank order."""
        self._map_syncs(version)
        if self.degraded:  # a rollout rank is out: none is asked (`InFlightState`)
            return []
        self.engine.request_checkpoint(self.taken, self.versions)
        states = [receive_state(self.place.samples, self.place.train_world + j)
                  for j in range(self.place.rollout_ranks)]
        return [] if any(s["out"] for s in states) else states

    def _waiting(self, first: int) -> int:
        """Finished batches from `first` on (every rollout rank's part in)."""
        n = 0
        while self.channel.finished(first + n):
            n += 1
        return n

    def join(self) -> None:
        """Nothing runs on the trainer's side between steps."""

    def ahead_loader_states(self) -> list[dict]:
        return []  # the loader itself stands at the next untrained batch

    def return_batches(self, loader_states: list[dict]) -> None:
        raise ValueError("this checkpoint holds batches a colocated async run drew ahead; "
                         "rollout.placement=separate cannot take them over: resume it with "
                         "rollout.placement=colocated")

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def evaluate(self, examples) -> float:
        """Greedy held-out accuracy of `examples` on the rollout ranks' engines, with the
        weights of the last sync (every training rank waits for it and gets the same)."""
        e = self.engine.request_eval(examples)
        keys = [f"eval/{e}/{j}" for j in range(self.place.rollout_ranks)]
        self.place.store.wait(keys, timedelta(seconds=self.place.timeout_s))
        got = [json.loads(self.place.store.get(k)) for k in keys]
        counted = sum(n for _, n in got)
        if counted < len(examples) and self.ranks.rank == 0:
            log.warning("held-out evaluation %d: %d of %d examples evaluated (the shares of "
                        "rollout ranks that are out are not)", e, counted, len(examples))
        return sum(c for c, _ in got) / max(counted, 1)


class Versioned(Protocol):
    engine_version: int
    """The policy version the last sync carried (`Trainer.engine_version`)."""


@dataclass
class InFlightState:
    """The rollout ranks' side of a separate-placement checkpoint, a per-rank part held by
    training rank 0 (the other training ranks hold nothing): each rollout rank's finished
    parts the trainer has not taken, and the sampler's streams and loader position of its next
    draw (`save_in_flight`), asked for as the checkpoint is written, so it is in the same
    manifest as the weights. Restored (sent with the first sync, `restore_in_flight`) where
    the rollout ranks and rollout.max_staleness are the same; otherwise the console says so and
    the batches drawn ahead are drawn again from the same prompts."""

    source: SeparateSource
    trainer: Versioned

    def state_dict(self) -> dict:
        if self.source.place.cross is None:
            return {}
        states = self.source.in_flight(self.trainer.engine_version)
        return {"rollout_ranks": states, "max_staleness": self.source.cfg.staleness,
                "degraded": not states}

    def load_state_dict(self, state: dict) -> None:
        if self.source.place.cross is None or not state:
            return
        saved, k = state["rollout_ranks"], self.source.cfg.staleness
        if state.get("degraded"):
            log.warning("resume: the checkpoint was written while a rollout rank was out "
                        "(rollout.engine_failure=continue): it holds no in-flight state, so the "
                        "batches the rollout ranks drew ahead are drawn again from the same "
                        "prompts (not bitwise)")
            return
        if len(saved) != self.source.place.rollout_ranks or state["max_staleness"] != k:
            log.warning("resume: the rollout ranks' in-flight state is not restored (saved with "
                        "%d rollout ranks at rollout.max_staleness=%d, now %d at %d): the "
                        "batches they drew ahead are drawn again from the same prompts and the "
                        "run does not continue bitwise", len(saved), state["max_staleness"],
                        self.source.place.rollout_ranks, k)
            return
        self.source.engine.restore = saved



def _position(state: dict) -> tuple[int, int]:
    """A loader position comparable across DP layouts: (epoch, batch index)."""
    return state["epoch"], state["index"]


def _encode(tokenizer, prompt) -> list[int]:
    from megagrpo.data import encode_prompt

    return encode_prompt(tokenizer, prompt)


__all__ = ["InFlightState", "SeparateLayout", "SeparateSource"]

