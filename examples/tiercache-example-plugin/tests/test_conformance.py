"""What a plugin author writes to run tiercache's conformance kit against their backend."""

from __future__ import annotations

import pathlib

from tiercache_example_plugin import ExampleMemoryBackend, ExampleMemorySettings

from tiercache.backend import Backend, BackendContext
from tiercache.integrity import compact_header_len
from tiercache.testing.conformance import BackendConformance, make_key


class TestExampleMemory(BackendConformance):
    persistent = False  # a dict does not survive its process
    bytes_per_chunk = compact_header_len(len(make_key(0))) + BackendConformance.chunk_bytes

    def make_backend(self, path: pathlib.Path, context: BackendContext) -> Backend:
        return ExampleMemoryBackend(ExampleMemorySettings(), context)

    def corrupt_chunk(self, backend: Backend, key: bytes) -> None:
        assert isinstance(backend, ExampleMemoryBackend)
        frame = bytearray(backend.frames[key])
        frame[-1] ^= 0xFF  # the last payload byte
        backend.frames[key] = bytes(frame)

    def used_bytes(self, backend: Backend, path: pathlib.Path) -> int:
        assert isinstance(backend, ExampleMemoryBackend)
        return sum(len(f) for f in backend.frames.values())
