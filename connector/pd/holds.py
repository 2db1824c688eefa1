"""The producer's hand-off records, scheduler side: what is held for consumers, until every TP rank reported.

Owned by :class:`~tiercache.connector.pd.scheduler_role.PDScheduler` (vLLM's
scheduler thread): a :class:`Hold` per hand-off offered (host chunks, or mode
direct's device blocks) until every worker heard its consumer's read notice or
it expired; a :class:`Pinned` per mode-direct hand-off whose blocks stay
pinned in vLLM's block pool until every worker cleared their tags.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeVar


@dataclass
class Hold:
    """Producer: a hand-off's held chunks (or, mode direct, its blocks), until every worker reported it read."""

    keys: list[bytes]
    deadline: float
    direct: bool = False  # the request's device blocks, not host chunks
    tail: bytes | None = None  # via_host: the tail's key among keys (dropped when the hold ends)
    ranks: set[int] = field(default_factory=set)  # the workers (TP ranks) whose consumer read it


@dataclass
class Pinned:
    """Mode direct: a hand-off's pinned blocks, until every worker cleared their tags."""

    blocks: list[int]
    deadline: float  # past it, the workers that have not cleared them are told to (expired hold, lost notice)
    forced: bool = False
    ranks: set[int] = field(default_factory=set)  # the workers (TP ranks) that cleared their tags


_Reported = TypeVar("_Reported", Hold, Pinned)


def take_reported(table: dict[str, _Reported], reports: Mapping[str, set[int]],
                  tp_size: int) -> list[tuple[str, _Reported]]:
    """Add each report's TP ranks to its entry; remove and return the entries every rank has reported."""
    complete: list[tuple[str, _Reported]] = []
    for rid, ranks in reports.items():
        entry = table.get(rid)
        if entry is None:
            continue
        entry.ranks |= ranks
        if len(entry.ranks) >= tp_size:
            complete.append((rid, table.pop(rid)))
    return complete
