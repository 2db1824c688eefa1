"""The LMDB tier (backends/lmdb/backend.py) against the conformance kit.

The backend is built the way the engine builds it, through
:func:`tiercache.tiers.registry.create_backend` from a tier config naming ``lmdb``,
once with one I/O thread and once with three (gets then run beside the
writer). Corruption is real on-disk damage: a payload byte of the chunk's
frame is flipped in ``data.mdb`` with plain file I/O, behind LMDB's back.
"""

from __future__ import annotations

import pathlib
from typing import Any, ClassVar

from tiercache.backends.lmdb.backend import LMDBBackend

from tiercache.backend import Backend, BackendContext
from tiercache.config.schema import TierConfig
from tiercache.integrity import FRAME_MAGIC, compact_header_len
from tiercache.tiers.registry import create_backend
from tiercache.testing.conformance import BackendConformance


def flip_payload_byte(data_file: pathlib.Path, key: bytes, offset: int = 1234) -> None:
    """Flip one payload byte of ``key``'s frame in an LMDB data file.

    The frame header holds the key at byte 40, right after the fixed header
    that starts with the magic; the key also appears in the B-tree's leaf,
    which has no magic in front of it.
    """
    raw = data_file.read_bytes()
    at = -1
    while (at := raw.find(key, at + 1)) != -1:
        start = at - 40
        if start >= 0 and raw[start : start + len(FRAME_MAGIC)] == FRAME_MAGIC:
            break
    else:
        raise AssertionError(f"no frame of {key.hex()} in {data_file}")
    where = start + compact_header_len(len(key)) + offset
    with data_file.open("r+b") as f:
        f.seek(where)
        byte = f.read(1)
        f.seek(where)
        f.write(bytes([byte[0] ^ 0xFF]))


def held_frame_bytes(backend: LMDBBackend) -> int:
    """Bytes of the frames the environment holds for this backend, summed value by value."""
    with backend._env.begin(db=backend._db, buffers=True) as txn:  # the backend's own handle
        return sum(len(value) for _, value in txn.cursor())


class TestLMDBConformance(BackendConformance):
    persistent = True
    bytes_per_chunk = LMDBBackend.footprint(BackendConformance.chunk_bytes)
    options: ClassVar[dict[str, Any]] = {}

    def make_backend(self, path: pathlib.Path, context: BackendContext) -> Backend:
        tier = TierConfig(
            name=context.tier_name,
            backend="lmdb",
            capacity=context.capacity_bytes,
            options={"path": str(path), **self.options},
        )
        backend = create_backend(tier, context)
        assert isinstance(backend, LMDBBackend)
        return backend

    def corrupt_chunk(self, backend: Backend, key: bytes) -> None:
        flip_payload_byte(self.path / "data.mdb", key)

    def used_bytes(self, backend: Backend, path: pathlib.Path) -> int:
        assert isinstance(backend, LMDBBackend)
        return held_frame_bytes(backend)

    def test_checksum_failure_is_counted(self) -> None:
        backend = self.open()
        chunks = self.chunks(0, 2)
        assert self.put(backend, chunks).ok
        bad = list(chunks)[0]
        self.corrupt_chunk(backend, bad)
        result, _ = self.get(backend, list(chunks))
        assert result.failed_keys == (bad,)
        stats = backend.stats()  # type: ignore[attr-defined]
        assert stats["checksum_failures"] == 1 and stats["get_failures"] == 1


class TestLMDBConformanceThreeThreads(TestLMDBConformance):
    options: ClassVar[dict[str, Any]] = {"io_threads": 3}
