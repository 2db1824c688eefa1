"""The LMDB tier's frames (backends/lmdb/frames.py): verified while copied, in one read.

A get copies a frame's payload into the caller's buffer while it checksums it
(:class:`tiercache.integrity.FrameDigest`), so the buffer is written before the
verdict. What must hold, and is checked here: the frames are the on-disk format
of :func:`tiercache.integrity.encode_frame` byte for byte (old environments
still verify); an intact frame loads byte-identical, whichever path (one copy,
or pieces) and however the payload splits into pieces; damage anywhere (first
piece, last piece, a header field only the checksum covers) is CORRUPT, never
OK, and leaves the buffer zeroed; a wrong header is refused before the buffer
is touched; a buffer of the wrong length is never written (WRONG_SIZE if the
frame is intact, CORRUPT if not). End to end, a corrupt LMDB frame fails the
load, its blocks are not written, and the manager frees the staging slot
instead of making the chunk READY: unverified bytes never reach vLLM.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Iterator
from itertools import pairwise

import numpy as np
import pytest
import torch
from tiercache.backends.lmdb.backend import LMDBBackend, LMDBSettings
from tiercache.backends.lmdb.frames import PIECE_BYTES, Framer, Load

from tiercache import integrity
from tiercache.backend import BackendContext, JobResult
from tiercache.manager.offloading import OffloadingManager, TierSpec
from tiercache.mac import MacKey
from tiercache.testing.pipeline_rig import SLOTS, TIER, PipelineRig
from tiercache.testing.pipeline_rig import rig_key
from tiercache.transfer.device import CopySegment

NS = b"frame-ns"
KEY = NS + b"\x11" * 32 + bytes(4)
PIECE = 4096  # small pieces, so that small payloads take the piece path too
SENTINEL = 0xA5
HEADER = integrity.compact_header_len(len(KEY))


def payload(size: int, seed: int = 0) -> bytes:
    return np.random.default_rng([seed, size]).bytes(size)


def load(framer: Framer, frame: bytes, size: int, key: bytes = KEY) -> tuple[Load, bytes]:
    out = bytearray([SENTINEL]) * size
    return framer.unframe(key, memoryview(frame), memoryview(out)), bytes(out)


# Sizes: one copy (<= half a piece), exactly one piece, pieces with a short last one, many.
SIZES = (1, PIECE // 2, PIECE, 3 * PIECE + 17, 16 * PIECE)


@pytest.mark.parametrize("size", SIZES)
def test_frames_are_the_integrity_format_and_load_byte_identical(size: int) -> None:
    framer = Framer(NS, size, piece_bytes=PIECE)
    data = payload(size)
    frame = bytes(framer.frame(KEY, memoryview(data)))
    assert frame == integrity.encode_frame(NS, KEY, data)  # the on-disk format did not change
    status, got = load(framer, frame, size)
    assert status is Load.OK and got == data


def test_frames_written_before_the_change_still_verify() -> None:
    """A value as the earlier code wrote it (header packed over the whole payload)."""
    data = payload(5 * PIECE + 3)
    header = integrity.frame_header(NS, KEY, data)
    status, got = load(Framer(NS, len(data), piece_bytes=PIECE), bytes(header) + data, len(data))
    assert status is Load.OK and got == data


@pytest.mark.parametrize("size", SIZES[1:])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_damaged_payload_is_corrupt_and_the_buffer_zeroed(size: int, where: str) -> None:
    framer = Framer(NS, size, piece_bytes=PIECE)
    frame = bytearray(framer.frame(KEY, memoryview(payload(size))))
    at = {"first": 0, "middle": size // 2, "last": size - 1}[where]
    frame[HEADER + at] ^= 0x40
    status, got = load(framer, bytes(frame), size)
    assert status is Load.CORRUPT
    assert got == bytes(size)  # what was copied before the verdict is gone


@pytest.mark.parametrize(
    ("offset", "checked_before_copying"),
    [
        (0, True),  # magic
        (4, True),  # version
        (6, False),  # flags: not checked on their own, covered by the checksum
        (8, False),  # the checksum field itself
        (16, True),  # namespace
        (24, True),  # payload length
        (36, False),  # reserved: covered by the checksum
        (40, True),  # the key
    ],
)
def test_damaged_header_is_corrupt(offset: int, checked_before_copying: bool) -> None:
    size = 5 * PIECE
    framer = Framer(NS, size, piece_bytes=PIECE)
    frame = bytearray(framer.frame(KEY, memoryview(payload(size))))
    frame[offset] ^= 0x01
    status, got = load(framer, bytes(frame), size)
    assert status is Load.CORRUPT
    assert got == (bytes([SENTINEL]) * size if checked_before_copying else bytes(size))


@pytest.mark.parametrize("delta", [-1, 1, PIECE])
def test_wrong_size_buffer_is_never_written(delta: int) -> None:
    size = 3 * PIECE
    framer = Framer(NS, size, piece_bytes=PIECE)
    frame = bytearray(framer.frame(KEY, memoryview(payload(size))))
    status, got = load(framer, bytes(frame), size + delta)
    assert status is Load.WRONG_SIZE and got == bytes([SENTINEL]) * (size + delta)
    frame[HEADER + size - 1] ^= 0x01  # damaged and the wrong size: corrupt, as before
    status, got = load(framer, bytes(frame), size + delta)
    assert status is Load.CORRUPT and got == bytes([SENTINEL]) * (size + delta)


def test_foreign_and_short_values_are_corrupt_before_copying() -> None:
    size = 2 * PIECE
    framer = Framer(NS, size, piece_bytes=PIECE)
    frame = bytes(framer.frame(KEY, memoryview(payload(size))))
    other = NS + b"\x22" * 32 + bytes(4)
    assert load(framer, frame, size, key=other) == (Load.CORRUPT, bytes([SENTINEL]) * size)
    assert load(Framer(b"other-ns", size), frame, size)[0] is Load.CORRUPT
    assert load(framer, frame[:HEADER - 1], size)[0] is Load.CORRUPT


@pytest.mark.parametrize("mac", [None, MacKey("a tenant secret for the streaming test")])
@pytest.mark.parametrize("cuts", [(), (1,), (7, 4096, 4097), (100, 200, 300, 9000)])
def test_streaming_digest_is_the_frame_checksum(mac: MacKey | None, cuts: tuple[int, ...]) -> None:
    data = payload(10_000)
    header = integrity.frame_header(NS, KEY, data, mac=mac)
    digest = integrity.FrameDigest(header, len(KEY), mac=mac)
    bounds = (0, *cuts, len(data))
    for a, b in pairwise(bounds):
        digest.update(memoryview(data)[a:b])
    assert digest.value() == integrity.frame_checksum(header, len(KEY), data, mac=mac)
    assert digest.value() == int.from_bytes(header[8:16], "little")


# ------------------------------------------------------------------------ the real tier
def test_backend_pieces_path_round_trips_and_fails_corrupt_frames(tmp_path: pathlib.Path) -> None:
    """Chunks larger than a piece: the real piece size, through submit/poll."""
    chunk = 2 * PIECE_BYTES + 12_345
    ctx = BackendContext("lmdb", NS, chunk, 4 * LMDBBackend.footprint(chunk))
    tier = LMDBBackend(LMDBSettings(path=tmp_path / "env"), ctx)
    try:
        keys = [NS + bytes([i]) * 32 + bytes(4) for i in range(3)]
        data = [payload(chunk, i) for i in range(3)]
        tier.submit_put(1, keys, [memoryview(d) for d in data])
        assert _wait(tier, 1).ok
        with tier._env.begin(db=tier._db, write=True) as txn:  # damage behind its back
            for k, at in ((keys[0], HEADER), (keys[1], HEADER + chunk - 1)):
                value = bytearray(txn.get(k))
                value[at] ^= 0x80
                txn.put(k, bytes(value))
        bufs = [bytearray([SENTINEL]) * chunk for _ in keys]
        tier.submit_get(2, keys, [memoryview(b) for b in bufs])
        result = _wait(tier, 2)
        assert result.ok_keys == (keys[2],) and result.failed_keys == (keys[0], keys[1])
        assert bytes(bufs[2]) == data[2]
        assert bytes(bufs[0]) == bytes(bufs[1]) == bytes(chunk)
        assert tier.stats()["checksum_failures"] == 2
    finally:
        tier.close()


def _wait(tier: LMDBBackend, job: int) -> JobResult:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for result in tier.poll():
            if result.job_id == job:
                return result
        time.sleep(0.001)
    raise TimeoutError(f"job {job} not reported")


@pytest.fixture
def rig(tmp_path: pathlib.Path) -> Iterator[PipelineRig]:
    r = PipelineRig(lambda ctx: LMDBBackend(LMDBSettings(path=tmp_path / "lmdb"), ctx), 10.0, 10.0)
    yield r
    r.close()


def test_a_corrupt_frame_never_reaches_the_blocks_nor_the_host_tier(rig: PipelineRig) -> None:
    manager = OffloadingManager([TierSpec("cpu", SLOTS), TierSpec(TIER, 64, shared=True)])
    k = rig_key(1)
    (slot,) = manager.prepare_store([k]).slots  # type: ignore[union-attr]
    assert rig.store_and_demote(k, slot, (3, 4)).ok
    manager.complete_store([k])
    (plan,) = manager.cascade.prepare_demotions()
    manager.cascade.complete_demotion(TIER, plan.keys)
    manager.reset()  # the host copy goes; the LMDB tier keeps the chunk
    backend = rig.backend
    assert isinstance(backend, LMDBBackend)
    with backend._env.begin(db=backend._db, write=True) as txn:
        value = bytearray(txn.get(k))
        value[-1] ^= 0x01  # the payload's last byte: found only after the whole copy
        txn.put(k, bytes(value))
    rig.reports()

    load_plan = manager.prepare_load([k])
    assert load_plan.staged == (True,)
    staging = load_plan.slots[0]
    rig.mark([9, 10])
    job, _, res = rig.load(load_plan.keys, (CopySegment(staging, 0, (9, 10)),), (TIER,))
    assert res.failed_keys == (k,) and res.ok_keys == ()  # vLLM recomputes the chunk
    assert rig.marked([9, 10])  # no byte of it went into the engine's blocks
    assert torch.count_nonzero(rig.slot(staging)) == 0  # the staging slot was zeroed
    (report,) = [r for r in rig.reports().values() if r.job_id == job]
    manager.complete_load(load_plan.keys, failed=report.failed_keys)
    assert manager.state_of(k, "cpu") is None  # never READY in the host tier ...
    assert staging in manager.host.free_slots  # ... its slot is free for another chunk
