"""Build load and store jobs the short way, for tests, benchmarks and tools that have no scheduler.

:func:`make_job` takes the parts a caller has at hand (keys, copy segments and,
for a load, the tier each chunk comes from) and returns the one job shape the
worker runs (:mod:`tiercache.jobs`).
"""

from __future__ import annotations

from collections.abc import Sequence

from tiercache.jobs import CopySegment, FromHost, FromReader, FromTier, LoadChunk, LoadJob, StoreJob, TransferJob


def make_job(job_id: int, req_id: str, direction: str, keys: Sequence[bytes], segments: Sequence[CopySegment],
             tiers: Sequence[str | None] = (), host_tier: str = "cpu") -> TransferJob:
    """A store, or a load whose chunk ``i`` comes from ``tiers[i]``.

    For a load, ``tiers[i]`` None (or ``tiers`` empty) is a host-tier chunk; a tier
    name with a slot >= 0 is staged from that lower tier through the slot; with
    slot -1 it is a direct tier's chunk, written by that tier's reader.
    """
    if direction == "store":
        return StoreJob(job_id, req_id, tuple(keys), tuple(segments))
    if direction != "load":
        raise ValueError(f"direction must be load or store, not {direction!r}")
    chunks = []
    for i, (key, seg) in enumerate(zip(keys, segments)):
        tier = tiers[i] if i < len(tiers) else None
        source: FromHost | FromTier | FromReader
        if tier is None:
            source = FromHost(host_tier, seg.slot)
        elif seg.slot < 0:
            source = FromReader(tier)
        else:
            source = FromTier(tier, seg.slot)
        chunks.append(LoadChunk(key, source, seg.first_block, seg.block_ids))
    return LoadJob(job_id, req_id, tuple(chunks))
