"""A store's source blocks are not reallocated until every worker copied them (connector/store_pins.py).

vLLM 0.32's V2 model runner (``vllm/v1/worker/gpu/model_runner.py``, CUDA's
default) zeroes newly allocated blocks in ``update_requests``, before
``kv_connector.pre_forward`` calls the connector's ``handle_preemptions``. A
block freed by a finished request while its store still copies, then handed
to a new request in the next ``schedule()``, is therefore overwritten before
any worker-side fence could run. Here a fake runner with that hook order
drives the real scheduler and worker halves, a real vLLM ``KVCacheManager``
(block pool) and real CPU KV tensors; the store's copy is held on a gate until
the new request's blocks were zeroed. The stored chunk must be intact; with
the scheduler's pins switched off (the negative control) it is not. Then: the
pins last until every rank reported, are released for failed stores and for
stores of a step whose metadata never went out, keep the engine stepping
(``has_pending_push_work``), and leave no reference behind after many steps.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from tiercache.connector.engine_info import ChunkGeometry, EngineGeometry  # noqa: E402
from tiercache.connector.metadata import TierCacheConnectorMetadata  # noqa: E402
from tiercache.connector.scheduler import TierCacheScheduler  # noqa: E402
from tiercache.connector.vllm import TierCacheConnector  # noqa: E402
from tiercache.connector.worker import TierCacheWorker  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from tiercache.config.schema import load_config  # noqa: E402
from tiercache.jobs import StoreJob  # noqa: E402
from tiercache.layout import KVBlockLayout  # noqa: E402
from tiercache.transfer.device import CopyJob  # noqa: E402

BLOCK, HEADS, HEAD_DIM, LAYERS = 32, 2, 8, 2
NUM_BLOCKS = 12  # vLLM's pool; block 0 is its null block
PER_BLOCK = LAYERS * 2 * BLOCK * HEADS * HEAD_DIM * 4  # K and V, float32
CHUNK = 2 * BLOCK

init_none_hash(sha256)
HASHER = get_request_block_hasher(BLOCK, sha256)


# ------------------------------------------------------------------ the parts
def kv_manager() -> KVCacheManager:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec([f"layer.{i}" for i in range(LAYERS)], spec)])
    return KVCacheManager(config, max_model_len=NUM_BLOCKS * BLOCK, scheduler_block_size=BLOCK,
                          hash_block_size=BLOCK)


def geometry(world_size: int = 1, lower: list[dict[str, Any]] = ()) -> tuple[Any, ChunkGeometry]:  # type: ignore[assignment]
    config = load_config(chunk_tokens=CHUNK, tiers=[{"name": "cpu", "backend": "cpu", "capacity": "1MiB"}, *lower])
    engine = EngineGeometry(model="m", kv_dtype="torch.float32", kv_layout="NHD", block_size=BLOCK,
                            tp_size=world_size, world_size=world_size, bytes_per_block=PER_BLOCK,
                            hash_algo="sha256")
    return config, ChunkGeometry.build(config, engine)


def kv_tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"layer.{i}": torch.randn(2, NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM, generator=gen) for i in range(LAYERS)}


class Rank:
    """One worker process: a real TierCacheWorker on real KV tensors, and its copy gate."""

    def __init__(self, config: Any, geo: ChunkGeometry, rank: int) -> None:
        self.kv = kv_tensors(seed=100 + rank)
        self.worker = TierCacheWorker(config, geo, NUM_BLOCKS, rank=rank)
        self.worker.register_kv_caches(self.kv)
        self.copier = self.worker._engine().engine.copier
        self.gated: dict[int, threading.Event] = {}  # job id -> the event its copy waits for
        self.failing: set[int] = set()  # job ids whose copy raises
        copy = self.copier._copy

        def gated_copy(job: CopyJob) -> int:  # the copy thread: the real copy, once let through
            gate = self.gated.get(job.job_id)
            if gate is not None:
                assert gate.wait(30), "the test never opened the gate"
            if job.job_id in self.failing:
                raise OSError("copy failed (test)")
            return copy(job)

        self.copier._copy = gated_copy  # the seam tests/unit/test_copier.py uses too

    def hold(self, job_id: int) -> threading.Event:
        self.gated[job_id] = gate = threading.Event()
        return gate

    def slot(self, slot: int) -> torch.Tensor:
        return self.worker._engine().engine.host.slab[slot].clone()


class V2Runner:
    """vLLM 0.32's V2 runner's hook order (GPUModelRunner.execute_model) for every rank.

    ``update_requests`` zeroes the step's newly allocated blocks, then
    ``kv_connector.pre_forward`` calls handle_preemptions and (sync loads)
    start_load_kv, then the forward pass writes the scheduled tokens' KV, then
    ``post_forward`` calls wait_for_save, get_finished and the worker report.
    """

    def __init__(self, sched: TierCacheScheduler, ranks: list[Rank]) -> None:
        self.sched, self.ranks = sched, ranks
        self.gen = torch.Generator().manual_seed(7)

    def execute(self, meta: TierCacheConnectorMetadata, new_blocks: list[int], written: list[int],
                before_pre_forward: Callable[[], None] = lambda: None) -> None:
        for r in self.ranks:  # update_requests: kv_block_zeroer.zero_block_ids(new_block_ids_to_zero)
            for t in r.kv.values():
                t[:, new_blocks] = 0
        before_pre_forward()
        for r in self.ranks:
            r.worker.handle_preemptions(meta)
            r.worker.start_load_kv(meta)
            for t in r.kv.values():  # the forward pass writes the scheduled tokens' KV
                t[:, written] = torch.randn(t[:, written].shape, generator=self.gen)
            r.worker.wait_for_save(meta)
        self.report()

    def report(self) -> None:
        """get_finished and the worker reports, into the scheduler (update_connector_output)."""
        for r in self.ranks:
            r.worker.get_finished(set())
            self.sched.update_connector_output(r.worker.build_worker_meta())

    def until_closed(self, job_id: int) -> None:
        """Empty steps until every rank reported ``job_id`` (the engine keeps stepping meanwhile)."""
        deadline = time.monotonic() + 30
        while job_id in self.sched._jobs:
            assert time.monotonic() < deadline, f"job {job_id} never reported"
            self.report()
            time.sleep(0.005)


class Engine:
    """vLLM's scheduler side, reduced to the calls that matter here, on a real KVCacheManager."""

    def __init__(self, world_size: int = 1, pins: bool = True, lower: list[dict[str, Any]] = ()) -> None:  # type: ignore[assignment]
        config, geo = geometry(world_size, lower)
        self.kv_mgr = kv_manager()
        self.sched = TierCacheScheduler(config, geo)
        self.sched.bind_kv_cache_manager(self.kv_mgr)
        if not pins:
            self.sched.store_pins.bind(None)  # the negative control: the mechanism switched off
        self.ranks = [Rank(config, geo, rank) for rank in range(world_size)]
        self.runner = V2Runner(self.sched, self.ranks)
        self.finished: set[str] = set()
        self.preempted: set[str] = set()

    def close(self) -> None:
        for r in self.ranks:
            for gate in r.gated.values():
                gate.set()
            r.worker.shutdown()
        self.sched.shutdown()

    def admit(self, rid: str, tokens: list[int]) -> tuple[Request, list[int]]:
        req = Request(rid, tokens, SamplingParams(max_tokens=8), None, block_hasher=HASHER)
        assert self.sched.get_num_new_matched_tokens(req, 0) == (0, False)
        blocks = self.kv_mgr.allocate_slots(req, len(tokens))
        assert blocks is not None
        self.sched.update_state_after_alloc(req, blocks, 0)
        return req, blocks.get_block_ids()[0]

    def schedule(self, scheduled: dict[str, int]) -> TierCacheConnectorMetadata:
        out = SchedulerOutput.make_empty()
        out.num_scheduled_tokens = dict(scheduled)
        out.finished_req_ids, self.finished = self.finished, set()
        out.preempted_req_ids, self.preempted = self.preempted or None, set()
        return self.sched.build_connector_meta(out)

    def finish(self, req: Request) -> None:
        """Scheduler._free_request: request_finished, then the blocks are freed at once."""
        delay, _ = self.sched.request_finished(req, self.kv_mgr.get_block_ids(req.request_id))
        assert delay is False
        self.kv_mgr.free(req)
        self.finished.add(req.request_id)

    def preempt(self, req: Request) -> None:
        """Scheduler._preempt_request: the blocks are freed without asking the connector."""
        self.kv_mgr.free(req)
        req.num_computed_tokens = 0
        self.preempted.add(req.request_id)

    def refs(self) -> list[int]:
        return [b.ref_cnt for b in self.kv_mgr.block_pool.blocks[1:]]


@pytest.fixture
def engines() -> Iterator[Callable[..., Engine]]:
    made: list[Engine] = []

    def make(**kwargs: Any) -> Engine:
        made.append(Engine(**kwargs))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30000) for _ in range(n)]


def stored_bytes(kv: dict[str, torch.Tensor], block_ids: tuple[int, ...]) -> torch.Tensor:
    """What a host slot holds after storing ``block_ids`` (a whole chunk) from ``kv``: each region's pages."""
    layout = KVBlockLayout.from_kv_caches(kv, NUM_BLOCKS)
    return torch.cat([region[list(block_ids)].reshape(-1) for region in layout.regions])


def computed_blocks(engine: Engine, req: Request, tokens: int) -> list[int]:
    """The blocks whose slots the forward pass writes for ``tokens`` more tokens of ``req``."""
    ids = engine.kv_mgr.get_block_ids(req.request_id)[0]
    start = req.num_computed_tokens
    return ids[start // BLOCK: (start + tokens - 1) // BLOCK + 1]


# ------------------------------------------------------------------ the race
def race(engine: Engine) -> tuple[StoreJob, torch.Tensor, torch.Tensor]:
    """A finished request's store still copies while its blocks go to a new request, zeroed first.

    Returns the store, what its host slots hold afterwards, and the blocks' bytes when stored.
    """
    rank = engine.ranks[0]
    r1, _ = engine.admit("r1", prompt(1, 2 * CHUNK))
    meta = engine.schedule({"r1": 2 * CHUNK})
    (store,) = meta.stores
    gate = rank.hold(store.job_id)
    r1_blocks = engine.kv_mgr.get_block_ids("r1")[0]
    engine.runner.execute(meta, new_blocks=r1_blocks, written=r1_blocks)  # prefill; the store is held
    r1.num_computed_tokens = 2 * CHUNK
    original = torch.cat([stored_bytes(rank.kv, seg.block_ids) for seg in store.segments])
    engine.finish(r1)  # update_from_output: r1 is done, vLLM frees its blocks
    free = engine.kv_mgr.block_pool.get_num_free_blocks()
    _, r2_blocks = engine.admit("r2", prompt(2, free * BLOCK))  # every block the pool gives
    meta2 = engine.schedule({"r2": free * BLOCK})
    # the V2 runner zeroes r2's blocks in update_requests; only then may the held copy go on
    engine.runner.execute(meta2, new_blocks=r2_blocks, written=r2_blocks, before_pre_forward=gate.set)
    engine.runner.until_closed(store.job_id)
    return store, torch.cat([rank.slot(seg.slot) for seg in store.segments]), original


def test_a_finished_requests_store_survives_its_blocks_reuse_by_the_v2_runner(engines: Callable[..., Engine]) -> None:
    engine = engines()
    store, slot, original = race(engine)
    assert torch.count_nonzero(original) > 0
    assert torch.equal(slot, original), "the stored chunk was overwritten before its copy ran"
    assert [engine.refs()[b - 1] for b in store.block_ids()] == [0] * 4  # released once reported
    assert engine.sched.manager.lookup(list(store.keys)) == 2  # stored, and ready


def test_negative_control_without_pins_the_reused_blocks_corrupt_the_store(engines: Callable[..., Engine]) -> None:
    engine = engines(pins=False)
    _, slot, original = race(engine)
    assert not torch.equal(slot, original), "no corruption without pins: the race is not reproduced"


# ------------------------------------------------------------------ the pins' life
def test_pins_last_until_every_rank_reported_and_keep_the_engine_stepping(engines: Callable[..., Engine]) -> None:
    engine = engines(world_size=2)
    conn = object.__new__(TierCacheConnector)
    conn._scheduler, conn._worker = engine.sched, None
    r1, blocks = engine.admit("r1", prompt(3, 2 * CHUNK))
    meta = engine.schedule({"r1": 2 * CHUNK})
    (store,) = meta.stores
    assert engine.refs()[:4] == [2, 2, 2, 2]  # the request's and the store's
    gate = engine.ranks[1].hold(store.job_id)
    engine.runner.execute(meta, new_blocks=blocks, written=blocks)
    engine.finish(r1)  # vLLM drops its own references at once
    assert conn.has_pending_push_work() is True  # an idle engine steps on to hear the reports
    deadline = time.monotonic() + 30
    while engine.sched._jobs[store.job_id].reports_left == 2:  # rank 0's copy is not held
        assert time.monotonic() < deadline
        engine.runner.report()
        time.sleep(0.005)
    assert engine.refs()[:4] == [1, 1, 1, 1] and conn.has_pending_push_work() is True
    assert engine.kv_mgr.reset_prefix_cache() is False  # vLLM's reset waits for the pins too
    gate.set()
    engine.runner.until_closed(store.job_id)
    assert engine.refs() == [0] * (NUM_BLOCKS - 1) and conn.has_pending_push_work() is False
    assert engine.kv_mgr.reset_prefix_cache() is True


def test_a_failed_store_releases_its_pins(engines: Callable[..., Engine]) -> None:
    engine = engines()
    r1, blocks = engine.admit("r1", prompt(4, 2 * CHUNK))
    meta = engine.schedule({"r1": 2 * CHUNK})
    (store,) = meta.stores
    engine.ranks[0].failing.add(store.job_id)
    engine.runner.execute(meta, new_blocks=blocks, written=blocks)
    engine.finish(r1)
    engine.runner.until_closed(store.job_id)
    assert len(engine.sched.store_pins) == 0 and engine.refs() == [0] * (NUM_BLOCKS - 1)
    assert engine.sched.manager.lookup(list(store.keys)) == 0  # a future miss


def test_stores_of_a_step_whose_metadata_never_went_out_are_closed_at_the_next_step(
        engines: Callable[..., Engine]) -> None:
    engine = engines()
    conn = object.__new__(TierCacheConnector)
    conn._scheduler, conn._worker = engine.sched, None
    engine.admit("r1", prompt(5, 2 * CHUNK))
    real = engine.sched.manager.cascade.prepare_demotions
    engine.sched.manager.cascade.prepare_demotions = lambda: (_ for _ in ()).throw(RuntimeError("test"))
    out = SchedulerOutput.make_empty()
    out.num_scheduled_tokens, out.finished_req_ids = {"r1": 2 * CHUNK}, set()
    meta = conn.build_connector_meta(out)  # raised after planning the store: the guard's empty step
    assert meta.stores == [] and engine.refs()[:4] == [2, 2, 2, 2]
    engine.sched.manager.cascade.prepare_demotions = real
    engine.schedule({})
    assert engine.refs()[:4] == [1, 1, 1, 1] and len(engine.sched.store_pins) == 0 and not engine.sched._jobs
    assert engine.sched.manager.usage()["cpu"][0] == 0  # the slots planned for it are free again


def test_no_reference_is_left_behind_after_many_steps(engines: Callable[..., Engine]) -> None:
    """Requests arrive, decode, finish or are preempted while stores copy (some held a step or two):
    every block's references are always vLLM's plus the outstanding stores', and end at zero."""
    engine = engines(world_size=2)
    rng = random.Random(0)
    running: dict[str, Request] = {}
    held: list[tuple[int, threading.Event, int]] = []  # (job id, gate, step to open it)
    for step in range(40):
        scheduled: dict[str, int] = {}
        new_blocks: list[int] = []
        for rid, req in list(running.items()):
            roll = rng.random()
            if roll < 0.3:
                engine.finish(req)
                del running[rid]
            elif roll < 0.4:
                engine.preempt(req)
                del running[rid]
            else:  # a decode step: the sampled token, then a slot for the next one
                req.append_output_token_ids(rng.randrange(1, 30000))
                got = engine.kv_mgr.allocate_slots(req, 1)
                if got is None:
                    engine.preempt(req)
                    del running[rid]
                    continue
                new_blocks += got.get_block_ids()[0]
                scheduled[rid] = 1
        n = rng.randrange(BLOCK, 5 * BLOCK)
        if engine.kv_mgr.block_pool.get_num_free_blocks() * BLOCK > n + BLOCK:
            rid = f"r{step}"
            running[rid], got_ids = engine.admit(rid, prompt(1000 + step, n))
            new_blocks += got_ids
            scheduled[rid] = n
        meta = engine.schedule(scheduled)
        for store in meta.stores:
            if rng.random() < 0.3:
                rank = engine.ranks[rng.randrange(2)]
                held.append((store.job_id, rank.hold(store.job_id), step + rng.randrange(1, 3)))
        written = [b for rid, tokens in scheduled.items()
                   for b in computed_blocks(engine, running[rid], tokens)]
        engine.runner.execute(meta, new_blocks=new_blocks, written=written)
        for rid, tokens in scheduled.items():
            running[rid].num_computed_tokens += tokens
        for job_id, gate, at in held:
            if at <= step:
                gate.set()
        expected = Counter(b for rid in running for b in engine.kv_mgr.get_block_ids(rid)[0])
        expected.update(engine.sched.store_pins.pinned())
        assert engine.refs() == [expected[b] for b in range(1, NUM_BLOCKS)], f"step {step}"
    for req in running.values():
        engine.finish(req)
    for _, gate, _ in held:
        gate.set()
    for job_id in list(engine.sched._jobs):
        engine.runner.until_closed(job_id)
    assert engine.refs() == [0] * (NUM_BLOCKS - 1) and len(engine.sched.store_pins) == 0
    assert engine.kv_mgr.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1
    assert engine.kv_mgr.reset_prefix_cache() is True
    # about 20 on an idle machine; under load copies lag, pins fill the pool and fewer stores are planned
    # (3 seen beside running engines): enough that the references above were really exercised
    assert engine.sched.take_counters()["store_jobs"] >= 2


def test_the_engine_runners_reset_retries_until_the_pins_are_released(engines: Callable[..., Engine]) -> None:
    """vLLM's reset_prefix_cache fails while a store's pins are held; the engine steps on meanwhile."""
    from tiercache.testing.engine_runner import reset_prefix_cache

    engine = engines()
    r1, blocks = engine.admit("r1", prompt(6, 2 * CHUNK))
    meta = engine.schedule({"r1": 2 * CHUNK})
    gate = engine.ranks[0].hold(meta.stores[0].job_id)
    engine.runner.execute(meta, new_blocks=blocks, written=blocks)
    engine.finish(r1)  # generate() has returned; the last store still copies
    tries: list[bool] = []

    class LLM:  # LLM.reset_prefix_cache -> Scheduler.reset_prefix_cache; the engine core steps between tries
        def reset_prefix_cache(self, reset_connector: bool = False) -> bool:
            tries.append(engine.kv_mgr.reset_prefix_cache())
            gate.set()
            engine.runner.report()
            return tries[-1]

    with pytest.raises(RuntimeError, match="returned False"):
        reset_prefix_cache(LLM(), timeout_s=0.0)  # one try, while the copy is held
    reset_prefix_cache(LLM())
    assert tries[0] is False and tries[-1] is True and len(engine.sched.store_pins) == 0
