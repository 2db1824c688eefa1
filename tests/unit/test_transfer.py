"""Unit tests of the TransferEngine (tiercache/transfer/engine.py) on CPU-resident KV caches.

Job specs in, one JobResult per job out: keys, bytes and seconds on success,
every key failed on a failure; and the fault injection that the end-to-end
correctness tests rely on (``fail_loads``, ``corrupt_loads``) acting on the
real path.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from tiercache.jobs import TransferJob
from tiercache.testing.job_builders import make_job
from tiercache.transfer.host_slab import HostSlab

from tiercache.backend import JobResult
from tiercache.config.schema import FaultConfig
from tiercache.transfer.device import CopySegment, Direction
from tiercache.transfer.host_copier import HostThreadCopier
from tiercache.layout import KVBlockLayout
from tiercache.transfer.engine import TransferEngine

NUM_BLOCKS = 32
BPC = 2
SLOTS = 6


def make_kvs(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"layer.{i}": torch.randn(2, NUM_BLOCKS, 4, 2, 16, generator=gen) for i in range(2)}


def block(kvs: dict[str, torch.Tensor], block_id: int) -> list[torch.Tensor]:
    return [t[:, block_id].clone() for t in kvs.values()]


def spec(job_id: int, direction: Direction, chunks: dict[int, tuple[int, ...]]) -> TransferJob:
    """A job moving chunk ``slot -> block ids`` for each item; keys are b'k<slot>'."""
    keys = tuple(b"k%d" % slot for slot in chunks)
    segs = tuple(CopySegment(slot, 0, ids) for slot, ids in chunks.items())
    return make_job(job_id, f"req-{job_id}", direction, keys, segs)


@pytest.fixture
def kvs() -> dict[str, torch.Tensor]:
    return make_kvs()


@pytest.fixture
def layout(kvs: dict[str, torch.Tensor]) -> KVBlockLayout:
    return KVBlockLayout.from_kv_caches(kvs, NUM_BLOCKS)


@pytest.fixture
def engines() -> Iterator[list[TransferEngine]]:
    made: list[TransferEngine] = []
    yield made
    for engine in made:
        engine.shutdown()


def new_engine(
    layout: KVBlockLayout, engines: list, faults: FaultConfig | None = None
) -> TransferEngine:
    engine = TransferEngine(layout, BPC, SLOTS, faults=faults)
    engines.append(engine)
    return engine


STORE = {0: (3, 4), 1: (10, 20), 2: (31, 0)}


def test_store_and_load_results(kvs: dict, layout: KVBlockLayout, engines: list) -> None:
    engine = new_engine(layout, engines)
    assert isinstance(engine.copier, HostThreadCopier)
    assert engine.host.slot_bytes == layout.slot_bytes(BPC)
    engine.submit(spec(1, "store", STORE))
    (stored,) = engine.wait_all()
    assert stored == JobResult(
        1, (b"k0", b"k1", b"k2"), (), 3 * layout.slot_bytes(BPC), stored.secs
    )
    assert stored.ok and stored.secs >= 0

    want = {b: block(kvs, b) for ids in STORE.values() for b in ids}
    for t in kvs.values():
        t.zero_()
    engine.submit(spec(2, "load", {1: (5, 6), 2: (7, 8)}))
    (loaded,) = engine.wait_all()
    assert loaded.ok_keys == (b"k1", b"k2") and loaded.failed_keys == ()
    assert loaded.bytes == 2 * layout.slot_bytes(BPC)
    for got_block, want_block in ((5, 10), (6, 20), (7, 31), (8, 0)):
        assert all(torch.equal(g, w) for g, w in zip(block(kvs, got_block), want[want_block]))
    assert float(sum(t[:, 3].abs().sum() for t in kvs.values())) == 0.0  # not loaded


def test_poll_collects_without_blocking(layout: KVBlockLayout, engines: list) -> None:
    engine = new_engine(layout, engines)
    for job_id, slot in enumerate(range(SLOTS), start=1):
        engine.submit(spec(job_id, "store", {slot: (2 * slot, 2 * slot + 1)}))
    results = engine.wait_all()  # every store, in submission order
    assert [r.job_id for r in results] == list(range(1, SLOTS + 1))
    assert all(r.ok for r in results)
    assert engine.poll() == [] and engine.wait_all() == []


def test_fail_loads_fails_every_key_and_copies_nothing(
    kvs: dict, layout: KVBlockLayout, engines: list
) -> None:
    engine = new_engine(layout, engines, FaultConfig(fail_loads=True))
    engine.submit(spec(1, "store", STORE))
    (stored,) = engine.wait_all()
    assert stored.ok and stored.bytes == 3 * layout.slot_bytes(BPC)  # stores unaffected
    for t in kvs.values():
        t.fill_(7.0)
    engine.submit(spec(2, "load", {0: (1, 2), 1: (5, 6)}))
    (failed,) = engine.poll()  # reported at once, no copy submitted
    assert failed == JobResult(2, (), (b"k0", b"k1"), 0, 0.0)
    assert not failed.ok
    assert all(bool((t == 7.0).all()) for t in kvs.values())


def test_corrupt_loads_zeroes_exactly_the_loaded_blocks(
    kvs: dict, layout: KVBlockLayout, engines: list
) -> None:
    engine = new_engine(layout, engines, FaultConfig(corrupt_loads=True))
    engine.submit(spec(1, "store", STORE))
    assert engine.wait_all()[0].ok
    before = {b: block(kvs, b) for b in range(NUM_BLOCKS)}
    engine.submit(spec(2, "load", {0: (9, 11), 2: (12, 13)}))
    (loaded,) = engine.wait_all()
    assert loaded.ok  # a corrupted load looks successful: that is the point
    for b in range(NUM_BLOCKS):
        got = block(kvs, b)
        if b in (9, 11, 12, 13):
            assert all(float(g.abs().sum()) == 0.0 for g in got), b
        else:
            assert all(torch.equal(g, w) for g, w in zip(got, before[b])), b


def test_failed_copy_fails_every_key_of_the_job(layout: KVBlockLayout, engines: list) -> None:
    engine = new_engine(layout, engines)
    engine.submit(spec(1, "store", {0: (1, 2), SLOTS: (3, 4)}))  # second slot does not exist
    engine.submit(spec(2, "store", {1: (1, 2)}))
    bad, good = engine.wait_all()
    assert bad == JobResult(1, (), (b"k0", b"k%d" % SLOTS), 0, bad.secs)
    assert good.ok


def test_slot_size_mismatch_raises(layout: KVBlockLayout) -> None:
    host = HostSlab(SLOTS, layout.slot_bytes(BPC) + 64, pin_memory=False)
    with pytest.raises(ValueError, match="slot"):
        TransferEngine(layout, BPC, SLOTS, host=host)


def test_given_host_tier_is_used(layout: KVBlockLayout, engines: list) -> None:
    host = HostSlab(3, layout.slot_bytes(BPC), pin_memory=False)
    host.slab.zero_()  # the slab is allocated, not initialised
    engine = TransferEngine(layout, BPC, 3, host=host, copy_threads=1)
    engines.append(engine)
    assert engine.host is host
    engine.submit(spec(1, "store", {2: (0, 1)}))
    assert engine.wait_all()[0].ok
    assert int(host.slot(2).count_nonzero()) > 0 and int(host.slot(0).count_nonzero()) == 0


def test_job_spec_block_ids() -> None:
    job = spec(1, "load", {0: (4, 5), 3: (9,)})
    assert job.block_ids() == [4, 5, 9]
