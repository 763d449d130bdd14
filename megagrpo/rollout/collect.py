"""The rollout stage, and evaluation: prompts from the loader -> the vLLM engines -> decoded
text -> rewards, gathered so that every rank of a DP replica holds its whole batch.

Rollouts are data-parallel over *all* ranks: the in-process vLLM engines (one per rank, or one
per k = rollout.tensor_parallel_size consecutive ranks; `megagrpo.config.layout`) each sample a
slice of their DP replica's prompts and the replica's TP x CP x PP ranks all-gather the
results.
Evaluation splits the held-out set over the engines the same way and scores greedy completions
with the same generate -> decode -> score path (`RolloutCollector.score`). The collector is the
colocated `megagrpo.rollout.stream.RolloutSource`: with k = rollout.max_staleness >= 1 it keeps up
to k batches drawn ahead, drawing them on a side thread that runs no collective (gloo groups are not
for concurrent use) while a step trains; k = 0 draws each batch when the step asks.
With the agent on (cfg.agent), sampling and evaluation run multi-turn trajectories through
`megagrpo.agent.runner.TrajectoryRunner` (the prompts' data records build the environments).
Scoring goes through the reward component (`megagrpo.reward.Rewards`, built once at set-up) on
whole samples (prompt, completion or trajectory, data record; the environments' per-turn rewards
join there); a batch drawn ahead keeps its pending scores until it is gathered, so a source that
scores asynchronously overlaps later sampling.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megagrpo import algo
from megagrpo.agent.runner import TrajectoryRunner, environment_factory, spans
from megagrpo.config.algo import AlgoConfig
from megagrpo.config.layout import RolloutLayout
from megagrpo.config.train import TrainConfig
from megagrpo.data import IMAGE_FIELD, encode_prompt, image_prompt, load_images
from megagrpo.engine import Completion, SamplingSettings
from megagrpo.engine.partial import start_trajectories
from megagrpo.engine.types import model_versions
from megagrpo.reward import PendingScores, Rewards, chain, samples_of
from megagrpo.rollout.stream import Rollout, StreamStats, stamp
from megagrpo.runtime.distributed import Groups, Ranks, any_rank

if TYPE_CHECKING:
    from megagrpo.data import Example, PromptLoader
    from megagrpo.engine import RolloutEngine

log = logging.getLogger("megagrpo")


@dataclass
class Drawn:
    """A batch of prompts and this rank's slice of its samples, before the gather."""

    prompts: list[list[int]]
    answers: list[str]
    epoch: int
    version: int
    """The policy version vLLM held while it sampled."""
    completions: list[Completion]
    """This rank's scored completions (empty off the engine's leader rank)."""
    rewards: list[float]
    metrics: dict
    loader_state: dict = field(default_factory=dict)
    """The loader's position before this batch was drawn: where a resume that cannot restore
    the batch itself draws it again."""
    pending: PendingScores | None = None
    """Scores not awaited yet (`resolve` fills `rewards`, `metrics` and each `correct`)."""
    unfinished: list = field(default_factory=list)
    """rollout.partial_rollouts: this rank's trajectories paused at a weight update (tokens,
    log-probs and per-token versions so far), continued by a later draw; the batch is scored
    once none is left. `Completion`s, or with the agent on the runner's trajectories (their
    environments in memory; `megagrpo.agent.runner.TrajectoryRunner.advance`)."""
    records: list[dict] = field(default_factory=list)
    """rollout.partial_rollouts: the prompts' data records, for the scoring when it ends."""
    texts: list[str] = field(default_factory=list)
    """rollout.partial_rollouts: the prompts' text, for the scoring when it ends."""
    images: list | None = None
    """A vision-language model: per prompt, its (pixel_values, image_grid_thw) or None (no
    images); `prompts` then hold the expanded ids (`ImagePrompts`)."""

    def resolve(self) -> Drawn:
        """Waits for pending scores and records them (no-op once scored)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            t0 = time.perf_counter()
            rewards, metrics = record_scores(self.completions, pending)
            # the reward phase: what scoring blocked, overlapped and still kept the gather
            # waiting for (docs/rewards.md#overlap-and-the-metrics)
            metrics.update(pending.timing(t0, time.perf_counter()))
            self.rewards, self.metrics = rewards.tolist(), dict(self.metrics, **metrics)
        return self

    def state_dict(self, keep: Callable | None = None) -> dict:
        """Its state; `keep`: what a checkpoint keeps of a paused multi-turn trajectory
        (`megagrpo.agent.runner.TrajectoryRunner.saved`: whole where its environment saves
        its state, else its prompt and place; only a collector with a runner holds those)."""
        self.resolve()
        unfinished = [dataclasses.asdict(u) if isinstance(u, Completion) else keep(u)
                      for u in self.unfinished]
        state = dataclasses.asdict(dataclasses.replace(self, pending=None, unfinished=[]))
        del state["pending"]
        state["unfinished"] = unfinished
        return state  # completions included, as dicts

    @classmethod
    def from_state(cls, state: dict) -> Drawn:
        """Its state loaded; a multi-turn trajectory saved whole stays a dict (continued by
        the collector's runner: `RolloutCollector._resume_paused`)."""
        return cls(**dict(state, completions=[Completion(**c) for c in state["completions"]],
                          unfinished=[u if "trajectory" in u else Completion(**u)
                                      for u in state.get("unfinished", ())]))


@dataclass
class Returned:
    """A batch drawn ahead that a resume could not restore: its prompts, back in the stream."""

    examples: list[Example]
    """This replica's `Example`s of the batch."""
    epoch: int
    loader_state: dict
    """The loader's position before the batch (saved again should the run stop first)."""


@dataclass
class ImagePrompts:
    """A vision-language model's prompts: each record's images (`IMAGE_FIELD`) loaded and run
    through the model folder's image processor (`megagrpo.data.image_prompt`). vLLM gets the
    placeholder form and the images; the trainer's rows are the expanded ids with the
    processor's pixels, and each completion's expanded prompt from vLLM must equal them."""

    processor: object
    image_token_id: int
    merge_size: int

    @classmethod
    def build(cls, model, folder: str) -> ImagePrompts:
        """The image processor of `folder` (data.tokenizer: the run's tokenizer snapshot
        keeps the source's preprocessor_config.json) for `model` (a VLM ModelConfig)."""
        from megagrpo.data import load_image_processor

        try:
            processor = load_image_processor(folder)
        except ValueError as e:
            raise ValueError(f"data.tokenizer={folder!r}: {e}") from None
        return cls(processor, model.image_token_id, model.vision.spatial_merge_size)

    def prepare(self, prompts: list[list[int]], records: list[dict]
                ) -> tuple[list, list[list[int]], list]:
        """(per prompt its PIL images or None, for `generate(images=)`; the expanded ids; the
        (pixel_values, image_grid_thw) or None, for the batch)."""
        pil, expanded, rows = [], [], []
        for ids, rec in zip(prompts, records, strict=True):
            imgs = load_images(rec.get(IMAGE_FIELD) or [])
            full, pixels, grid = image_prompt(ids, imgs, self.processor,
                                              image_token_id=self.image_token_id,
                                              merge_size=self.merge_size)
            pil.append(imgs or None)
            expanded.append(full)
            rows.append(None if pixels is None else (pixels, grid))
        return pil, expanded, rows


@dataclass(kw_only=True)
class RolloutCollector:
    """Samples, scores and gathers a step's rollouts; evaluates held-out accuracy. The colocated
    `megagrpo.rollout.stream.RolloutSource` (sync at k = 0, async at k >= 1)."""

    cfg: TrainConfig
    engine: RolloutEngine
    """This rank's vLLM engine."""
    loader: PromptLoader
    """This DP replica's prompt stream."""
    tokenizer: object
    rewards: Rewards
    """The reward component (`megagrpo.reward.build_rewards`)."""
    layout: RolloutLayout
    """Which ranks form this rank's engine and which prompts it samples."""
    ranks: Ranks = field(default_factory=Ranks)
    groups: Groups = field(default_factory=Groups)
    stop_ids: tuple[int, ...] = ()
    """Token ids that end a completion."""
    queue: list[Drawn] = field(default_factory=list)
    """k >= 1: the batches drawn ahead for the next steps, oldest first."""
    returned: list[Returned] = field(default_factory=list)
    """Prompts of batches drawn ahead before a resume that did not restore them: drawn first."""
    stats: StreamStats = field(default_factory=StreamStats)
    """This step's queue depth and sampling time."""
    thread: threading.Thread | None = None
    failure: BaseException | None = None
    """What the side thread raised; `join` re-raises it on the main thread."""
    runner: TrajectoryRunner | None = None
    """Multi-turn rollouts (cfg.agent enabled; built from agent.environment when None)."""
    pause: threading.Event = field(default_factory=threading.Event)
    """rollout.partial_rollouts: set by `join` (the weight update is next): the draw on the
    side thread pauses its unfinished trajectories between two decode steps and returns."""
    vision: ImagePrompts | None = None
    """A vision-language model: how records' images reach vLLM and the batch (None: text)."""

    def __post_init__(self) -> None:
        if self.cfg.agent.enabled and self.runner is None:
            self.runner = TrajectoryRunner(
                engine=self.engine, tokenizer=self.tokenizer,
                factory=environment_factory(self.cfg.agent, self.tokenizer),
                agent=self.cfg.agent, max_model_len=self.cfg.rollout.max_model_len)

    # ------------------------------------------------------------------ shared
    def _generate(self, prompts: list[list[int]], answers: list[str], mine: list[int],
                  sampling: SamplingSettings, records: list[dict] | None = None,
                  texts: list[str] | None = None, images: tuple | None = None
                  ) -> tuple[list[Completion], torch.Tensor, dict]:
        """`_sample`, its scores awaited: (completions, rewards [n], reward metrics)."""
        comps, pending = self._sample(prompts, answers, mine, sampling, records, texts,
                                      images=images)
        rewards, metrics = record_scores(comps, pending)
        return comps, rewards, metrics

    def _sample(self, prompts: list[list[int]], answers: list[str], mine: list[int],
                sampling: SamplingSettings, records: list[dict] | None = None,
                texts: list[str] | None = None, chunks: int = 1, images: tuple | None = None
                ) -> tuple[list[Completion], PendingScores]:
        """Generates the `mine` prompts on this rank's engine (multi-turn trajectories through
        `runner` when the agent is on) and submits them to the reward component as whole
        samples (`records`: the prompts' data records, `texts`: their text, decoded from the
        ids when not given); the engine's leader (its TP rank 0) scores and reports them, the
        other ranks report nothing. Each completion's `prompt_index` indexes `prompts`.
        `chunks` > 1 (reward.score_chunks): `mine` is sampled in that many consecutive slices,
        each submitted as soon as it is sampled, so a source answering with a future scores
        the first groups while the later ones sample. `images`: a vision-language model's
        (PIL images per prompt, expanded ids per prompt) (`ImagePrompts.prepare`)."""
        recs = records if records is not None else [{}] * len(prompts)
        comps: list[Completion] = []
        pendings: list[PendingScores] = []
        for part in _slices(mine, chunks):
            got = self._generate_slice(prompts, part, sampling, recs, images)
            if not got:  # off the engine's leader: nothing to score
                continue
            shown = texts if texts is not None else {  # decoded where no caller had the text
                p: self.tokenizer.decode(prompts[p]) for p in {c.prompt_index for c in got}}
            samples = samples_of(got, [c.prompt_index for c in got], prompts=prompts,
                                 texts=shown, answers=answers, records=recs,
                                 decode=self._decode)
            pendings.append(self.rewards.submit(samples))
            comps += got
        return comps, chain(pendings) if pendings else self.rewards.submit([])

    def _generate_slice(self, prompts: list[list[int]], part: list[int],
                        sampling: SamplingSettings, records: list[dict],
                        images: tuple | None = None) -> list[Completion]:
        """This engine's completions of the prompts `part` indexes (the leader's; [] on the
        engine's other ranks), `prompt_index` indexing `prompts`. `images` (a VLM): (PIL
        images per prompt, expanded ids per prompt); every completion's expanded prompt from
        vLLM is checked equal to the trainer's."""
        if self.runner is not None:
            comps = self.runner.run([prompts[i] for i in part], [records[i] for i in part],
                                    sampling)
        elif images is not None:
            comps = self.engine.generate([prompts[i] for i in part], sampling,
                                         images=[images[0][i] for i in part])
        else:
            comps = self.engine.generate([prompts[i] for i in part], sampling)
        if not self.layout.is_leader:
            return []
        for c in comps:
            c.prompt_index = part[c.prompt_index]
        if images is not None:
            for c in comps:
                got = c.prompt_token_ids or prompts[c.prompt_index]
                if got != images[1][c.prompt_index]:
                    raise RuntimeError(
                        f"prompt {c.prompt_index}: vLLM expanded its image placeholders to "
                        f"{len(got)} tokens, megagrpo.data.image_prompt to "
                        f"{len(images[1][c.prompt_index])}: the trainer would score other "
                        "rows than vLLM sampled from (the image processors disagree)")
        return comps

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    # ------------------------------------------------------------------ rollouts
    def sampling(self) -> SamplingSettings:
        r = self.cfg.rollout
        return SamplingSettings(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                max_tokens=r.max_tokens, stop=tuple(r.stop),
                                n=self.cfg.algo.group_size, stop_token_ids=self.stop_ids)

    def _next_examples(self) -> tuple[list, int, dict]:
        """The next batch's examples, its data epoch and the loader position before it:
        returned batches first, then the loader."""
        if self.returned:
            r = self.returned.pop(0)
            return r.examples, r.epoch, r.loader_state
        before = self.loader.state_dict()
        examples = next(self.loader)
        return examples, self.loader.epoch, before

    def draw(self, version: int, pause: threading.Event | None = None) -> Drawn:
        """The next prompts, sampled on this rank's engine (which holds policy `version`; each
        completion records it). No collective unless the layout is pooled, so it may run on
        the async thread. rollout.partial_rollouts: `pause` set stops the draw between two
        decode steps, its unfinished trajectories kept in `Drawn.unfinished` (`advance`)."""
        t0 = time.perf_counter()
        examples, epoch, before = self._next_examples()
        if self.cfg.rollout.partial_rollouts:
            mine, G = self.layout.prompt_indices(len(examples)), self.cfg.algo.group_size
            prompts = [encode_prompt(self.tokenizer, e.prompt) for e in examples]
            drawn = Drawn(prompts, [e.answer for e in examples], epoch, version, [], [], {},
                          loader_state=before,
                          unfinished=self.start_partial(prompts, mine, G),
                          records=[e.record for e in examples],
                          texts=[e.prompt for e in examples])
            self.stats.draw_s += time.perf_counter() - t0
            self.advance(drawn, version, pause)
            return drawn
        prompts = [encode_prompt(self.tokenizer, e.prompt) for e in examples]
        answers = [e.answer for e in examples]
        # the environments' and the reward source's inputs
        records, texts = [e.record for e in examples], [e.prompt for e in examples]
        images, rows, pixels = None, prompts, None
        if self.vision is not None:  # not pooled: TrainConfig._validate_vlm (engine TP 1)
            pil, rows, pixels = self.vision.prepare(prompts, records)
            images = (pil, rows)
        pool = (self._pool(prompts, answers, records, texts) if self.layout.pooled
                else (prompts, answers, records, texts))
        mine = self.layout.prompt_indices(len(pool[0]))  # this rank's engine's slice
        comps, pending = self._sample(pool[0], pool[1], mine, self.sampling(), pool[2], pool[3],
                                      chunks=self.cfg.reward.score_chunks, images=images)
        stamp(comps, version)
        self.stats.draw_s += time.perf_counter() - t0  # one thread draws at a time
        # scores are awaited when the batch is gathered (`Drawn.resolve`); a VLM's rows are
        # the expanded prompts with their images
        return Drawn(rows, answers, epoch, version, comps, [], {}, loader_state=before,
                     pending=pending, images=pixels)

    def advance(self, drawn: Drawn, version: int, pause: threading.Event | None = None) -> None:
        """rollout.partial_rollouts: generates the batch's unfinished trajectories on, with the
        weights of policy `version`, until they end or `pause` is set (`continue_partial`). A
        batch left with none unfinished is stamped and handed to the reward component."""
        t0 = time.perf_counter()
        res = self.continue_partial(drawn.prompts, drawn.records, drawn.unfinished, version,
                                    pause)
        drawn.completions += res.finished
        drawn.unfinished = res.paused
        drawn.metrics["partial_recomputed_tokens"] = (
            drawn.metrics.get("partial_recomputed_tokens", 0.0) + float(res.recomputed))
        if not drawn.unfinished:
            stamp(drawn.completions, drawn.version)
            drawn.completions, drawn.pending = self.finish_partial(
                drawn.completions, drawn.prompts, drawn.answers, drawn.records, drawn.texts,
                drawn.metrics)
        self.stats.draw_s += time.perf_counter() - t0

    # ------------------------------------------------- partial rollouts, both placements
    def start_partial(self, prompts: list[list[int]], mine: list[int], n: int) -> list:
        """rollout.partial_rollouts: `n` trajectories of each prompt `mine` indexes, nothing
        sampled yet (the runner's, environments made at their first turn, with the agent on)."""
        return self.runner.start(prompts, mine, n) if self.runner else start_trajectories(mine, n)

    def continue_partial(self, prompts: list[list[int]], records: list[dict], trajs: list,
                         version: int, pause: threading.Event | None):
        """rollout.partial_rollouts: generates `trajs` on with the weights of policy (or sync)
        `version` until they end or `pause` is set; then those below the cap
        (rollout.partial_max_updates, else k) are handed back paused (multi-turn: mid-turn or
        between turns), the others generated to their end first (`megagrpo.engine.partial`).
        Returns the engine's `PartialResult` (the runner's `PausedTurns`)."""
        cap = self.cfg.rollout.partial_max_updates or self.cfg.staleness
        if self.runner is not None:
            return self.runner.advance(trajs, records, self.sampling(), version=version,
                                       pause=pause, max_updates=cap)
        return self.engine.generate_partial(prompts, trajs, self.sampling(), version=version,
                                            pause=pause, max_updates=cap)

    def finish_partial(self, comps: list[Completion], prompts: list[list[int]],
                       answers: list[str], records: list[dict], texts: list[str],
                       metrics: dict) -> tuple[list[Completion], PendingScores]:
        """rollout.partial_rollouts, a batch with every trajectory ended: its completions in
        prompt order, counted into `metrics` (trajectories whose model tokens span an update;
        multi-turn: those paused mid-turn and between turns) and handed to the reward
        component as whole samples. Returns (the completions, their pending scores)."""
        comps = sorted(comps, key=lambda c: (c.prompt_index, c.sample_index))
        metrics["partial_continued"] = float(sum(len(set(model_versions(c))) > 1
                                                 for c in comps))
        if self.runner is not None:
            per = [spans(c) for c in comps]
            metrics["partial_turns_mid"] = float(sum(m > 0 for m, _ in per))
            metrics["partial_turns_between"] = float(sum(b > 0 for _, b in per))
        samples = samples_of(comps, [c.prompt_index for c in comps], prompts=prompts,
                             texts=texts, answers=answers, records=records, decode=self._decode)
        return comps, self.rewards.submit(samples)

    def gather(self, drawn: Drawn) -> Rollout:
        """All-gathers the slices over the replica (pooled layout: the world, then keeps this
        replica's prompts), so every rank of the replica holds the whole batch."""
        pooled, n = self.layout.pooled, len(drawn.prompts)
        group = self.groups.world if pooled else self.groups.replica
        if drawn.unfinished:
            raise RuntimeError("RolloutCollector.gather: the batch still has "
                               f"{len(drawn.unfinished)} paused trajectories (advance it first)")
        drawn.resolve()
        local = (drawn.completions, drawn.rewards, drawn.metrics)
        size = dist.get_world_size(group=group) if dist.is_initialized() else 1
        parts = [local] if size == 1 else [None] * size
        if size > 1:
            dist.all_gather_object(parts, local, group=group)
        lo = self.ranks.dp_rank * n if pooled else 0
        merged = sorted(((c, rw) for cs, rws, _ in parts for c, rw in zip(cs, rws)
                         if lo <= c.prompt_index < lo + n),
                        key=lambda x: (x[0].prompt_index, x[0].sample_index))
        for c, _ in merged:
            c.prompt_index -= lo
        metrics = _sum_dicts([m for _, _, m in parts])
        if pooled:  # counts over every replica's prompts: per replica on average
            metrics = {k: v / self.ranks.dp for k, v in metrics.items()}
        return Rollout(prompts=drawn.prompts, answers=drawn.answers,
                       completions=[c for c, _ in merged],
                       rewards=torch.tensor([rw for _, rw in merged]), version=drawn.version,
                       epoch=drawn.epoch, metrics=metrics, images=drawn.images)

    def _pool(self, prompts: list[list[int]], answers: list[str], records: list[dict],
              texts: list[str]) -> tuple[list, list, list, list]:
        """Pooled layout: every replica's prompts, answers, records and prompt texts,
        replica-major [dp * B]."""
        parts = [None] * dist.get_world_size(group=self.groups.world)
        dist.all_gather_object(parts, (self.ranks.dp_rank, prompts, answers, records, texts),
                               group=self.groups.world)
        by_replica = {d: rest for d, *rest in parts}
        dp = self.ranks.dp
        return tuple([x for d in range(dp) for x in by_replica[d][k]] for k in range(4))

    def rollout(self, version: int, drawn: Drawn | None = None) -> Rollout:
        """Samples G completions for a batch of prompts; with dynamic sampling, tops the batch
        up with fresh prompts until it holds data.batch_size/dp groups with reward spread."""
        ro = self.gather(drawn if drawn is not None else self.draw(version))
        if not self.cfg.algo.dynamic_sampling:
            return ro
        return self._dynamic_sampling(ro, version)

    def _dynamic_sampling(self, ro: Rollout, version: int) -> Rollout:
        return dynamic_sampling(ro, functools.partial(self._top_up, version), self.cfg.algo,
                                self.groups.world)

    def _top_up(self, version: int) -> Rollout:
        """A dynamic-sampling top-up: the next prompts, drawn and gathered now."""
        return self.gather(self.draw(version))

    def next(self, version: int) -> Rollout:
        """This step's rollout (`megagrpo.rollout.stream.RolloutSource`). k = cfg.staleness >= 1:
        the oldest batch drawn ahead (drawn now when none is), then the side thread draws with the
        engine's current weights until k batches are queued again (k at the first step, one a
        step after), so a batch is at most k versions old; the collectives (gather,
        dynamic-sampling top-ups) stay on the main thread."""
        k = self.cfg.staleness
        self.stats = StreamStats(queue_depth=len(self.queue) if k else 0)
        if not k:
            return self.rollout(version)
        drawn = self.queue.pop(0) if self.queue else self.draw(version)
        if drawn.unfinished:  # partial rollouts: the rest of the batch, by the weights it trains
            self.advance(drawn, version)
        ro = self.rollout(version, drawn)
        if len(self.queue) < k or any(d.unfinished for d in self.queue):
            self.pause.clear()
            self.thread = threading.Thread(target=self._draw_ahead,
                                           args=(version, k - len(self.queue)), daemon=True)
            self.thread.start()
        return ro

    @property
    def pending(self) -> Drawn | None:
        """The oldest batch drawn ahead (the next step's), or None."""
        return self.queue[0] if self.queue else None

    def _draw_ahead(self, version: int, n: int) -> None:
        """Draws `n` batches ahead; with partial rollouts, first continues the queued batches'
        paused trajectories (oldest first), and stops drawing at the pause. Every queued batch
        is advanced even after the pause: those of its trajectories at the cap are finished
        now, before the update (`megagrpo.engine.partial.run_partial`)."""
        try:
            for drawn in list(self.queue):
                if drawn.unfinished:
                    self.advance(drawn, version, self.pause)
            for _ in range(n):
                if self.pause.is_set():
                    break
                self.queue.append(self.draw(version, self.pause))
        except BaseException as e:  # noqa: BLE001 - handed to the main thread by join()
            self.failure = e

    def join(self) -> None:
        """Collective after an async draw (no-op when none ran): waits for it; when it raised on any
        rank, every rank raises (this one with the thread's traceback), so the step stops
        instead of quietly sampling on-policy next time and no rank is left waiting."""
        if self.thread is None:  # no async draw ran (the same on every rank)
            return
        if self.cfg.rollout.partial_rollouts:  # the weights change next: pause the draw
            self.pause.set()
        self.thread.join()
        self.thread = None
        e, self.failure = self.failure, None
        if any_rank(e is not None, self.groups.world):
            if e is not None:
                raise RuntimeError("the async rollout thread failed while drawing the next "
                                   f"batch ({type(e).__name__}: {e})") from e
            raise RuntimeError("the async rollout thread failed on another rank while drawing "
                               "the next batch (that rank's error says why)")

    # ------------------------------------------------------------------ run state
    def state_dict(self) -> dict:
        """The batches drawn ahead for the next steps (this rank's samples of them), which the
        loader is already past; call after `join`. Per rank: it holds this rank's samples."""
        if self.thread is not None:
            raise RuntimeError("RolloutCollector.state_dict while the async draw runs: join first")
        keep = self.runner.saved if self.runner is not None else None
        return {"queue": [d.state_dict(keep) for d in self.queue]}

    def load_state_dict(self, state: dict) -> None:
        """The saved batches drawn ahead, the oldest k = cfg.staleness of them (the trainer's
        state returns the prompts of the rest: `return_batches`). Reads the single `pending`
        batch of checkpoints written before the queue."""
        saved = state.get("queue")
        if saved is None:
            saved = [state["pending"]] if state.get("pending") is not None else []
        self.queue = [Drawn.from_state(d) for d in saved[:self.cfg.staleness]]
        if self.runner is not None and self.cfg.rollout.partial_rollouts:
            self._resume_paused()

    def _resume_paused(self) -> None:
        """Multi-turn partial rollouts after a resume: each saved paused trajectory goes on
        where it was paused where its environment saved its state (`Environment.state_dict`),
        else starts again from its prompt; those of the second kind that had sampled tokens
        are counted (`partial_restarted`) and said on the console, as are the first."""
        lost = whole = 0
        for d in self.queue:
            n = sum(isinstance(u, Completion) and u.finish_reason == "restart"
                    for u in d.unfinished)
            whole += sum(isinstance(u, dict) for u in d.unfinished)
            d.unfinished = [self.runner.resumed(d.prompts, d.records, u) if isinstance(u, dict)
                            else self.runner.restarted(d.prompts, u.prompt_index,
                                                       u.sample_index)
                            for u in d.unfinished]
            d.metrics["partial_restarted"] = d.metrics.get("partial_restarted", 0.0) + n
            lost += n
        if whole:
            log.info("resumed with %d multi-turn trajector%s paused at a weight update, "
                     "continued where paused (the environment's state restored)", whole,
                     "y" if whole == 1 else "ies")
        if lost:
            log.warning("resumed with %d multi-turn trajector%s paused at a weight update, to "
                        "start again from the prompt (agent.environment=%s saves no state: its "
                        "Environment.state_dict gives None; counted as partial_restarted)",
                        lost, "y" if lost == 1 else "ies", self.cfg.agent.environment)

    def ahead_loader_states(self) -> list[dict]:
        """The loader position before each batch drawn ahead and not trained yet, oldest first
        (the same on every rank)."""
        return [d.loader_state for d in self.queue] + [r.loader_state for r in self.returned]

    def return_batches(self, loader_states: list[dict]) -> None:
        """Puts the prompts of batches drawn ahead that were not restored back into the stream
        (read from the loader at their saved positions), to be drawn before the loader's next;
        the loader keeps its position."""
        here = self.loader.state_dict()
        for st in loader_states:
            self.loader.load_state_dict(st)
            examples = next(self.loader)
            self.returned.append(Returned(examples, self.loader.epoch, st))
        self.loader.load_state_dict(here)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, examples: list[Example]) -> float:
        """Greedy accuracy on held-out examples, split over the vLLM engines: the share whose
        reward source calls correct (the rules source: its correctness term scores >= 1,
        whatever the other terms add).
        With the agent on: greedy multi-turn trajectories, turns ending at rollout.stop too."""
        lay = self.layout  # each engine evaluates its slice; its TP rank 0 counts it
        mine = list(range(lay.engine, len(examples), lay.num_engines))
        counted = float(len(mine)) if lay.is_leader else 0.0
        v = torch.tensor([float(self.count_correct(examples, mine)), counted],
                         dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(v, group=self.groups.world)
        return float(v[0] / max(v[1], 1.0))


    def count_correct(self, examples: list[Example], mine: list[int]) -> int:
        """Greedy completions of examples[i] for i in `mine` on this rank's engine (held-out
        settings: eval.max_tokens, temperature 0); how many the reward source calls correct.
        A rollout rank of separate placement evaluates its share with it."""
        s = SamplingSettings(temperature=0.0, max_tokens=self.cfg.eval.max_tokens, n=1,
                             stop=tuple(self.cfg.rollout.stop) if self.runner else (),
                             stop_token_ids=self.stop_ids)
        prompts = [encode_prompt(self.tokenizer, e.prompt) for e in examples]
        records = [e.record for e in examples]
        images = None
        if self.vision is not None:
            pil, rows, _ = self.vision.prepare([prompts[i] for i in mine],
                                               [records[i] for i in mine])
            images = ([None] * len(prompts), [None] * len(prompts))
            for i, p, r in zip(mine, pil, rows):
                images[0][i], images[1][i] = p, r
        comps, _, _ = self._generate(prompts, [e.answer for e in examples], mine, s,
                                     records, [e.prompt for e in examples], images=images)
        return sum(bool(c.correct) for c in comps)


# ---------------------------------------------------------------------- helpers
def record_scores(comps: list[Completion], pending: PendingScores) -> tuple[torch.Tensor, dict]:
    """Awaits a batch's scores and marks each completion's verdict (`correct`) and joined
    environment reward: (rewards [n] float32, reward metrics)."""
    scores = pending.result()
    env = scores.per_term.get("environment")
    for i, (c, ok) in enumerate(zip(comps, scores.correctness().tolist(), strict=True)):
        c.correct = bool(ok)
        if env is not None:
            c.env_reward = float(env[i])
    rewards, metrics = scores.rewards, dict(scores.metrics)
    if comps:  # the same key on every rank that scored (averaged by key)
        metrics["reward_failed"] = 0.0
    if scores.valid is not None:
        rewards = impute_failed(comps, rewards, scores.valid.bool())
        metrics["reward_failed"] = float((~scores.valid.bool()).sum())
    return rewards, metrics


def impute_failed(comps: list[Completion], rewards: torch.Tensor, valid: torch.Tensor
                  ) -> torch.Tensor:
    """Samples a source could not score (`valid` False) are dropped (`Completion.dropped =
    'reward_error'`: out of the loss and of their group's advantage statistics) and given their
    group's mean reward over the scored ones (0 when none was scored), so that under dynamic
    sampling they do not change the group's spread either."""
    out = rewards.clone().to(torch.float32)
    by_prompt: dict[int, list[int]] = {}
    for i, c in enumerate(comps):
        by_prompt.setdefault(c.prompt_index, []).append(i)
    for idx in by_prompt.values():
        ok = [i for i in idx if bool(valid[i])]
        fill = float(out[ok].mean()) if ok else 0.0
        for i in idx:
            if not bool(valid[i]):
                comps[i].dropped = "reward_error"
                out[i] = fill
    return out


def _slices(items: list[int], k: int) -> list[list[int]]:
    """`items` in k consecutive slices of near-equal size, the empty ones left out."""
    n = len(items)
    return [part for i in range(k) if (part := items[i * n // k:(i + 1) * n // k])]


def _sum_dicts(dicts: list[dict]) -> dict:
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            if isinstance(v, (int, float)):
                out[k] = out.get(k, 0) + v
    return out


def dynamic_sampling(ro: Rollout, top_up: Callable[[], Rollout], cfg: AlgoConfig, group
                     ) -> Rollout:
    """DAPO's dynamic sampling of the batch `ro`: its groups with reward spread, topped up by
    `top_up()` (the next prompts' rollout) until it holds as many as `ro` had, at most
    cfg.max_resample_rounds times. Collective over `group` (every rank draws the same number of
    top-ups, so the data loaders stay in lockstep)."""
    want, G = len(ro.prompts), cfg.group_size
    keep, _ = algo.filter_groups(ro.rewards, G)
    kept = select_groups(ro, keep, G)
    rounds = 0
    while any_rank(len(kept.prompts) < want, group) and rounds < cfg.max_resample_rounds:
        more = top_up()
        keep, _ = algo.filter_groups(more.rewards, G)
        kept = _concat(kept, select_groups(more, keep, G))
        kept.epoch = more.epoch
        rounds += 1
    metrics = dict(ro.metrics, resample_rounds=rounds,
                   filtered_groups=want - min(len(kept.prompts), want))
    if not kept.prompts:  # nothing with signal: train on the batch (zero advantages)
        kept = ro
    kept.metrics = metrics  # same keys on every rank (they are averaged over DP)
    return _truncate(kept, want, G)


def select_groups(ro: Rollout, keep: torch.Tensor, G: int) -> Rollout:
    """The rollout's prompt groups where `keep` [B] bool is set, renumbered."""
    idx = [i for i in range(len(ro.prompts)) if bool(keep[i])]
    remap = {old: new for new, old in enumerate(idx)}
    comps = [c for c in ro.completions if c.prompt_index in remap]
    for c in comps:
        c.prompt_index = remap[c.prompt_index]
    rewards = ro.rewards.view(-1, G)[keep].reshape(-1) if idx else ro.rewards[:0]
    return Rollout(prompts=[ro.prompts[i] for i in idx], answers=[ro.answers[i] for i in idx],
                   completions=comps, rewards=rewards, version=ro.version, epoch=ro.epoch,
                   metrics=ro.metrics,
                   images=None if ro.images is None else [ro.images[i] for i in idx])


def _concat(a: Rollout, b: Rollout) -> Rollout:
    off = len(a.prompts)
    moved = [dataclasses.replace(c, prompt_index=c.prompt_index + off) for c in b.completions]
    return Rollout(prompts=a.prompts + b.prompts, answers=a.answers + b.answers,
                   completions=list(a.completions) + moved,
                   rewards=torch.cat([a.rewards, b.rewards]), version=a.version, epoch=a.epoch,
                   metrics=a.metrics,
                   images=None if a.images is None else a.images + b.images)


def _truncate(ro: Rollout, want: int, G: int) -> Rollout:
    if len(ro.prompts) <= want:
        return ro
    return Rollout(prompts=ro.prompts[:want], answers=ro.answers[:want],
                   completions=[c for c in ro.completions if c.prompt_index < want],
                   rewards=ro.rewards[: want * G], version=ro.version, epoch=ro.epoch,
                   metrics=ro.metrics,
                   images=None if ro.images is None else ro.images[:want])
