"""Chunk keys and payload bytes for tests that drive a backend: deterministic, realistic, cheap.

Every test of a storage backend needs keys shaped like the engine's (namespace
digest | prefix hash | group) and payloads that differ per key and per
version, so that a chunk that comes back as another chunk's bytes is caught.
The conformance kit (conformance.py, conformance_shards.py), the server's tests
and the benchmarks take them from here; nothing here touches a backend.

``SENTINEL`` is the byte the kit fills a get's buffer with, to tell "left
untouched" from "written". Pure functions: any thread may call them.
"""

from __future__ import annotations

import hashlib
import random

#: The namespace of the kit's default context, and another engine's (for isolation tests).
KIT_NAMESPACE = b"kit-ns-1"
OTHER_NAMESPACE = b"kit-ns-2"
#: The byte a get's buffer is filled with before the get.
SENTINEL = 0xA5


def make_key(index: int, namespace: bytes = KIT_NAMESPACE) -> bytes:
    """A realistic chunk key: namespace digest | sha256 prefix hash | group 0."""
    prefix = hashlib.sha256(b"kit-chunk-%d" % index).digest()
    return namespace + prefix + (0).to_bytes(4, "big")


def make_payload(key: bytes, size: int, version: int = 0) -> bytes:
    """Deterministic pseudo-random bytes for ``key`` (a different ``version``, different bytes)."""
    seed = int.from_bytes(hashlib.blake2b(key + bytes([version]), digest_size=8).digest(), "big")
    return random.Random(seed).randbytes(size)
