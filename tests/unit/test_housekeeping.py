"""The housekeeping lane (tiercache/tiers/housekeeping.py) and fault counting (tiercache/faults.py).

Deletes run on a lane thread, in order, holding the tier's lock; a full queue
drops (and counts) a batch; an exception from the backend is counted and the
lane goes on. Faults are counted by reason and logged once per (reason, where)
per minute, saying how many were not logged.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import pytest

from tiercache import faults
from tiercache.backend import BackendContext
from tiercache.tiers.housekeeping import DeleteLane
from tiercache.metrics import TierCacheMetrics
from tiercache.testing.faulty_backends import FaultySettings, RaisingBackend, _MemoryBackend

CTX = BackendContext("t", b"n" * 8, 16, 1 << 20)


class Recording(_MemoryBackend):
    name = "recording"

    def __init__(self, lock: threading.Lock) -> None:
        super().__init__(FaultySettings(), CTX)
        self.lock = lock
        self.calls: list[tuple[list[bytes], bool]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def delete(self, keys: Sequence[bytes]) -> None:
        self.entered.set()
        self.gate.wait(10)
        self.calls.append((list(keys), self.lock.locked()))


@pytest.fixture(autouse=True)
def _clean() -> None:
    faults.reset_for_tests()


def test_deletes_run_in_order_off_the_caller_thread_holding_the_tier_lock() -> None:
    lock = threading.Lock()
    backend = Recording(lock)
    lane = DeleteLane("t", backend, lock)
    backend.gate.clear()
    assert lane.push([b"a"]) and lane.push([b"b", b"c"])  # returns at once though delete blocks
    assert not lane.idle and not lane.caught_up(1)
    backend.gate.set()
    assert lane.wait_idle(5.0) and lane.caught_up(2)
    assert backend.calls == [([b"a"], True), ([b"b", b"c"], True)]
    lane.close()


def test_a_full_queue_drops_and_counts_and_an_exception_never_ends_the_lane() -> None:
    lock = threading.Lock()
    backend = Recording(lock)
    backend.gate.clear()
    lane = DeleteLane("t", backend, lock, max_keys=2)
    assert lane.push([b"a"]) and backend.entered.wait(5.0)  # running (blocked): no longer queued
    assert lane.push([b"b", b"c"])
    assert not lane.push([b"d"])  # 2 keys queued already
    assert faults.take() == {faults.DELETE_DROPPED: 1}
    backend.gate.set()
    assert lane.wait_idle(5.0)
    lane.close()

    raising = RaisingBackend(FaultySettings(), CTX)
    lane = DeleteLane("r", raising, threading.Lock())
    assert lane.push([b"x"]) and lane.push([b"y"])
    assert lane.wait_idle(5.0) and lane.done_seq == 2  # both ran: the lane survived the first
    assert faults.take() == {faults.BACKEND_EXCEPTION: 2}
    lane.close()


def test_faults_are_counted_by_reason_and_logged_once_per_minute(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tiercache.faults")
    for _ in range(50):
        faults.record(faults.LOAD_DEADLINE, "3 chunks not read from tier redis in 5s", where="redis")
    faults.record(faults.LOAD_DEADLINE, "1 chunk not read from tier disk", where="disk")
    try:
        raise ValueError("garbage from a peer")
    except ValueError as exc:
        faults.record(faults.READER_EXCEPTION, exc, where="pd reader")
    counts = faults.take()
    assert counts == {faults.LOAD_DEADLINE: 51, faults.READER_EXCEPTION: 1}
    assert faults.take() == {}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3  # one per (reason, where), not one per fault
    assert "tier redis" in lines[0] and "ValueError: garbage from a peer" in lines[2]
    assert caplog.records[2].exc_info is not None  # the cause's traceback


def test_fault_counts_reach_the_prometheus_counter() -> None:
    metrics = TierCacheMetrics(engine="1")
    metrics.count_faults({faults.LOAD_DEADLINE: 2, faults.TIER_STALLED: 0})
    metrics.count_faults({faults.LOAD_DEADLINE: 1})
    assert metrics.sample("tiercache_faults_total", reason="load_deadline") == 3
    assert metrics.sample("tiercache_faults_total", reason="tier_stalled") is None
