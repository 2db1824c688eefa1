"""The backend contract every tier plugin implements (docs/plugins.md).

A backend moves whole chunks between host memory it is handed (views into the
engine's pinned slab, owned by the engine) and its medium. It never keeps a
view after reporting the job that used it. Jobs are submitted without
blocking and polled for completion; every job ends as exactly one
:class:`JobResult`, failures included (a failure is data, not an exception).

Threading: ``submit_*``, ``poll``, ``contains``, ``delete`` and ``close`` are
called from one thread (the owner's); a backend may run its I/O on threads of
its own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from pydantic import BaseModel, ConfigDict


@dataclass(frozen=True, slots=True)
class JobResult:
    """How one job ended: which keys made it, which did not, bytes moved, seconds taken."""

    job_id: int
    ok_keys: tuple[bytes, ...]
    failed_keys: tuple[bytes, ...]
    bytes: int
    secs: float

    @property
    def ok(self) -> bool:
        return not self.failed_keys


class BackendSettings(BaseModel):
    """Base of every backend's settings model (a tier's ``options`` in YAML)."""

    # hide_input_in_errors: options may hold secrets (tokens, passwords, MAC keys).
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)


@dataclass(frozen=True)
class BackendContext:
    """What the engine tells a backend about the chunks it will hold.

    ``namespace`` is the 8-byte namespace digest (keys start with it too); a
    medium shared between engines must keep namespaces apart (a directory per
    namespace, a key prefix, ...). Every value is exactly ``chunk_bytes`` long:
    a *store shard*, one KV head's bytes of a chunk, keyed by head, not by TP
    rank (tiercache/shards.py; the engine wraps every backend to cut and join
    them, so a backend never keeps ranks apart itself).
    The manager keeps the tier inside ``capacity_bytes`` by evicting (and then
    calling :meth:`Backend.delete`); a backend must still refuse (fail) a put
    that would take it past its budget, never exceed it.
    """

    tier_name: str
    namespace: bytes
    chunk_bytes: int
    capacity_bytes: int
    rank: int = 0
    world_size: int = 1


class Backend(ABC):
    """A storage medium for fixed-size chunks, addressed by key."""

    name: ClassVar[str]
    settings_model: ClassVar[type[BaseModel]] = BackendSettings
    # True for media other engines write too (Redis, the cache server): such a tier
    # is looked up with ``contains`` (asynchronously) instead of being owned.
    shared: ClassVar[bool] = False
    # True for media that frame every chunk and verify it on load (tiercache.integrity), as the
    # built-in lower tiers do. Otherwise the worker checks each loaded chunk against the digest
    # of what it wrote itself (tiercache/tiers/chunk_digests.py).
    verifies_integrity: ClassVar[bool] = False

    # Plugins are constructed as ``cls(settings, context)`` by tiercache.tiers.registry;
    # ``settings`` is an instance of ``settings_model`` built from the tier's options.

    @classmethod
    def footprint(cls, chunk_bytes: int) -> int:
        """Bytes one chunk takes on the medium (framing, padding); sizes the tier's slot count."""
        return chunk_bytes + 4096

    @abstractmethod
    def submit_put(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        """Start writing ``views[i]`` under ``keys[i]``; report through :meth:`poll`."""

    @abstractmethod
    def submit_get(self, job_id: int, keys: Sequence[bytes], views: Sequence[memoryview]) -> None:
        """Start reading ``keys[i]`` into ``views[i]``; report through :meth:`poll`.

        Ownership of the destination: ``views[i]`` (a host-tier staging slot, or a
        bounce buffer) belongs to the backend from this call until :meth:`poll` has
        returned the job's result, and its bytes mean something only if ``keys[i]``
        is among that result's ``ok_keys``. A backend may write a view before it has
        verified what it wrote (the LMDB tier checksums a chunk while copying it);
        for a failed key the view may hold anything, and the caller never exposes
        it: the pipeline leaves the chunk out of the device copy, TierIO scatters
        only ok keys out of bounce buffers, and the manager's ``complete_load`` frees
        a failed chunk's staging slot instead of making it READY (the conformance
        kit still asks a backend to leave a failed view untouched or zeroed, so that
        no stale chunk survives in it).
        """

    @abstractmethod
    def poll(self) -> list[JobResult]:
        """Results of jobs finished since the last call (never blocks)."""

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys the medium holds (shared tiers only; local tiers are in the manager)."""
        raise NotImplementedError(f"{self.name} is not a shared tier")

    @abstractmethod
    def delete(self, keys: Sequence[bytes]) -> None: ...

    def recover(self) -> Iterable[bytes]:
        """Keys still valid after a restart (persistent media); none by default.

        Must not read chunk bodies: time proportional to the chunk count. The
        scheduler opens the backend once at start-up to rebuild its directory.
        """
        return ()

    @abstractmethod
    def close(self) -> None: ...
