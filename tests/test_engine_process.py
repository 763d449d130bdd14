"""rollout.engine_failure=continue runs each rollout rank's engine in a child process
(`megagrpo.engine.process.EngineProcess`). Real child processes here, with a stand-in engine
(tests/_engine_child.py): calls and their errors come back as the engine gave them, a weight
update crosses in chunks and arrives bitwise (checked against float64 sums made here), and a
child that is SIGKILLed or stops answering makes the engine lost, once, with what happened; a
lost engine still drains every weight update it is sent (its rank keeps taking the syncs)."""
import os
import signal

import pytest
import torch

from megagrpo.engine import process
from megagrpo.engine.process import EngineLost, EngineProcess
from tests._engine_child import SumEngine


def _weights(seed: int) -> list[list[tuple[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    return [[(f"w{b}.{i}", torch.randn(50, 40, generator=g)) for i in range(3)] for b in range(4)]


@pytest.fixture
def engine():
    e = EngineProcess(SumEngine, timeout_s=60, rank=7, start_timeout_s=120)
    yield e
    e.close()


def test_calls_weights_and_errors_cross_the_process(engine, monkeypatch):
    monkeypatch.setattr(process, "CHUNK_BYTES", 20_000)  # 4 buckets of 24 kB: 4 chunks
    buckets = _weights(1)
    stats = engine.update_weights(iter(buckets))
    want = sum(float(t.double().sum()) for b in buckets for _, t in b)
    assert (stats.tensors, stats.bytes) == (12, 12 * 50 * 40 * 4)
    assert engine.generate([[1, 2], [5]]) == pytest.approx([want + 2, want + 5], abs=0, rel=0)
    with pytest.raises(ValueError, match="bad argument, raised in the engine"):
        engine._call("fail")
    assert engine.alive() and engine._call("pid") == engine.pid != os.getpid()


def test_a_killed_engine_is_lost_and_still_drains_the_syncs(engine):
    engine.update_weights(iter(_weights(1)))
    os.kill(engine.pid, signal.SIGKILL)
    engine.proc.join(10)
    assert not engine.alive()
    assert "was killed by signal 9 (SIGKILL)" in str(engine.lost)
    with pytest.raises(EngineLost, match=f"child process {engine.pid}"):
        engine.generate([[1]])
    taken = []

    def feed():  # a sync's buckets, as the collectives deliver them
        for b in _weights(2):
            taken.append(b)
            yield b

    stats = engine.update_weights(feed())
    assert len(taken) == 4 and stats.tensors == 0


def test_a_killed_engine_fails_the_call_in_progress(engine):
    os.kill(engine.pid, signal.SIGKILL)  # dies before it answers
    with pytest.raises(EngineLost, match="killed by signal 9"):
        engine.generate([[1]])


def test_an_engine_that_stops_answering_is_killed_at_the_deadline():
    # the start (a spawned interpreter importing torch) may take seconds on a loaded machine:
    # its own deadline; the call's is the one tested
    e = EngineProcess(SumEngine, timeout_s=1.5, rank=3, start_timeout_s=120)
    try:
        with pytest.raises(EngineLost, match="did not answer hang in 2 s"):
            e._call("hang")
        assert not e.proc.is_alive() and not e.alive()
    finally:
        e.close()
