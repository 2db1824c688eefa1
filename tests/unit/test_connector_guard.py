"""No exception from tiercache reaches vLLM: the connector facade's containment (connector/guard.py).

Every method vLLM calls once the engine serves is run with a scheduler and a
worker that raise from everything: each returns its safe answer (no hit, no
load, nothing finished, no metadata to report) and counts a
``connector_exception``. Then, with the real scheduler and worker halves, the
fallbacks whose answer matters: a load that cannot run is reported failed (its
blocks recomputed), in load_mode async also finished (its request never waits
forever), and its pins are released; a store that cannot run is a future miss.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from tiercache.jobs import TransferJob  # noqa: E402
from tiercache.testing.job_builders import make_job  # noqa: E402
from tiercache.connector.engine_info import ChunkGeometry, EngineGeometry  # noqa: E402
from tiercache.connector.metadata import TierCacheConnectorMetadata  # noqa: E402
from tiercache.connector.scheduler import TierCacheScheduler  # noqa: E402
from tiercache.connector.vllm import TierCacheConnector  # noqa: E402
from tiercache.connector.worker import TierCacheWorker  # noqa: E402

from tiercache import faults  # noqa: E402
from tiercache.config.schema import load_config  # noqa: E402
from tiercache.transfer.device import CopySegment  # noqa: E402


BLOCK, BLOCKS, HEADS, HEAD_DIM = 32, 32, 2, 8
PER_BLOCK = 2 * (2 * BLOCK * HEADS * HEAD_DIM * 4)  # two layers of K and V, float32


class Exploding:
    """Every attribute is a function that raises."""

    def __getattr__(self, name: str) -> Any:
        def boom(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"{name} exploded (test)")
        return boom


def facade(scheduler: Any = None, worker: Any = None, meta: Any = None) -> TierCacheConnector:
    """The vLLM-facing connector around the given halves (no engine, no __init__)."""
    conn = object.__new__(TierCacheConnector)
    conn._scheduler, conn._worker = scheduler, worker
    conn._namespace = SimpleNamespace(saw=lambda meta: None, attach=lambda report: report)
    conn._connector_metadata = meta
    return conn


@pytest.fixture(autouse=True)
def _clean() -> None:
    faults.reset_for_tests()


def request(rid: str = "r", tokens: int = 192) -> SimpleNamespace:
    hashes = [bytes([i + 1]) * 32 for i in range(tokens // BLOCK)]
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(tokens)), num_prompt_tokens=tokens,
                           num_tokens=tokens, num_computed_tokens=0, block_hashes=hashes)


def geometry(load_mode: str = "sync") -> tuple[Any, ChunkGeometry]:
    config = load_config(chunk_tokens=2 * BLOCK, tiers=[{"name": "cpu", "backend": "cpu", "capacity": "1MiB"}],
                         load_mode=load_mode)
    engine = EngineGeometry(model="m", kv_dtype="torch.float32", kv_layout="NHD", block_size=BLOCK, tp_size=1,
                            world_size=1, bytes_per_block=PER_BLOCK, hash_algo="sha256")
    return config, ChunkGeometry.build(config, engine)


def test_every_facade_method_turns_an_exception_into_its_safe_answer() -> None:
    conn = facade(Exploding(), Exploding(), TierCacheConnectorMetadata(loads_are_sync=True))
    req, out = request(), SimpleNamespace(kv_connector_worker_meta=None)
    assert conn.handle_preemptions(TierCacheConnectorMetadata()) is None
    assert conn.start_load_kv(None) is None
    assert conn.wait_for_save() is None
    assert conn.get_finished(set()) == (set(), set())
    assert conn.get_block_ids_with_load_errors() == set()
    assert conn.build_connector_worker_meta() is None
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)  # type: ignore[arg-type]
    assert conn.update_state_after_alloc(req, SimpleNamespace(), 64) is None  # type: ignore[arg-type]
    assert isinstance(conn.build_connector_meta(SimpleNamespace()), TierCacheConnectorMetadata)  # type: ignore[arg-type]
    assert conn.update_connector_output(out) is None  # type: ignore[arg-type]
    assert conn.request_finished(req, []) == (False, None)  # type: ignore[arg-type]
    assert conn.request_finished_all_groups(req, ([],)) == (False, None)  # type: ignore[arg-type]
    assert conn.has_pending_push_work() is False
    assert list(conn.take_events()) == []
    assert conn.get_kv_connector_stats() is None
    assert conn.reset_cache() is False
    assert conn.shutdown() is None
    # 17 methods; start_load_kv, wait_for_save, update_state_after_alloc and build_connector_meta
    # also tried their fallback, which raised too (the halves explode)
    assert faults.take() == {faults.CONNECTOR_EXCEPTION: 17 + 4}


@pytest.fixture
def worker() -> Any:
    config, geo = geometry()
    w = TierCacheWorker(config, geo, BLOCKS)
    gen = torch.Generator().manual_seed(0)
    w.register_kv_caches({f"layer.{i}": torch.randn(2, BLOCKS, BLOCK, HEADS, HEAD_DIM, generator=gen)
                          for i in range(2)})
    yield w
    w.shutdown()


def store_job(job_id: int) -> TransferJob:
    return make_job(job_id, "w", "store", (b"k" * 44,), (CopySegment(0, 0, (1, 2)),))


def load_job(job_id: int, rid: str, blocks: tuple[int, ...]) -> TransferJob:
    return make_job(job_id, rid, "load", (b"k" * 44,), (CopySegment(0, 0, blocks),))


def test_a_sync_load_whose_wait_raises_is_recomputed_and_still_reported_to_the_manager(worker: Any) -> None:
    meta = TierCacheConnectorMetadata(loads=[load_job(1, "a", (9, 10))], loads_are_sync=True)
    conn = facade(worker=worker, meta=meta)
    real_wait = worker.engine.wait_for
    worker.engine.wait_for = lambda ids, *a, **k: (_ for _ in ()).throw(RuntimeError("wait exploded (test)"))
    conn.start_load_kv(None)  # no exception
    worker.engine.wait_for = real_wait
    assert conn.get_block_ids_with_load_errors() == {9, 10}  # vLLM recomputes them
    assert conn.get_finished(set()) == (set(), set())  # a sync load is never "finished receiving"
    report = conn.build_connector_worker_meta()
    assert report is not None and 1 in report.done  # the manager hears of it: its pins go
    assert report.faults == {faults.CONNECTOR_EXCEPTION: 1}


@pytest.mark.parametrize("where", ["submit", "facade"])
def test_an_async_load_that_cannot_run_is_finished_with_its_blocks_failed(worker: Any, where: str) -> None:
    meta = TierCacheConnectorMetadata(loads=[load_job(1, "a", (5,)), load_job(2, "b", (9, 10))], loads_are_sync=False)
    conn = facade(worker=worker, meta=meta)
    if where == "submit":  # the pipeline refuses job 2: it fails alone
        real = worker.engine.submit
        worker.engine.submit = lambda spec: (real(spec) if spec.job_id != 2
                                                         else (_ for _ in ()).throw(RuntimeError("test")))
    else:  # start_load_kv raises before job 2: the facade's fallback fails what was not taken
        real = worker._start_load
        worker._start_load = lambda engine, spec, sync: (
            real(engine, spec, sync) if spec.job_id != 2 else (_ for _ in ()).throw(RuntimeError("test")))
    conn.start_load_kv(None)
    recving: set[str] = set()
    for _ in range(1000):  # job 1's copy runs on the copy thread
        recving |= conn.get_finished(set())[1]
        if recving == {"a", "b"}:
            break
        time.sleep(0.005)
    assert recving == {"a", "b"}  # both requests leave WAITING_FOR_REMOTE_KVS
    assert conn.get_block_ids_with_load_errors() == {9, 10}
    report = conn.build_connector_worker_meta()
    assert report is not None and report.done[2].failed_keys == {b"k" * 44}


def test_a_save_that_cannot_run_is_a_future_miss(worker: Any) -> None:
    meta = TierCacheConnectorMetadata(stores=[store_job(1), store_job(2)])
    conn = facade(worker=worker, meta=meta)
    worker.engine.delete = lambda deletes: (_ for _ in ()).throw(RuntimeError("delete exploded (test)"))
    conn.wait_for_save()  # raises before any store: the fallback fails both
    report = conn.build_connector_worker_meta()
    assert report is not None and set(report.done) == {1, 2}
    assert all(r.failed_keys == {b"k" * 44} for r in report.done.values())


BLOCK_IDS = [10, 11, 12, 13, 14, 15]


def hitting_scheduler(load_mode: str) -> tuple[TierCacheScheduler, TierCacheConnector, Any, list[bytes]]:
    """A real scheduler whose host tier holds the first two chunks of ``request()``; its facade."""
    config, geo = geometry(load_mode)
    sched = TierCacheScheduler(config, geo)
    sched.bind_kv_cache_manager(SimpleNamespace(get_block_ids=lambda rid: (BLOCK_IDS,)))  # type: ignore[arg-type]
    req = request()
    keys = sched.keys.chunk_keys(req.block_hashes)
    sched.manager.prepare_store(keys[:2])
    sched.manager.complete_store(keys[:2])
    conn = facade(scheduler=sched)
    assert conn.get_num_new_matched_tokens(req, 0) == (128, load_mode == "async")  # type: ignore[arg-type]
    return sched, conn, req, keys


def step_output(**scheduled: int) -> Any:
    return SimpleNamespace(num_scheduled_tokens=scheduled, finished_req_ids=set(), preempted_req_ids=None)


def raising(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("test")


@pytest.mark.parametrize("load_mode", ["sync", "async"])
def test_a_failed_alloc_fails_the_promised_blocks_and_releases_the_pins(load_mode: str) -> None:
    sched, conn, req, _ = hitting_scheduler(load_mode)
    sched.manager.prepare_load = raising  # type: ignore[method-assign]
    conn.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (BLOCK_IDS,)), 128)  # type: ignore[arg-type]
    meta = conn.build_connector_meta(step_output())
    assert meta.loads == [] and meta.invalid_block_ids == [10, 11, 12, 13]
    assert meta.failed_recvs == (["r"] if load_mode == "async" else [])
    assert not sched.manager.host.pins


@pytest.mark.parametrize("load_mode", ["sync", "async"])
def test_a_failed_step_fails_its_planned_loads_and_releases_their_pins(load_mode: str) -> None:
    sched, conn, req, keys = hitting_scheduler(load_mode)
    conn.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (BLOCK_IDS,)), 128)  # type: ignore[arg-type]
    assert sched.manager.host.pins
    sched.manager.cascade.prepare_demotions = raising  # type: ignore[method-assign]
    meta = conn.build_connector_meta(step_output(r=10))
    assert meta.loads == [] and meta.stores == [] and sorted(meta.invalid_block_ids) == [10, 11, 12, 13]
    assert meta.failed_recvs == (["r"] if load_mode == "async" else [])
    assert not sched.manager.host.pins and sched.manager.lookup(keys[:2]) == 0  # discarded: recomputed
