"""Faults: counted by reason, logged once with their cause, never raised into vLLM.

Any code of tiercache, on any thread of any process (scheduler, workers,
backend I/O threads), calls :func:`record` when it contains a fault: a job
past its deadline, an exception caught at the connector's edge, a reader
thread that caught its peer's garbage. The counts wait here, per process,
until someone drains them with :func:`take`: the scheduler into its
Prometheus counter ``tiercache_faults_total{reason}`` every step, a worker
into its step report (the scheduler counts them on arrival).

Logging: the first fault of a (reason, where) pair is logged at WARNING with
its cause (and the traceback, for an exception); the same pair is logged again
at most once per :data:`LOG_EVERY_S`, saying how many were not logged since.
A stalled tier therefore costs one log line a minute, not one per chunk per
step.

Reasons (the ``reason`` label): ``load_deadline``, ``store_deadline``,
``tier_stalled``, ``backend_exception``, ``connector_exception``,
``reader_exception``, ``delete_dropped``, ``lookup_timeout``, ``integrity``,
``tier_read_failed``, ``window_block_not_stored``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

logger = logging.getLogger("tiercache.faults")

LOG_EVERY_S = 60.0

LOAD_DEADLINE = "load_deadline"  # a load's lower-tier read was not reported in deadlines.load_s
STORE_DEADLINE = "store_deadline"  # a demotion was not reported in deadlines.store_s
TIER_STALLED = "tier_stalled"  # a job failed at once: its tier still owes jobs past their deadline
BACKEND_EXCEPTION = "backend_exception"  # a backend call or a backend thread raised
CONNECTOR_EXCEPTION = "connector_exception"  # a connector method raised (turned into a miss/recompute)
READER_EXCEPTION = "reader_exception"  # the P/D reader caught an unexpected exception
DELETE_DROPPED = "delete_dropped"  # the housekeeping queue was full: deletes dropped
LOOKUP_TIMEOUT = "lookup_timeout"  # a shared tier did not answer a lookup in time
TIER_READ_FAILED = "tier_read_failed"  # a load's chunk was not read from its tier (gone since the lookup, refused)
INTEGRITY = "integrity"  # a tier returned other bytes than this worker wrote (tiercache/tiers/chunk_digests.py)
WINDOW_BLOCK_NOT_STORED = "window_block_not_stored"  # vLLM allocated a window block a store leaves out (connector/kv_groups.py)
# a load's chunk found no host slot to be staged through (all pinned, e.g. by write-through copies still
# under way): that part of the load fails and vLLM recomputes it
STAGING_NO_SLOT = "staging_no_slot"


@dataclass
class _LogState:
    next_at: float
    suppressed: int = 0


_lock = threading.Lock()
_counts: dict[str, int] = {}
_logged: dict[tuple[str, str], _LogState] = {}


def record(reason: str, cause: str | BaseException, where: str = "", count: int = 1) -> None:
    """Count ``count`` faults of ``reason`` and log the cause (rate-limited per ``(reason, where)``).

    Never raises: a fault report must not become a fault.
    """
    try:
        now = time.monotonic()
        with _lock:
            _counts[reason] = _counts.get(reason, 0) + count
            state = _logged.get((reason, where))
            if state is not None and now < state.next_at:
                state.suppressed += count
                return
            suppressed = state.suppressed if state is not None else 0
            _logged[(reason, where)] = _LogState(now + LOG_EVERY_S)
        more = f" ({suppressed} more since the last report)" if suppressed else ""
        place = f" [{where}]" if where else ""
        if isinstance(cause, BaseException):
            logger.warning("tiercache fault %s%s: %s: %s%s", reason, place, type(cause).__name__, cause, more,
                           exc_info=(type(cause), cause, cause.__traceback__))
        else:
            logger.warning("tiercache fault %s%s: %s%s", reason, place, cause, more)
    except Exception:  # noqa: BLE001 - last resort: never let counting raise
        pass


def take() -> dict[str, int]:
    """The counts recorded since the last call, by reason (drained)."""
    global _counts
    with _lock:
        out, _counts = _counts, {}
    return out


def give_back(counts: dict[str, int]) -> None:
    """Put counts taken by :func:`take` back (their report could not be sent)."""
    with _lock:
        for reason, n in counts.items():
            _counts[reason] = _counts.get(reason, 0) + n


def reset_for_tests() -> None:
    """Forget counts and log state (unit tests)."""
    with _lock:
        _counts.clear()
        _logged.clear()
