"""The jobs the scheduler hands the worker each step: one shape per kind, from the plan to the copier.

A **load** is a :class:`LoadJob`: a list of :class:`LoadChunk`, each naming
one chunk key, its destination (the engine blocks it fills, from position
``first_block`` of the chunk on) and exactly one source:

* :class:`FromHost`: the chunk sits in host slot ``slot``; the copier copies it;
* :class:`FromTier`: the chunk sits in lower tier ``tier``; it is first read
  into host slot ``slot`` (reserved as staging by the manager), then copied,
  in the same job (tiercache.transfer.pipeline);
* :class:`FromReader`: a *direct* tier's reader (a P/D producer, read over
  NIXL) writes the chunk straight into its blocks; ``where`` is that reader's
  own address of the chunk (a :class:`tiercache.pd.peer_tier.PeerChunk`),
  opaque to everyone else.

The same job object travels scheduler -> worker -> pipeline -> copier; no
stage rebuilds it from parallel tuples. A **store** (:class:`StoreJob`)
copies engine blocks into host slots; a **demotion** (:class:`DemoteJob`)
copies host slots down into one lower tier. Every job has an id of its own,
unique in its engine whatever its kind, and ends as exactly one
:class:`~tiercache.backend.JobResult`.

Plain frozen data, cheap to pickle across vLLM's process boundary; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union


@dataclass(frozen=True, slots=True)
class CopySegment:
    """Host slot ``slot``, from chunk position ``first_block`` on <-> engine blocks ``block_ids``.

    A chunk of ``blocks_per_chunk`` blocks sits in its slot block after block;
    a load that starts mid-chunk (the engine computed its first blocks itself)
    fills only positions ``first_block`` onwards.
    """

    slot: int
    first_block: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class FromHost:
    """In the host tier (``tier``), at host slot ``slot``."""

    tier: str
    slot: int


@dataclass(frozen=True, slots=True)
class FromTier:
    """In lower tier ``tier``; staged through host slot ``slot`` on its way to the blocks."""

    tier: str
    slot: int


@dataclass(frozen=True, slots=True)
class FromReader:
    """In direct tier ``tier``, whose reader writes it into the blocks; ``where``: the reader's address."""

    tier: str
    where: Any = None


ChunkSource = Union[FromHost, FromTier, FromReader]


@dataclass(frozen=True, slots=True)
class LoadChunk:
    """One chunk of a load: ``key`` from ``source`` into ``block_ids`` (from chunk position ``first_block``).

    ``more``: the chunk's other runs of blocks, ``(first_block, block_ids)`` each: a model with
    several KV-cache groups keeps group ``g``'s blocks at chunk positions ``g * bpc ..``, and a
    sliding-window group loads only the blocks vLLM allocated (connector/kv_groups.py).
    """

    key: bytes
    source: ChunkSource
    first_block: int
    block_ids: tuple[int, ...]
    more: tuple[tuple[int, tuple[int, ...]], ...] = ()

    def segment(self) -> CopySegment:
        """Where the copier moves its first run (slot -1 for a reader's chunk: no host slot)."""
        return CopySegment(self._slot(), self.first_block, self.block_ids)

    def segments(self) -> tuple[CopySegment, ...]:
        """Every run of the chunk, the first one first."""
        slot = self._slot()
        return (CopySegment(slot, self.first_block, self.block_ids),
                *(CopySegment(slot, first, ids) for first, ids in self.more))

    def all_block_ids(self) -> tuple[int, ...]:
        return self.block_ids + tuple(b for _, ids in self.more for b in ids)

    def _slot(self) -> int:
        return -1 if isinstance(self.source, FromReader) else self.source.slot


@dataclass(frozen=True, slots=True)
class LoadJob:
    """Load ``chunks`` into the engine's blocks for request ``req_id``."""

    job_id: int
    req_id: str
    chunks: tuple[LoadChunk, ...]

    @property
    def keys(self) -> tuple[bytes, ...]:
        return tuple(c.key for c in self.chunks)

    def block_ids(self) -> list[int]:
        return [b for c in self.chunks for b in c.all_block_ids()]

    @property
    def segments(self) -> tuple[CopySegment, ...]:
        return tuple(seg for c in self.chunks for seg in c.segments())

    def staging(self) -> tuple[str | None, ...]:
        """Per chunk: the tier read before the copy (staged, or a reader's), None for a host-tier chunk."""
        return tuple(None if isinstance(c.source, FromHost) else c.source.tier for c in self.chunks)

    def reader_sources(self) -> dict[bytes, Any]:
        """The readers' addresses of this job's direct-tier chunks, by key."""
        return {c.key: c.source.where for c in self.chunks if isinstance(c.source, FromReader)}

    def only(self, keep: set[bytes]) -> LoadJob:
        """The same job with only the chunks whose key is in ``keep``."""
        return LoadJob(self.job_id, self.req_id, tuple(c for c in self.chunks if c.key in keep))


@dataclass(frozen=True, slots=True)
class StoreJob:
    """Copy engine blocks into host slots for ``keys``: ``segments`` are their runs of blocks.

    With one KV-cache group ``segments[i]`` is ``keys[i]``'s (its blocks fill its slot from
    position 0; a prompt's tail, its partial last chunk, may have fewer blocks). A hybrid
    model's chunk has one run per group and per run of allocated blocks (connector/kv_groups.py),
    so several segments share a slot; P/D (one segment per key) refuses hybrid models.
    """

    job_id: int
    req_id: str
    keys: tuple[bytes, ...]
    segments: tuple[CopySegment, ...]

    def block_ids(self) -> list[int]:
        return [b for seg in self.segments for b in seg.block_ids]

    def slots(self) -> list[int]:
        """The slot of each key, in ``keys`` order: a key's segments are consecutive and keys
        never share a slot, so each change of slot along ``segments`` starts the next key."""
        out: list[int] = []
        for seg in self.segments:
            if not out or seg.slot != out[-1]:
                out.append(seg.slot)
        return out


@dataclass(frozen=True, slots=True)
class DemoteJob:
    """Copy host slots ``host_slots[i]`` into lower tier ``tier`` under ``keys[i]``."""

    job_id: int
    tier: str
    keys: tuple[bytes, ...]
    host_slots: tuple[int, ...]


TransferJob = Union[LoadJob, StoreJob]
