"""What P/D adds to a step's messages: one field each way between the scheduler and its workers.

Scheduler -> worker: :class:`PDStepMeta`, the ``pd`` field of
:class:`~tiercache.connector.metadata.TierCacheConnectorMetadata` (None when
P/D is off or has nothing to say). Worker -> scheduler: :class:`PDWorkerReport`,
the ``pd`` field of :class:`~tiercache.connector.metadata.TierCacheWorkerMetadata`,
summed over the workers of a TP group by :meth:`PDWorkerReport.merge`.

Which P/D chunk a load reads, and from which producer, is not here: it rides
in the load job itself (:class:`tiercache.jobs.FromReader`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class DirectHold:
    """Producer, mode direct: a request's device blocks the worker must mark held."""

    keys: tuple[bytes, ...]
    blocks: tuple[tuple[int, ...], ...]  # the blocks of each key
    tail_tokens: int = 0  # > 0: the last key is the prompt's tail (connector/prompt_tail.py)


@dataclass
class PDStepMeta:
    """The producer's instructions for this step (a consumer's are in its load jobs)."""

    # hand-offs are held: the worker keeps its UCX progressed for consumers' READs
    handoffs_held: bool = False
    # mode direct: request id -> keys and device blocks the worker marks held after this
    # step's forward pass
    direct_holds: dict[str, DirectHold] = field(default_factory=dict)
    # mode direct: requests whose marks it clears (no hand-off after all: vLLM frees their blocks)
    direct_unmarks: list[str] = field(default_factory=list)
    # mode direct: hand-offs whose tags every worker clears now and reports (expired, or a
    # notice some worker missed), after which the scheduler unpins their blocks
    direct_released: list[str] = field(default_factory=list)
    # the producer's release key (tiercache.pd.auth), every step: a consumer's read notice
    # releases a hand-off only with the token derived from it (it never leaves this engine)
    release_key: bytes = b""


@dataclass
class PDWorkerReport:
    """What one worker (or, merged, a TP group) saw of P/D since its last report."""

    # producer: request id -> the workers (TP ranks) whose consumer finished reading its hand-off
    handoffs_read: dict[str, set[int]] = field(default_factory=dict)
    # producer, mode direct: request id -> the workers (TP ranks) that cleared its blocks' tags
    blocks_released: dict[str, set[int]] = field(default_factory=dict)
    # consumer: its NIXL READs from producers, (metric path, bytes, seconds) each
    transfers: list[tuple[str, int, float]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.handoffs_read or self.blocks_released or self.transfers)

    def merge(self, other: PDWorkerReport | None) -> PDWorkerReport:
        if other is not None:
            _merge_ranks(self.handoffs_read, other.handoffs_read)
            _merge_ranks(self.blocks_released, other.blocks_released)
            self.transfers += other.transfers
        return self


def _merge_ranks(into: dict[str, set[int]], other: dict[str, set[int]]) -> None:
    """Union per request id of the TP ranks that reported it."""
    for rid, ranks in other.items():
        into.setdefault(rid, set()).update(ranks)
