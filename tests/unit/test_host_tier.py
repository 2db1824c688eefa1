"""Unit tests of the host tier's slab (tiercache/transfer/host_slab.py) and its slot views, and of the
keyed Backend API over a slab (tiercache/testing/memory_backend.py).

The connector addresses slots by number (through the TransferEngine); the
keyed put/get is the Backend contract (tiercache/backend.py), exercised here
with the kinds of memoryview a caller may hand over.
"""

from __future__ import annotations

import array

import numpy as np
import pytest
import torch

from tiercache.backend import Backend, JobResult
from tiercache.testing.memory_backend import MemoryBackend
from tiercache.transfer.host_slab import HostSlab, commit_pages, touch_pages

SLOT = 64


def view_of(data: bytes) -> memoryview:
    return memoryview(bytearray(data))


def result(tier: MemoryBackend) -> JobResult:
    (res,) = tier.poll()
    return res


@pytest.fixture
def host() -> HostSlab:
    return HostSlab(3, SLOT, pin_memory=False)


@pytest.fixture
def tier(host: HostSlab) -> MemoryBackend:
    return MemoryBackend(host)


# ---------------------------------------------------------------------------------- slab
def test_slab_geometry(host: HostSlab) -> None:
    assert host.slab.shape == (3, SLOT) and host.slab.dtype == torch.uint8
    assert host.capacity_bytes == 3 * SLOT
    assert not host.pinned and not host.slab.is_pinned()


def test_slot_is_a_view_of_the_slab(host: HostSlab) -> None:
    host.slab.zero_()
    slot = host.slot(1)
    assert slot.shape == (SLOT,)
    assert slot.data_ptr() == host.slab.data_ptr() + SLOT
    slot.fill_(9)
    assert host.slab[1].eq(9).all() and host.slab[0].eq(0).all() and host.slab[2].eq(0).all()


@pytest.mark.parametrize(("slots", "size"), [(0, SLOT), (2, 0), (-1, SLOT)])
def test_empty_tier_refused(slots: int, size: int) -> None:
    with pytest.raises(ValueError, match="at least one slot"):
        HostSlab(slots, size, pin_memory=False)


# ----------------------------------------------------------------------------- keyed API
def test_memory_backend_is_a_backend(tier: MemoryBackend) -> None:
    assert isinstance(tier, Backend) and tier.name == "memory"


def test_put_get_round_trip(tier: MemoryBackend) -> None:
    chunks = {b"a": bytes(range(SLOT)), b"b": bytes(range(100, 100 + SLOT))}
    tier.submit_put(1, list(chunks), [memoryview(v) for v in chunks.values()])  # read-only views
    put = result(tier)
    assert (put.job_id, put.ok_keys, put.failed_keys, put.bytes) == (1, (b"a", b"b"), (), 2 * SLOT)
    outs = [bytearray(SLOT), bytearray(SLOT)]
    tier.submit_get(2, [b"b", b"a"], [memoryview(o) for o in outs])
    got = result(tier)
    assert (got.job_id, got.ok_keys, got.failed_keys, got.bytes) == (2, (b"b", b"a"), (), 2 * SLOT)
    assert got.secs >= 0
    assert bytes(outs[0]) == chunks[b"b"] and bytes(outs[1]) == chunks[b"a"]
    assert tier.contains([b"a", b"b", b"c"]) == [True, True, False]


def test_put_result_counts(tier: MemoryBackend) -> None:
    tier.submit_put(1, [b"a"], [view_of(b"x" * 10)])
    res = result(tier)
    assert (res.ok_keys, res.failed_keys, res.bytes, res.ok) == ((b"a",), (), 10, True)


def test_views_of_any_format_are_bytes(tier: MemoryBackend) -> None:
    """A memoryview's len() counts items, not bytes: a 16-int view is 64 bytes."""
    ints = array.array("i", range(16))
    assert ints.itemsize * len(ints) == SLOT
    tier.submit_put(1, [b"ints"], [memoryview(ints)])
    assert result(tier).bytes == SLOT
    back = array.array("i", [0] * 16)
    tier.submit_get(2, [b"ints"], [memoryview(back)])
    assert result(tier).ok and list(back) == list(range(16))
    too_big = array.array("i", range(20))  # 80 bytes, len() 20
    tier.submit_put(3, [b"big"], [memoryview(too_big)])
    assert result(tier).failed_keys == (b"big",)


def test_full_tier_fails_the_extra_keys(tier: MemoryBackend) -> None:
    keys = [b"k%d" % i for i in range(5)]
    tier.submit_put(1, keys, [view_of(bytes([i]) * SLOT) for i in range(5)])
    res = result(tier)
    assert res.ok_keys == tuple(keys[:3]) and res.failed_keys == tuple(keys[3:])
    assert res.bytes == 3 * SLOT and not res.ok
    assert tier.contains(keys) == [True, True, True, False, False]


def test_put_again_overwrites_in_place(tier: MemoryBackend) -> None:
    tier.submit_put(1, [b"a", b"b", b"c"], [view_of(b"1" * SLOT)] * 3)
    tier.poll()
    tier.submit_put(2, [b"a"], [view_of(b"2" * SLOT)])  # tier full, but the key has a slot
    assert result(tier).ok
    out = bytearray(SLOT)
    tier.submit_get(3, [b"a"], [memoryview(out)])
    assert result(tier).ok and bytes(out) == b"2" * SLOT


def test_delete_frees_the_slot(tier: MemoryBackend) -> None:
    tier.submit_put(1, [b"a", b"b", b"c"], [view_of(b"z" * SLOT)] * 3)
    tier.poll()
    tier.delete([b"b", b"never-stored"])
    assert tier.contains([b"a", b"b", b"c"]) == [True, False, True]
    tier.submit_get(2, [b"b"], [memoryview(bytearray(SLOT))])
    assert result(tier).failed_keys == (b"b",)
    tier.submit_put(3, [b"d"], [view_of(b"d" * SLOT)])
    assert result(tier).ok


def test_get_of_a_missing_key_fails_it(tier: MemoryBackend) -> None:
    out = bytearray(b"\xff" * SLOT)
    tier.submit_get(1, [b"nope"], [memoryview(out)])
    res = result(tier)
    assert (res.job_id, res.ok_keys, res.failed_keys, res.bytes, res.ok) == (
        1,
        (),
        (b"nope",),
        0,
        False,
    )
    assert out == bytearray(b"\xff" * SLOT)


def test_unusable_views_fail_their_key_only(tier: MemoryBackend) -> None:
    tier.submit_put(1, [b"a"], [view_of(b"a" * SLOT)])
    tier.poll()
    read_only = memoryview(bytes(SLOT))  # a get must not write into an immutable bytes object
    strided = memoryview(bytearray(2 * SLOT))[::2]
    oversized = memoryview(bytearray(SLOT + 1))
    good = bytearray(SLOT)
    tier.submit_get(2, [b"a", b"a", b"a", b"a"], [read_only, strided, oversized, memoryview(good)])
    res = result(tier)
    assert res.failed_keys == (b"a", b"a", b"a") and res.ok_keys == (b"a",)
    assert bytes(read_only) == bytes(SLOT) and bytes(good) == b"a" * SLOT
    tier.submit_put(3, [b"s", b"o"], [strided, oversized])
    assert result(tier).failed_keys == (b"s", b"o")
    assert tier.contains([b"s", b"o"]) == [False, False]  # no slot leaked


def test_short_views_move_their_length(tier: MemoryBackend) -> None:
    tier.submit_put(1, [b"a"], [view_of(b"abc")])
    assert result(tier).bytes == 3
    out = bytearray(2)
    tier.submit_get(2, [b"a"], [memoryview(out)])
    assert result(tier).bytes == 2 and bytes(out) == b"ab"
    tier.submit_put(3, [b"e"], [memoryview(b"")])
    assert result(tier).ok


def test_poll_drains(tier: MemoryBackend) -> None:
    assert tier.poll() == []
    for job_id in range(1, 4):
        tier.submit_put(job_id, [b"k%d" % job_id], [view_of(b"x")])
    assert [r.job_id for r in tier.poll()] == [1, 2, 3]
    assert tier.poll() == []


def test_close_forgets_keys(tier: MemoryBackend) -> None:
    tier.submit_put(1, [b"a"], [view_of(b"x")])
    tier.close()
    assert tier.poll() == [] and tier.contains([b"a"]) == [False]
    assert list(tier.recover()) == []


def _resident_bytes() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * 4096


@pytest.mark.parametrize("commit", [commit_pages, touch_pages], ids=["madvise", "touch"])
def test_committing_pages_makes_a_fresh_buffer_resident(commit) -> None:  # type: ignore[no-untyped-def]
    size = 64 << 20
    buf = np.empty(size + 100, dtype=np.uint8)[100:]  # not page aligned either
    before = _resident_bytes()
    commit(buf)
    assert _resident_bytes() - before >= size - (4 << 20)
    assert not buf.any()  # fresh memory reads as zeros, before and after


def test_prefaulted_slab_is_resident_at_start_up_and_a_lazy_one_is_not() -> None:
    before = _resident_bytes()
    lazy = HostSlab(64, 1 << 20)
    assert not lazy.prefaulted and _resident_bytes() - before < (16 << 20)
    before = _resident_bytes()
    eager = HostSlab(64, 1 << 20, prefault=True)
    assert eager.prefaulted and _resident_bytes() - before >= (60 << 20)
