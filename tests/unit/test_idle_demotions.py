"""An idle engine finishes its copies down to lower tiers (``has_pending_push_work``).

vLLM steps an engine with no request left only while the connector says it has
pending work. A request's last chunks reach the host tier in its last steps;
their write-through copies down are planned in a later step and reported in
another. If the engine stopped stepping in between, the host copies stayed
pinned (so ``reset_prefix_cache(reset_external=True)`` skipped them and the
next request hit the host tier, not the shared one) and a shared tier never
received them until the next request arrived. The real scheduler and worker
halves, a real vLLM block pool and a real disk tier: after the store, the
connector asks for steps until the copies down are planned and reported;
then the engine may idle, and a reset drops every host copy.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

from tests.unit.test_store_fences import CHUNK, Engine, prompt
from tiercache.connector.vllm import TierCacheConnector


@pytest.fixture
def engine(tmp_path: pathlib.Path) -> Iterator[Engine]:
    disk = {"name": "disk", "backend": "disk", "capacity": "4MiB", "mode": "write_through",
            "options": {"root": str(tmp_path / "disk"), "fsync": "none", "io_threads": 1}}
    made = Engine(lower=[disk])
    yield made
    made.close()


def connector(engine: Engine) -> TierCacheConnector:
    conn = object.__new__(TierCacheConnector)
    conn._scheduler, conn._worker = engine.sched, None
    return conn


def until(condition: Callable[[], Any], step: Callable[[], None], timeout_s: float = 30.0) -> None:
    """Empty steps (``step``) until ``condition``, as vLLM steps an engine with pending work."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not done after {timeout_s:g}s of steps"
        step()
        time.sleep(0.005)


def test_an_idle_engine_steps_until_its_copies_down_are_reported(engine: Engine) -> None:
    conn = connector(engine)
    manager = engine.sched.manager
    r1, blocks = engine.admit("r1", prompt(5, 2 * CHUNK))
    meta = engine.schedule({"r1": 2 * CHUNK})
    (store,) = meta.stores
    engine.runner.execute(meta, new_blocks=blocks, written=blocks)
    engine.finish(r1)
    engine.runner.until_closed(store.job_id)  # both chunks are in the host tier now
    keys = store.keys
    # the copies down are queued, not yet planned: no request is left, yet the engine must step
    assert manager.cascade.copies_queued() and conn.has_pending_push_work() is True
    empty = engine.schedule({})
    (demote,) = empty.demotes
    assert set(demote.keys) == set(keys) and not manager.cascade.copies_queued()
    assert conn.has_pending_push_work() is True  # planned, not yet reported
    assert manager.reset() == 0  # meanwhile a reset skips the pinned host copies
    engine.runner.execute(empty, new_blocks=[], written=[])
    until(lambda: demote.job_id not in engine.sched._jobs, engine.runner.report)
    assert conn.has_pending_push_work() is False  # now the engine may idle
    assert all(manager.state_of(key, "disk") is not None for key in keys)
    assert manager.reset() == 4  # the host copies and the disk tier's (owned by this engine)
