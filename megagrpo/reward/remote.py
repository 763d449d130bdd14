"""The `remote` reward source: an HTTP endpoint scores batches of samples (a verifier service, a
sandboxed code runner, a judge behind an API).

Protocol: `POST reward.options.url` with `{"samples": [{prompt, completion, answer, record,
finish_reason, turn_rewards[, prompt_ids, completion_ids]}, ...]}` (JSON; at most `batch_size`
samples a request) answered by `{"rewards": [float, ...]}` in the same order, optionally
`"correct": [bool, ...]` (else a reward >= 1 counts as correct). Requests run on a pool of
`concurrency` threads (the most requests in flight at once, over all batches of this process),
so `score` returns a future at once and the collector awaits it when it gathers the batch.

A request that times out (`timeout_s`, per connect and per read), fails to connect, or is
answered 5xx / 408 / 429 is retried up to `max_retries` times, `backoff_s` x 2^k apart; other
4xx and malformed answers (not JSON, wrong length, a non-finite reward) are not retried. When a
request's attempts are spent, `on_failure` says what happens to its samples: 'drop' (left out of
the loss, counted in `reward_failed` and `remote_failed`, one console warning per request) or
'error' (the step stops with the reason).
"""
from __future__ import annotations

import http.client
import json
import logging
import math
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from megagrpo.config.data import RewardConfig
from megagrpo.reward.options import parse_options
from megagrpo.reward.sample import Sample
from megagrpo.reward.source import Scores, all_of, register_source

log = logging.getLogger("megagrpo")

ON_FAILURE = ("drop", "error")
RETRY_STATUS = (408, 429)
"""4xx answers that are retried (request timeout, too many requests); every 5xx is too."""


@dataclass(kw_only=True)
class RemoteOptions:
    """`reward.options` of the `remote` source."""

    url: str
    """The endpoint (http:// or https://) that answers POSTed batches."""
    batch_size: int = 32
    """Samples per request."""
    timeout_s: float = 30.0
    """Deadline of each connect and each read of a request."""
    max_retries: int = 2
    """Attempts after the first for a request that timed out, failed to connect or got a
    5xx / 408 / 429."""
    backoff_s: float = 0.5
    """Wait before retry k (k = 1, 2, ...): backoff_s x 2^(k-1)."""
    concurrency: int = 4
    """Requests in flight at once (this process)."""
    on_failure: str = "drop"
    """After the last attempt: 'drop' (the samples leave the loss, counted) or 'error'."""
    headers: dict = field(default_factory=dict)
    """Extra HTTP headers (e.g. {Authorization: 'Bearer ...'})."""
    send_ids: bool = False
    """Also send prompt_ids and completion_ids."""

    def check(self, where: str) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"{where}.url={self.url!r}: use an http:// or https:// address")
        for name, low in (("batch_size", 1), ("concurrency", 1), ("max_retries", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"{where}.{name}={getattr(self, name)}: need >= {low}")
        if self.timeout_s <= 0:
            raise ValueError(f"{where}.timeout_s={self.timeout_s}: need > 0")
        if self.backoff_s < 0:
            raise ValueError(f"{where}.backoff_s={self.backoff_s}: need >= 0")
        if self.on_failure not in ON_FAILURE:
            raise ValueError(f"{where}.on_failure={self.on_failure!r}: use one of {ON_FAILURE}")


class Unscored(Exception):
    """A request's attempts are spent (the message says why)."""


@register_source("remote")
class RemoteSource:
    """Scores batches on an HTTP endpoint (module docstring: protocol, retries, failures)."""

    @staticmethod
    def check(cfg: RewardConfig) -> None:
        parse_options(RemoteOptions, cfg.options)

    def __init__(self, cfg: RewardConfig) -> None:
        self.opts = parse_options(RemoteOptions, cfg.options)
        self.pool = ThreadPoolExecutor(self.opts.concurrency,
                                       thread_name_prefix="megagrpo-remote-reward")

    def score(self, samples: list[Sample]) -> Future[Scores] | Scores:
        """Sends the samples in requests of batch_size; a future of their joined scores."""
        bs = self.opts.batch_size
        chunks = [samples[i:i + bs] for i in range(0, len(samples), bs)]
        if not chunks:
            return _join([])
        return all_of([self.pool.submit(self._request, c) for c in chunks], _join)

    def _request(self, chunk: list[Sample]) -> Scores:
        """One request with its retries: the chunk's Scores (all invalid when unscored)."""
        o, start = self.opts, time.perf_counter()
        body = json.dumps({"samples": [self._payload(s) for s in chunk]}).encode()
        attempts, reason = 0, ""
        rewards: list[float] | None = None
        correct: list[bool] | None = None
        for attempt in range(o.max_retries + 1):
            if attempt:
                time.sleep(o.backoff_s * 2 ** (attempt - 1))
            attempts += 1
            try:
                rewards, correct = self._post(body, len(chunk))
                break
            except _Retry as e:
                reason = str(e)
            except Unscored as e:
                reason = str(e)
                break
        if rewards is None:
            msg = (f"reward.options.url={o.url}: {len(chunk)} samples unscored after "
                   f"{attempts} attempt(s) ({reason})")
            if o.on_failure == "error":
                raise RuntimeError(f"{msg}; reward.options.on_failure=error stops the run (set "
                                   "it to 'drop' to leave such samples out of the loss)")
            log.warning("%s: left out of the loss (reward.options.on_failure=drop)", msg)
        n = len(chunk)
        ok = rewards is not None
        metrics = {"remote_requests": float(attempts), "remote_retries": float(attempts - 1),
                   "remote_failed": 0.0 if ok else float(n),
                   "remote_time_s": time.perf_counter() - start}
        return Scores(rewards=torch.tensor(rewards if ok else [0.0] * n, dtype=torch.float32),
                      correct=torch.tensor(correct if ok else [False] * n, dtype=torch.bool),
                      valid=torch.full((n,), ok, dtype=torch.bool), metrics=metrics)

    def _post(self, body: bytes, n: int) -> tuple[list[float], list[bool]]:
        """One attempt. Raises _Retry (worth another attempt) or Unscored (not)."""
        o = self.opts
        req = urllib.request.Request(o.url, data=body, method="POST",
                                     headers={"Content-Type": "application/json", **o.headers})
        try:
            with urllib.request.urlopen(req, timeout=o.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            if e.code >= 500 or e.code in RETRY_STATUS:
                raise _Retry(f"HTTP {e.code}") from None
            raise Unscored(f"HTTP {e.code} {e.reason}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError,
                http.client.HTTPException) as e:
            reason = getattr(e, "reason", e)
            raise _Retry(f"{type(e).__name__}: {reason}") from None
        return parse_answer(raw, n)

    def _payload(self, s: Sample) -> dict:
        out = {"prompt": s.prompt, "completion": s.completion, "answer": s.answer,
               "record": s.record, "finish_reason": s.finish_reason,
               "turn_rewards": s.turn_rewards}
        if self.opts.send_ids:
            out.update(prompt_ids=s.prompt_ids, completion_ids=s.completion_ids)
        return out

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class _Retry(Exception):
    """An attempt failed in a way another attempt may not."""


def parse_answer(raw: bytes, n: int) -> tuple[list[float], list[bool]]:
    """The endpoint's answer -> (rewards, correct), or Unscored naming what is wrong."""
    try:
        data = json.loads(raw)
    except ValueError:
        raise Unscored(f"the answer is not JSON: {raw[:80]!r}") from None
    rewards = data.get("rewards") if isinstance(data, dict) else None
    if not isinstance(rewards, list) or len(rewards) != n:
        raise Unscored(f"expected {{\"rewards\": [{n} numbers]}}, got {str(data)[:80]}")
    if not all(isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r)
               for r in rewards):
        raise Unscored(f"a reward is not a finite number: {str(rewards)[:80]}")
    correct = data.get("correct")
    if correct is None:
        correct = [r >= 1.0 for r in rewards]
    elif not isinstance(correct, list) or len(correct) != n:
        raise Unscored(f"\"correct\" must be a list of {n} booleans, got {str(correct)[:80]}")
    return [float(r) for r in rewards], [bool(c) for c in correct]


def _join(parts: list[Scores]) -> Scores:
    """The requests' scores in order, their counters summed."""
    if not parts:
        return Scores(rewards=torch.zeros(0), correct=torch.zeros(0, dtype=torch.bool),
                      metrics={"remote_requests": 0.0, "remote_retries": 0.0,
                               "remote_failed": 0.0, "remote_time_s": 0.0, "reward/remote": 0.0})
    valid = torch.cat([p.valid for p in parts])
    rewards = torch.cat([p.rewards for p in parts])
    metrics = {k: sum(p.metrics[k] for p in parts) for k in parts[0].metrics}
    metrics["remote_time_s"] = max(p.metrics["remote_time_s"] for p in parts)
    metrics["reward/remote"] = float(rewards[valid].mean()) if bool(valid.any()) else 0.0
    return Scores(rewards=rewards, per_term={"remote": rewards},
                  correct=torch.cat([p.correct for p in parts]), metrics=metrics,
                  valid=None if bool(valid.all()) else valid)
