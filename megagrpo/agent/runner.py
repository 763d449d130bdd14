"""Multi-turn rollouts, token in / token out: each sample is a trajectory of assistant turns
and environment observations, kept as one token sequence.

Turn 1 samples G completions per prompt (one `generate` call, n=G). Every later turn continues
each live trajectory from its whole token prefix (prompt + every id so far; n=1, the engine's
prefix cache makes the repeated prefix cheap), all live trajectories of the turn in ONE
`generate` call. Between turns each trajectory's environment answers the turn; its observation
ids (`Observation.token_ids`, or the text encoded once without special tokens) are appended.
Nothing the model sampled is ever decoded and re-encoded: decoding is for the environment's
parsing and the reward terms only.

Budgets: a trajectory holds at most B tokens after its prompt, B = agent.max_total_tokens, or
rollout.max_model_len minus the prompt when that is 0. Each turn samples at most
min(rollout.max_tokens, what is left of B) tokens: the turn's call asks for the largest such
limit among the live trajectories and each trajectory keeps the first ids up to its own (a
prefix of a sample is a sample with the shorter limit). Ends (`Completion.truncation`):
  ''            the environment said done;
  'turn_length' a turn hit rollout.max_tokens (finish 'length'). It is not continued and the
                environment does not see it: a cut-off turn usually holds half a tool call;
  'max_turns'   agent.max_turns turns and the environment not done (its last observation is
                not appended: nothing would read it);
  'token_budget' a turn was cut at B, or an observation would leave no room for a model token
                (the observation is not appended);
  'env_error'   the environment failed: raised, took longer than agent.env_timeout_s or answered
                with garbage, on every one of its 1 + agent.env_retries tries (reported once per
                runner; never the rank's end). With agent.on_env_error=drop (the default) the
                trajectory is dropped (`Completion.dropped`): it leaves its group's advantages
                and the loss instead of training on what it had when it stopped.
The first three set finish_reason 'length' (algo.mask_truncated and overlong shaping read it);
the others 'stop'. An error while closing an environment is logged; the trajectory keeps what
it finished with.

With rollout.tensor_parallel_size > 1 every rank of an engine runs its own environments from
the same records and must get the same observations (the next call's prompts must agree across
the engine's ranks): environments must be deterministic given the record and the turns.
"""
from __future__ import annotations

import logging
import math
import numbers
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch

from megagrpo.agent.env import Environment, Observation, Turn
from megagrpo.agent.registry import import_environment, load_environment
from megagrpo.config.agent import OPENENV, AgentConfig
from megagrpo.engine.types import NO_VERSION, Completion, SamplingSettings

log = logging.getLogger("megagrpo")

EnvFactory = Callable[[dict], Environment]
"""A prompt's data record -> a fresh environment for one trajectory."""


def environment_class(name: str) -> type[Environment]:
    """The `module:Class` named by agent.environment, checked to be an Environment subclass;
    ValueError naming the field otherwise."""
    if name == "tools" or name.startswith(OPENENV):
        raise ValueError(f"agent.environment={name} is resolved by "
                         "megagrpo.agent.registry.load_environment, not a class of its own (it "
                         "needs the tokenizer's chat template)")
    return import_environment(name)


def environment_factory(agent: AgentConfig, tokenizer: object) -> EnvFactory:
    """record -> agent.environment's environment ('tools' or `module:Class`, built with
    (record, tokenizer, **agent.kwargs)): `megagrpo.agent.registry.load_environment`, the one
    resolver."""
    return load_environment(agent, tokenizer)


@dataclass
class _Trajectory:
    """One trajectory while it runs."""

    prompt_index: int
    sample_index: int
    prompt: list[int]
    budget: int
    """Most tokens after the prompt."""
    env: Environment | None = None
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    turns: int = 0
    text: str = ""
    """The last turn's text."""
    turn_ids: tuple[int, ...] = ()
    """The last turn's ids."""
    finish: str = "stop"
    truncation: str = ""
    rewards: list[float] = field(default_factory=list)
    calls: int = 0
    errors: int = 0
    seconds: float = 0.0
    retries: int = 0
    """Environment calls asked again after a failure."""
    dropped: str = ""
    done: bool = False
    versions: list[int] | None = None
    """rollout.partial_rollouts: per id, the policy version that sampled it (NO_VERSION on
    the environment's); None: not recorded (one version sampled the whole trajectory)."""
    turn: Completion | None = None
    """rollout.partial_rollouts: the turn paused between two decode steps (its ids, log-probs
    and versions so far), continued by the next `advance`; None between turns."""
    started: bool = False
    """Its environment was created (or the trajectory ended before it needed one)."""

    def limit(self, max_tokens: int) -> int:
        """This turn's token limit."""
        return min(max_tokens, self.budget - len(self.ids))

    def oldest(self, version: int) -> int:
        """The version of its oldest model token (`version` when it has none yet)."""
        if self.versions:
            return self.versions[0]  # a trajectory starts with the model's first turn
        if self.turn is not None and self.turn.token_versions:
            return self.turn.token_versions[0]
        return version

    def restart_state(self) -> Completion:
        """What a checkpoint keeps of it where its environment's state is not saved: its
        prompt and place only, so a resumed run samples it again from the prompt;
        finish_reason 'restart' marks one that had sampled tokens (counted and said on the
        console at the resume)."""
        lost = bool(self.ids) or bool(self.turn is not None and self.turn.token_ids)
        return Completion(prompt_index=self.prompt_index, sample_index=self.sample_index,
                          token_ids=[], logprobs=[], finish_reason="restart" if lost else "",
                          token_versions=[])

    def whole_state(self, environment: dict) -> dict:
        """What a checkpoint keeps of it where its environment saved `environment`: all of
        it, its turn in progress included (`TrajectoryRunner.resumed` continues it)."""
        keep = {k: list(v) if isinstance(v := getattr(self, k), list) else v for k in _KEPT}
        keep["turn_ids"] = list(self.turn_ids)
        keep["turn"] = None if self.turn is None else asdict(self.turn)
        return {"trajectory": keep, "environment": environment}


_KEPT = ("prompt_index", "sample_index", "ids", "logprobs", "mask", "turns", "text", "finish",
         "rewards", "calls", "errors", "seconds", "retries", "versions")
"""The `_Trajectory` fields a whole saved trajectory holds as they are."""


@dataclass
class PausedTurns:
    """What one `TrajectoryRunner.advance` leaves (rollout.partial_rollouts)."""

    finished: list[Completion]
    paused: list[_Trajectory]
    tokens: int
    """Tokens the model sampled in this call."""
    recomputed: int
    """Tokens of paused turns whose keys and values were computed again."""


@dataclass
class TrajectoryRunner:
    """Runs multi-turn trajectories on one rollout engine (see the module docstring)."""

    engine: object
    """The `RolloutEngine` (its `generate` only)."""
    tokenizer: object
    """Decodes turns for the environment and the reward terms; encodes text observations."""
    factory: EnvFactory
    agent: AgentConfig
    max_model_len: int
    reported: bool = False
    """An environment error was reported (the first one only is)."""
    reported_state: bool = False
    """A state_dict failure was reported (the first one only is)."""

    def run(self, prompts: list[list[int]], records: list[dict],
            sampling: SamplingSettings) -> list[Completion]:
        """G = sampling.n trajectories per prompt, prompt-major (`Completion.prompt_index`
        indexes `prompts`)."""
        G = sampling.n
        live = [_Trajectory(i, j, list(p), self._budget(p)) for i, p in enumerate(prompts)
                for j in range(G)]
        for t in live:
            if t.budget < 1:  # preflight keeps prompts shorter than rollout.max_model_len
                t.done, t.finish, t.truncation = True, "length", "token_budget"
            else:
                t.env = self._make_env(t, records[t.prompt_index])
        active = [t for t in live if not t.done]
        while active:
            first = active[0].turns == 0 and len(active) == len(live)
            self._turn(active, prompts, sampling, first)
            active = [t for t in active if not t.done]
        return [self._completion(t) for t in live]

    def _budget(self, prompt: list[int]) -> int:
        room = self.max_model_len - len(prompt)
        return min(self.agent.max_total_tokens, room) if self.agent.max_total_tokens else room

    def _make_env(self, t: _Trajectory, record: dict) -> Environment | None:
        return self._call(t, "creating", lambda: self.factory(record))

    def _call(self, t: _Trajectory, doing: str, fn: Callable, check: Callable | None = None):
        """fn() (an environment call) under agent.env_timeout_s, its answer through `check`;
        asked again after a failure up to agent.env_retries times (not after a timeout: its
        thread may still be running on the environment). None when every try failed: the
        trajectory failed (`_env_error`)."""
        error: BaseException | None = None
        for attempt in range(self.agent.env_retries + 1):
            if attempt:
                t.retries += 1
            try:
                out = _with_deadline(fn, self.agent.env_timeout_s)
                if check is not None:
                    check(out)
                return out
            except EnvTimeout as e:
                error = e
                break
            except Exception as e:  # noqa: BLE001 - one trajectory fails, not the rank
                error = e
        self._env_error(t, error, doing)
        return None

    def _turn(self, active: list[_Trajectory], prompts: list[list[int]],
              sampling: SamplingSettings, first: bool) -> None:
        """One assistant turn of every active trajectory (one generate call), then the
        environments' answers."""
        limit = max(t.limit(sampling.max_tokens) for t in active)
        s = replace(sampling, max_tokens=limit, n=sampling.n if first else 1)
        if first:  # n = G samples per prompt, prompt-major like `active`
            outs = self.engine.generate(prompts, s)
        else:
            outs = self.engine.generate([t.prompt + t.ids for t in active], s)
        for t, out in zip(active, outs, strict=True):
            self._end_turn(t, out, sampling.max_tokens)

    def _end_turn(self, t: _Trajectory, out: Completion, max_tokens: int) -> None:
        """The turn `out` taken, the environment's answer to it (or its close at the end)."""
        self._take(t, out, max_tokens)
        if not t.done:
            self._observe(t)
        if t.done and t.env is not None:
            self._close(t)

    # ------------------------------------------------------------ partial rollouts
    def start(self, prompts: list[list[int]], prompt_indices: list[int], n: int
              ) -> list[_Trajectory]:
        """rollout.partial_rollouts: `n` trajectories per prompt index (indexing `prompts`),
        prompt-major, not started (`advance` creates their environments)."""
        return [self.restarted(prompts, p, j) for p in prompt_indices for j in range(n)]

    def restarted(self, prompts: list[list[int]], p: int, j: int) -> _Trajectory:
        """Sample `j` of prompt `p` from its prompt, as `start` makes it."""
        return _Trajectory(p, j, list(prompts[p]), self._budget(prompts[p]), versions=[])

    def saved(self, t: _Trajectory) -> dict:
        """What a checkpoint keeps of paused trajectory `t`: with an environment that saves
        its state (`Environment.state_dict`), the whole trajectory and that state
        (`_Trajectory.whole_state`, continued by `resumed`); otherwise its prompt and place (a
        `Completion`'s fields: `_Trajectory.restart_state`). An environment whose state_dict
        raises, runs past agent.env_timeout_s or gives what a checkpoint cannot hold is
        reported (once) and its trajectory saved the second way."""
        state = None
        if t.env is not None:
            try:
                state = _with_deadline(t.env.state_dict, self.agent.env_timeout_s)
                bad = None if state is None else _unsaveable(state, "state_dict()")
                if bad:
                    raise TypeError(bad)
            except Exception as e:  # noqa: BLE001 - the trajectory restarts, the save goes on
                state = None
                if not self.reported_state:
                    self.reported_state = True
                    log.warning("agent.environment=%s: state_dict failed while a checkpoint "
                                "saved a paused trajectory (%s: %s); such trajectories are "
                                "saved as their prompt and start again from it after a resume "
                                "(counted as partial_restarted)", self.agent.environment,
                                type(e).__name__, e)
        if state is None:
            return asdict(t.restart_state())
        return t.whole_state(state)

    def resumed(self, prompts: list[list[int]], records: list[dict], saved: dict
                ) -> _Trajectory:
        """A trajectory `saved` whole (`saved`), to be continued where it was paused: its
        environment built afresh from the record and given back its state. Either failing
        ends the trajectory as an environment error (agent.on_env_error), like a failure at
        the start of a trajectory."""
        keep = saved["trajectory"]
        p = keep["prompt_index"]
        t = _Trajectory(p, keep["sample_index"], list(prompts[p]), self._budget(prompts[p]),
                        started=True)
        for k in _KEPT:
            setattr(t, k, list(keep[k]) if isinstance(keep[k], (list, tuple)) else keep[k])
        t.turn_ids = tuple(keep["turn_ids"])
        t.turn = None if keep["turn"] is None else Completion(**keep["turn"])
        env = self._make_env(t, records[p])
        if env is None:
            return t
        t.env = env
        if self._call(t, "restoring", lambda: env.load_state_dict(saved["environment"]) or True
                      ) is None:
            t.turn = None
            self._close(t)
        return t

    def advance(self, trajs: list[_Trajectory], records: list[dict],
                sampling: SamplingSettings, *, version: int, pause=None,
                max_updates: int = 0) -> PausedTurns:
        """rollout.partial_rollouts: runs `trajs` (from `start`, or paused by an earlier call)
        with the weights of policy `version` (the engine's `generate_partial`) until each
        ends or `pause` is set. At the pause a trajectory whose oldest model token is fewer
        than `max_updates` versions behind `version` stops: in the middle of a turn between
        two decode steps (the turn's ids, log-probs and versions kept in `turn`), or between
        turns (its next turn waits); its environment stays with it, nothing is asked of it
        again. The others (at the cap) run to their end with these weights first. Each turn
        samples n = 1 per trajectory at its own limit."""
        for t in trajs:
            if not t.started:
                self._begin(t, records[t.prompt_index])
        active = [t for t in trajs if not t.done]
        held: list[_Trajectory] = []
        tokens = recomputed = 0
        while active:
            if pause is not None and pause.is_set():
                wait = [t for t in active if t.turn is None
                        and version - t.oldest(version) < max_updates]
                held += wait
                waiting = {id(t) for t in wait}
                active = [t for t in active if id(t) not in waiting]
                if not active:
                    break
            turns = [t.turn or _new_turn(t) for t in active]
            owner = {id(c): t for c, t in zip(turns, active)}
            for j, c in enumerate(turns):
                c.prompt_index = j  # indexes this call's prompts
            res = self.engine.generate_partial(
                [t.prompt + t.ids for t in active], turns, replace(sampling, n=1),
                version=version, pause=pause, max_updates=max_updates,
                limits=[t.limit(sampling.max_tokens) for t in active],
                oldest=lambda c, v: owner[id(c)].oldest(v))
            tokens, recomputed = tokens + res.tokens, recomputed + res.recomputed
            for c in res.paused:
                owner[id(c)].turn = c
            held += [owner[id(c)] for c in res.paused]
            for c in res.finished:
                t = owner[id(c)]
                t.turn = None
                self._end_turn(t, c, sampling.max_tokens)
            active = [t for t in active if not t.done and t.turn is None]
        gone = {id(t) for t in held}
        return PausedTurns([self._completion(t) for t in trajs if id(t) not in gone],
                           held, tokens, recomputed)

    def _begin(self, t: _Trajectory, record: dict) -> None:
        t.started = True
        if t.budget < 1:  # preflight keeps prompts shorter than rollout.max_model_len
            t.done, t.finish, t.truncation = True, "length", "token_budget"
        else:
            t.env = self._make_env(t, record)

    def _take(self, t: _Trajectory, out: Completion, max_tokens: int) -> None:
        """Appends the turn's sampled ids (cut to this trajectory's own limit)."""
        own = t.limit(max_tokens)
        ids, lps, finish = list(out.token_ids), list(out.logprobs), out.finish_reason
        if len(ids) > own:
            ids, lps, finish = ids[:own], lps[:own], "length"
        # the text of exactly these ids, for parsing and the reward terms only (never
        # re-encoded); not vLLM's text, which drops a matched stop string such as </tool_call>
        text = self.tokenizer.decode(ids) if ids else ""
        t.ids += ids
        t.logprobs += lps
        t.mask += [True] * len(ids)
        if t.versions is not None:
            t.versions += list(out.token_versions or ())[:len(ids)]
        t.turns += 1
        t.text, t.finish = text, finish
        t.turn_ids = tuple(ids)
        if finish == "length":
            t.done = True
            t.truncation = "token_budget" if len(t.ids) >= t.budget else "turn_length"

    def _observe(self, t: _Trajectory) -> None:
        """The environment's answer to the trajectory's last turn."""
        if t.env is None:
            t.done = True
            return
        turn = Turn(index=t.turns - 1, text=t.text, token_ids=t.turn_ids,
                    finish_reason=t.finish)
        obs = self._call(t, "stepping", lambda: t.env.step(turn), check_observation)
        if obs is None:
            return
        t.rewards.append(float(obs.reward))
        t.calls += obs.tool_calls
        t.errors += obs.tool_errors
        t.seconds += obs.tool_seconds
        if obs.done:
            t.done = True
        elif t.turns >= self.agent.max_turns:
            t.done, t.finish, t.truncation = True, "length", "max_turns"
        else:
            self._append(t, obs)

    def _append(self, t: _Trajectory, obs: Observation) -> None:
        ids = (list(obs.token_ids) if obs.token_ids is not None
               else self.tokenizer.encode(obs.text) if obs.text
               else [])
        if len(t.ids) + len(ids) >= t.budget:  # no room left for a model token after it
            t.done, t.finish, t.truncation = True, "length", "token_budget"
            return
        t.ids += ids
        t.logprobs += [0.0] * len(ids)
        t.mask += [False] * len(ids)
        if t.versions is not None:
            t.versions += [NO_VERSION] * len(ids)

    def _env_error(self, t: _Trajectory, e: BaseException, doing: str) -> None:
        t.done, t.finish, t.truncation = True, "stop", "env_error"
        drop = self.agent.on_env_error == "drop"
        t.dropped = "env_error" if drop else ""
        if not self.reported:
            self.reported = True
            tries = t.retries + 1
            log.warning("agent.environment=%s failed while %s a trajectory after %d tr%s "
                        "(%s: %s); that trajectory %s (truncation 'env_error', counted in the "
                        "step's metrics); later failures are counted only",
                        self.agent.environment, doing, tries, "y" if tries == 1 else "ies",
                        type(e).__name__, e,
                        "is dropped from training (agent.on_env_error=drop)" if drop
                        else "trains with what it had (agent.on_env_error=keep)")

    def _close(self, t: _Trajectory) -> None:
        env, t.env = t.env, None
        try:
            env.close()
        except Exception as e:  # noqa: BLE001 - the trajectory finished; only the close failed
            log.warning("agent.environment=%s raised while closing (%s: %s); the trajectory "
                        "keeps what it finished with", self.agent.environment,
                        type(e).__name__, e)

    def _completion(self, t: _Trajectory) -> Completion:
        return Completion(prompt_index=t.prompt_index, sample_index=t.sample_index,
                          token_ids=t.ids, logprobs=t.logprobs, finish_reason=t.finish,
                          text=t.text, loss_mask=t.mask, turns=t.turns, tool_calls=t.calls,
                          tool_errors=t.errors, tool_seconds=t.seconds,
                          turn_rewards=list(t.rewards), truncation=t.truncation,
                          env_retries=t.retries, dropped=t.dropped,
                          token_versions=t.versions)


def _new_turn(t: _Trajectory) -> Completion:
    """The next turn of `t`, no token sampled yet (continued by `run_partial`)."""
    return Completion(prompt_index=0, sample_index=t.sample_index, token_ids=[], logprobs=[],
                      finish_reason="", token_versions=[])


class EnvTimeout(TimeoutError):
    """An environment call ran past agent.env_timeout_s."""


def _with_deadline(fn: Callable, seconds: float):
    """fn() on this thread (seconds <= 0), else on a daemon thread joined for `seconds`; past
    them EnvTimeout (the thread is left to finish: Python cannot stop it)."""
    if seconds <= 0:
        return fn()
    box: dict = {}

    def run() -> None:
        try:
            box["out"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = e

    worker = threading.Thread(target=run, name="megagrpo-env-call", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise EnvTimeout(f"no answer within agent.env_timeout_s={seconds:g} s")
    if "error" in box:
        raise box["error"]
    return box["out"]


def _unsaveable(obj, where: str) -> str | None:
    """None where a checkpoint holds `obj` (`megagrpo.checkpoint.save_tree`: tensors, dicts,
    lists, tuples, numbers, strings, None), else what is not."""
    if obj is None or isinstance(obj, (bool, int, float, str, torch.Tensor)):
        return None
    if isinstance(obj, dict):
        return next((b for k, v in obj.items()
                     for b in (_unsaveable(k, f"{where} key"), _unsaveable(v, f"{where}[{k!r}]"))
                     if b), None)
    if isinstance(obj, (list, tuple)):
        return next((b for i, v in enumerate(obj) if (b := _unsaveable(v, f"{where}[{i}]"))),
                    None)
    return (f"{where} is a {type(obj).__name__}; a checkpoint holds tensors, dicts, lists, "
            "tuples, numbers, strings and None")


def check_observation(obs) -> None:
    """An environment's answer is an Observation with a finite reward and, when it gives ids,
    non-negative integers; ValueError / TypeError naming what is wrong otherwise."""
    if not isinstance(obs, Observation):
        raise TypeError(f"step returned {type(obs).__name__}, not an Observation")
    if not isinstance(obs.reward, numbers.Real) or not math.isfinite(obs.reward):
        raise ValueError(f"step's reward {obs.reward!r} is not a finite number")
    if obs.token_ids is not None and not all(isinstance(i, numbers.Integral) and i >= 0
                                             for i in obs.token_ids):
        raise ValueError(f"step's token_ids {list(obs.token_ids)[:4]}... are not all "
                         "non-negative integers")


def spans(c: Completion) -> tuple[int, int]:
    """Where a multi-turn trajectory (with `token_versions` and `loss_mask`) met weight
    updates: (its turns sampled by more than one policy version: paused between two decode
    steps and continued; its turn boundaries where the next turn's first token is of a newer
    version than the last turn's last one: paused between turns). (0, 0) without them."""
    if c.token_versions is None or c.loss_mask is None:
        return 0, 0
    runs: list[list[int]] = []
    prev = False
    for v, model in zip(c.token_versions, c.loss_mask, strict=True):
        if model and not prev:
            runs.append([])
        if model:
            runs[-1].append(v)
        prev = model
    mid = sum(r[0] != r[-1] for r in runs)
    between = sum(a[-1] != b[0] for a, b in zip(runs, runs[1:]))
    return mid, between


def agent_metrics(comps: list[Completion]) -> dict[str, float]:
    """Per-trajectory means of a batch of trajectories: turns, tool calls / errors, tool
    seconds, the environment tokens' share of all tokens after the prompts, truncations by
    cause (a share each)."""
    n = max(len(comps), 1)
    env = sum(len(c.loss_mask) - sum(c.loss_mask) for c in comps if c.loss_mask is not None)
    total = sum(len(c.token_ids) for c in comps)
    out = {"turns": sum(c.turns for c in comps) / n,
           "tool_calls": sum(c.tool_calls for c in comps) / n,
           "tool_errors": sum(c.tool_errors for c in comps) / n,
           "tool_seconds": sum(c.tool_seconds for c in comps) / n,
           "env_reward": sum(c.env_reward for c in comps) / n,
           "env_token_share": env / max(total, 1),
           "env_retries": sum(c.env_retries for c in comps) / n}
    for cause in TRUNCATIONS:
        out[f"truncated/{cause}"] = sum(c.truncation == cause for c in comps) / n
    return out


TRUNCATIONS = ("turn_length", "max_turns", "token_budget", "env_error")
"""`Completion.truncation` causes (besides '')."""
