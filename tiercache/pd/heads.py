"""P/D between engines of different TP sizes: which producer rank holds which of our KV heads.

A hand-off between a producer of TP size ``Tp`` and a consumer of TP size
``Tc`` (one divides the other) moves KV heads, not pages: consumer rank ``r``
holds the global heads :func:`tiercache.shards.global_heads` gives it, and
reads each from the producer rank holding it, as vLLM's NixlConnector does
with its ``tp_ratio`` head-split reads.

That needs *head-major* pages on both sides: every region's page is
``heads x inner`` bytes (``outer == 1`` in tiercache.shards' terms: vLLM 0.32
on CPU registers ``[blocks, heads, tokens, 2 * head_size]``), so one head of a
page is one contiguous sub-run (offset ``head * inner``, ``inner`` bytes), the
same ``inner`` whatever the TP size. Other layouts (token-major pages, where a
head's bytes are strided) are refused with a one-line reason: the decode
engine recomputes, never reads wrong bytes.

Limits: the ratio must be an integer; a producer whose TP size exceeds the
head count (replicated heads on the producer side) with a consumer of another
TP size is refused (some of its ranks would never be read, so their holds
would only expire); a consumer with replicated heads (``Tc > heads``) is
supported: several of its ranks read the same producer rank, which waits for
each of their read notices.

Pure data and numpy: no NIXL, no vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tiercache.shards import ShardError, outer_heads_inner, global_heads

#: Test hook: the consumer reads another head's sub-run (negative control of the hetero-TP tests).
WRONG_HEAD_ENV = "TIERCACHE_TEST_PD_WRONG_HEAD"

# fingerprint fields that differ between engines of different TP sizes (their keys do not:
# tiercache.keys.Namespace.digest drops them when the global KV-head count is known)
TP_FIELDS = ("tp_size", "bytes_per_chunk")


@dataclass(frozen=True)
class PageHeads:
    """One worker's pages seen by KV head: its global heads and, per region, one head's bytes."""

    total: int  # global KV heads
    tp_size: int
    rank: int
    inner: tuple[int, ...]  # per region: one head's bytes of a page (head-major pages); () if not
    why: str = ""  # why the pages are not head-major (hetero-TP hand-offs are refused)

    @property
    def heads(self) -> tuple[int, ...]:
        return global_heads(self.total, self.tp_size, self.rank)

    @property
    def head_major(self) -> bool:
        return bool(self.inner) and not self.why

    def to_wire(self) -> dict[str, Any]:
        return {"total": self.total, "tp_size": self.tp_size, "rank": self.rank, "inner": list(self.inner),
                "why": self.why}

    @classmethod
    def from_wire(cls, d: Any) -> PageHeads:
        if not isinstance(d, dict):
            raise TypeError("page heads: not a map")
        try:
            return cls(int(d["total"]), int(d["tp_size"]), int(d["rank"]), tuple(int(x) for x in d["inner"]),
                       str(d.get("why", "")))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed page heads: {exc!r}") from exc


def page_heads_from_maps(head_maps: Sequence[np.ndarray], total: int, tp_size: int, rank: int,
                         local_heads: int) -> PageHeads:
    """:class:`PageHeads` from each region's byte-to-head map (:func:`tiercache.layout.region_head_maps`)."""
    inner: list[int] = []
    for r, head_map in enumerate(head_maps):
        shape = (1, 1, int(head_map.size)) if local_heads == 1 else outer_heads_inner(head_map, local_heads)
        if shape is None or shape[0] != 1:
            what = "no head dimension" if shape is None else f"{shape[0]} x {local_heads} heads x {shape[2]} B"
            return PageHeads(total, tp_size, rank, (), f"region {r}: pages are not head-major ({what})")
        inner.append(shape[2])
    return PageHeads(total, tp_size, rank, tuple(inner))


def page_heads(kv_caches: Mapping[str, Any], num_blocks: int, total: int, tp_size: int, rank: int,
               local_heads: int) -> PageHeads:
    """A worker's :class:`PageHeads` from its registered KV tensors (never raises: ``why`` says)."""
    from tiercache.layout import LayoutError, region_head_maps

    if total <= 0:
        return PageHeads(total, tp_size, rank, (), "the global KV-head count is unknown")
    try:
        return page_heads_from_maps(region_head_maps(kv_caches, num_blocks, local_heads), total, tp_size, rank,
                                    local_heads)
    except (ShardError, LayoutError) as exc:
        return PageHeads(total, tp_size, rank, (), str(exc))


def hetero_refusal(total: int, producer_tp: int, consumer_tp: int) -> str | None:
    """Why a hand-off between these TP sizes is refused (None: it is allowed)."""
    if producer_tp == consumer_tp:
        return None
    if total <= 0:
        return "the global KV-head count is unknown: only equal TP sizes hand off"
    big, small = max(producer_tp, consumer_tp), min(producer_tp, consumer_tp)
    if small <= 0 or big % small:
        return f"TP sizes {producer_tp} (producer) and {consumer_tp} (consumer) are not an integer ratio"
    if producer_tp > total:
        return (f"the producer's TP size {producer_tp} exceeds the {total} KV heads (replicated heads); "
                f"only a consumer of the same TP size reads it")
    try:
        global_heads(total, consumer_tp, 0)
    except ShardError as exc:
        return str(exc)
    return None


def tp_mismatches(ours: dict[str, Any], theirs: dict[str, Any], we_produce: bool = False) -> list[str]:
    """Fingerprint differences that refuse a hand-off (one line each), allowing another TP size.

    Engines of different TP sizes match when everything but :data:`TP_FIELDS` matches,
    the global KV-head count is known, and :func:`hetero_refusal` allows the pair.
    """
    from tiercache.pd.handoff import mismatches

    if ours.get("tp_size") == theirs.get("tp_size"):
        return mismatches(ours, theirs)
    strip = {k: v for k, v in ours.items() if k not in TP_FIELDS}
    diff = mismatches(strip, {k: v for k, v in theirs.items() if k not in TP_FIELDS})
    if diff:
        return diff
    try:
        total = int(ours.get("kv_heads") or 0)
        ptp, ctp = int(theirs.get("tp_size") or 0), int(ours.get("tp_size") or 0)
    except (TypeError, ValueError):
        return [f"tp_size: ours {ours.get('tp_size')!r}, peer {theirs.get('tp_size')!r}"]
    if we_produce:
        ptp, ctp = ctp, ptp
    why = hetero_refusal(total, ptp, ctp) if ptp and ctp else "tp_size missing"
    return [f"tp_size: ours {ours.get('tp_size')}, peer {theirs.get('tp_size')}: {why}"] if why else []


@dataclass(frozen=True)
class HeadRun:
    """Heads ``count`` of one producer rank's pages, from its index ``theirs`` into our index ``ours``."""

    producer_rank: int
    ours: int
    theirs: int
    count: int


def head_runs(total: int, consumer_tp: int, consumer_rank: int, producer_tp: int) -> list[HeadRun]:
    """Where each of our heads comes from: runs of heads consecutive on both sides, by producer rank."""
    why = hetero_refusal(total, producer_tp, consumer_tp)
    if why:
        raise ShardError(why)
    holders = [global_heads(total, producer_tp, p) for p in range(producer_tp)]
    runs: list[HeadRun] = []
    for i, head in enumerate(global_heads(total, consumer_tp, consumer_rank)):
        p = next(p for p, hs in enumerate(holders) if head in hs)
        j = holders[p].index(head)
        last = runs[-1] if runs else None
        if last and last.producer_rank == p and last.ours + last.count == i and last.theirs + last.count == j:
            runs[-1] = HeadRun(p, last.ours, last.theirs, last.count + 1)
        else:
            runs.append(HeadRun(p, i, j, 1))
    if os.environ.get(WRONG_HEAD_ENV, "") == "1":  # negative control: another head's bytes
        ours_n = len(global_heads(total, consumer_tp, consumer_rank))
        theirs_n = len(holders[0])
        if ours_n > 1:
            runs = [HeadRun(r.producer_rank, (r.ours + 1) % ours_n, r.theirs, 1) for r in runs if r.count == 1] or runs
        else:
            runs = [HeadRun(r.producer_rank, r.ours, (r.theirs + 1) % theirs_n, r.count) for r in runs]
    return runs


def readers_of(total: int, consumer_tp: int, producer_tp: int, producer_rank: int) -> int:
    """How many consumer ranks read producer rank ``producer_rank`` (it waits for as many notices)."""
    return sum(1 for r in range(consumer_tp)
               if any(run.producer_rank == producer_rank for run in head_runs(total, consumer_tp, r, producer_tp)))


def check_pages(ours: PageHeads, theirs: PageHeads) -> str | None:
    """Why the producer's pages cannot be read head by head into ours (None: they can)."""
    if not ours.head_major:
        return f"our KV pages: {ours.why or 'not head-major'}"
    if not theirs.head_major:
        return f"the producer's KV pages: {theirs.why or 'not head-major'}"
    if ours.total != theirs.total:
        return f"global KV heads: ours {ours.total}, producer {theirs.total}"
    if ours.inner != theirs.inner:
        return f"one head's bytes per page: ours {list(ours.inner)[:4]}..., producer {list(theirs.inner)[:4]}..."
    return None


def head_descs(runs: Sequence[HeadRun], inner: Sequence[int], our_addr: Sequence[Sequence[int]],
               their_addr: Sequence[Sequence[int]], device_ids: tuple[int, int] = (0, 0)
               ) -> tuple[np.ndarray, np.ndarray]:
    """(local, remote) descriptors: for each region ``r`` and page pair ``i``, each run's heads.

    ``our_addr[r][i]`` / ``their_addr[r][i]``: the start of the i-th page pair of
    region ``r`` (ours, the producer's); ``runs``: one producer rank's head runs.
    """
    local: list[tuple[int, int, int]] = []
    remote: list[tuple[int, int, int]] = []
    for r, size in enumerate(inner):
        for oa, ta in zip(our_addr[r], their_addr[r]):
            for run in runs:
                local.append((oa + run.ours * size, run.count * size, device_ids[0]))
                remote.append((ta + run.theirs * size, run.count * size, device_ids[1]))
    return np.asarray(local, dtype=np.int64).reshape(-1, 3), np.asarray(remote, dtype=np.int64).reshape(-1, 3)
