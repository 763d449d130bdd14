"""The `remote` reward source against a local HTTP server written here (127.0.0.1, a free port):
batching, the answers in order, a timeout retried, bounded retries then the samples dropped
(left out of the loss, counted) or the step stopped, the concurrency limit as the server saw
it, and bad options refused before anything is sent."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from megagrpo.config.data import RewardConfig
from megagrpo.reward import Sample, build_rewards, check_source


class Verifier:
    """The server's behaviour and what it saw. The reward of a sample is len(completion) / 10;
    a completion containing 'bad' (or a record {k: fail_record}) makes its request answer 503;
    'slow' makes the first request that holds it sleep past the client's deadline; 'junk'
    makes it answer a wrong length."""

    def __init__(self, hold_s: float = 0.0, fail_record: int | None = None) -> None:
        self.hold_s, self.fail_record = hold_s, fail_record
        self.lock = threading.Lock()
        self.requests: list[list[str]] = []
        self.in_flight = self.max_in_flight = 0
        self.slow_seen = False

    def answer(self, samples: list[dict]) -> tuple[int, dict]:
        completions = [s["completion"] for s in samples]
        with self.lock:
            self.requests.append(completions)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            first_slow = any("slow" in c for c in completions) and not self.slow_seen
            self.slow_seen |= first_slow
        try:
            time.sleep(3.0 if first_slow else self.hold_s)
            if any("bad" in c for c in completions) or any(
                    self.fail_record is not None and s["record"].get("k") == self.fail_record
                    for s in samples):
                return 503, {"error": "overloaded"}
            rewards = [len(c) / 10 for c in completions]
            if any("junk" in c for c in completions):
                rewards = rewards[:-1]
            return 200, {"rewards": rewards,
                         "correct": [s["answer"] in s["completion"] for s in samples]}
        finally:
            with self.lock:
                self.in_flight -= 1


@pytest.fixture
def server():
    started: list[ThreadingHTTPServer] = []

    def start(verifier: Verifier) -> str:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, out = verifier.answer(body["samples"])
                data = json.dumps(out).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up on a slow answer

            def log_message(self, *args):
                pass

        httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        httpd.daemon_threads = True
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        started.append(httpd)
        return f"http://127.0.0.1:{httpd.server_address[1]}/score"

    yield start
    for httpd in started:
        httpd.shutdown()
        httpd.server_close()


def sample(completion: str, answer: str = "7") -> Sample:
    return Sample(prompt="q", prompt_ids=[1], completion=completion, completion_ids=[2],
                  answer=answer, record={"id": completion})


def remote(url: str, **options) -> RewardConfig:
    cfg = RewardConfig(source="remote", options=dict(url=url, backoff_s=0.0, **options))
    cfg.validate()
    check_source(cfg)
    return cfg


def test_batched_in_order_with_the_servers_verdicts(server):
    v = Verifier()
    texts = [f"answer {i} is 7" if i % 3 == 0 else "x" * i for i in range(7)]
    rewards = build_rewards(remote(server(v), batch_size=3, concurrency=1))
    handle = rewards.submit([sample(t) for t in texts])
    scores = handle.result()
    assert sorted(v.requests, key=len, reverse=True) == [texts[0:3], texts[3:6], texts[6:7]]
    assert torch.allclose(scores.rewards, torch.tensor([len(t) / 10 for t in texts]))
    assert scores.correct.tolist() == ["7" in t for t in texts]
    assert scores.valid is None and scores.metrics["remote_requests"] == 3
    assert scores.metrics["remote_failed"] == 0


def test_a_timeout_is_retried_and_then_scores(server):
    v = Verifier()
    cfg = remote(server(v), batch_size=2, timeout_s=1.0, max_retries=1)  # 1 s: loaded CPUs
    scores = build_rewards(cfg).score([sample("slow one"), sample("ok")])
    assert len(v.requests) == 2  # the first timed out, the retry answered
    assert torch.allclose(scores.rewards, torch.tensor([0.8, 0.2]))
    assert scores.metrics["remote_retries"] == 1 and scores.valid is None


def test_bounded_retries_then_the_request_is_dropped_and_counted(server, caplog):
    v = Verifier()
    cfg = remote(server(v), batch_size=2, max_retries=2, concurrency=1)
    with caplog.at_level("WARNING", logger="megagrpo"):
        scores = build_rewards(cfg).score([sample("aa"), sample("bad"), sample("cccc")])
    bad_requests = [r for r in v.requests if "bad" in r]
    assert len(bad_requests) == 3  # 1 + max_retries attempts, no more
    assert scores.valid.tolist() == [False, False, True]  # the whole request of 2
    assert scores.metrics["remote_failed"] == 2 and scores.metrics["remote_retries"] == 2
    assert scores.rewards[2] == pytest.approx(0.4)
    assert "2 samples unscored after 3 attempt(s) (HTTP 503)" in caplog.text
    assert "on_failure=drop" in caplog.text


def test_a_malformed_answer_is_not_retried(server):
    v = Verifier()
    scores = build_rewards(remote(server(v), batch_size=4)).score([sample("junk"), sample("a")])
    assert len(v.requests) == 1 and scores.valid.tolist() == [False, False]


def test_on_failure_error_stops_the_step(server):
    v = Verifier()
    rewards = build_rewards(remote(server(v), max_retries=0, on_failure="error"))
    with pytest.raises(RuntimeError, match="on_failure=error stops the run"):
        rewards.score([sample("bad")])


def test_concurrency_limit_as_the_server_saw_it(server):
    v = Verifier(hold_s=0.3)
    rewards = build_rewards(remote(server(v), batch_size=1, concurrency=2))
    handle = rewards.submit([sample("x" * i) for i in range(8)])
    assert not handle.done()  # submit returned before the server answered: the future
    scores = handle.result()
    assert len(v.requests) == 8 and v.max_in_flight == 2
    assert torch.allclose(scores.rewards, torch.arange(8) / 10)


def test_dropped_samples_leave_the_loss_and_take_their_groups_mean():
    """The collector's side: an unscored sample is marked and its reward is its group's mean
    over the scored ones (hand-computed), so group advantages ignore it."""
    from megagrpo.engine import Completion
    from megagrpo.rollout.collect import impute_failed

    comps = [Completion(prompt_index=p, sample_index=i, token_ids=[1], logprobs=[0.0],
                        finish_reason="stop") for p in (0, 1) for i in range(3)]
    rewards = torch.tensor([1.0, 9.0, 0.5, 2.0, 3.0, 4.0])
    valid = torch.tensor([True, False, True, False, False, False])
    out = impute_failed(comps, rewards, valid)
    assert out.tolist() == [1.0, 0.75, 0.5, 0.0, 0.0, 0.0]
    assert [c.dropped == "reward_error" for c in comps] == [False, True, False, True, True, True]


def test_bad_options_are_refused_naming_the_field():
    cases = [({}, r"reward.options.url is required"),
             ({"url": "ftp://x"}, r"reward.options.url='ftp://x': use an http"),
             ({"url": "http://h", "concurency": 2}, r"reward.options.concurency: unknown option "
                                                    r"\(did you mean 'concurrency'\?\)"),
             ({"url": "http://h", "timeout_s": 0}, r"reward.options.timeout_s=0.0: need > 0"),
             ({"url": "http://h", "batch_size": "many"}, r"reward.options.batch_size='many'"),
             ({"url": "http://h", "on_failure": "zero"}, r"reward.options.on_failure='zero'")]
    for options, msg in cases:
        with pytest.raises(ValueError, match=msg):
            check_source(RewardConfig(source="remote", options=options))


def test_unscored_samples_leave_the_loss_through_the_collector(server):
    """Collector -> remote source -> gather -> build_batch: the group of the record the server
    refuses is marked, its rewards are 0 (no scored sample in the group), none of its tokens
    is in the loss mask, and every other sample keeps its server reward and its tokens."""
    from megagrpo.train.advantage import build_batch
    from tests.test_reward_source import collector

    v = Verifier(fail_record=1)
    c = collector(build_rewards(remote(server(v), batch_size=2, max_retries=1)))
    ro = c.next(version=0)
    failed = [x.dropped == "reward_error" for x in ro.completions]
    prompts_failed = {x.prompt_index for x in ro.completions if x.dropped == "reward_error"}
    assert sum(failed) == 2 and len(prompts_failed) == 1  # one group of G=2
    assert ro.metrics["reward_failed"] == 2 and ro.metrics["remote_failed"] == 2
    texts = [x.text or c.tokenizer.decode(x.token_ids) for x in ro.completions]
    want = [0.0 if f else len(t) / 10 for f, t in zip(failed, texts)]
    assert torch.allclose(ro.rewards, torch.tensor(want))
    batch, _ = build_batch(ro, c.cfg, pad_id=0, multiple=1)
    assert int(batch.mask.sum()) == sum(len(x.token_ids) for x in ro.completions
                                        if x.dropped != "reward_error")
