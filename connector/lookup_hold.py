"""Whether a lookup waits a step for a chunk still being written into the host tier.

A lookup counts the leading chunks READY in some tier. A chunk that is being
written into the host tier right now is not READY: another request's load is
staging it from disk, LMDB or a shared store (in async load mode, while vLLM
does not yet cache that request's blocks), or an earlier load's report is late
after a stalled store. The hit would stop before that chunk and vLLM would
recompute it and everything after it, although the chunk lands within a step
or two. Such a lookup is *held* instead: the scheduler answers vLLM "ask again
next step" (``get_num_new_matched_tokens`` returns None), ``MIN_HOLDS`` times
whatever the clock says and then for at most ``deadlines.lookup_s`` from the
request's first hold (a step can outlast that budget); past that the hit is
what it is.

Not held: a hit that stops inside vLLM's own prefix cache (``own_chunks``: vLLM
serves those chunks itself, a busy copy of them changes nothing), and a hit
that covers every chunk.

A lookup is also held while the host tier has no room to stage the hit's
chunks that live only in a lower tier (``hold_for_staging_room``): every slot
is being written by this step's other loads and stores, or pinned until a
write-through copy is made. Planned anyway, the load would stage what fits and
vLLM would recompute the rest (``staging_no_slot``); a step later those slots
are READY and evictable. Seen at concurrency 8 with a 32-slot host tier in
front of disk: eight conversations' next turns, five chunks each, arrive in
one step. Same budget (``MIN_HOLDS`` holds, then ``deadlines.lookup_s`` per
request, shared with the busy-chunk hold), and never for a hit larger than the
whole host tier.

Threading: vLLM's scheduler thread only (the manager and the request's state
belong to it).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from tiercache.connector.partial_chunks import PartialChunk
from tiercache.connector.scheduler_state import RequestState

from tiercache.manager.offloading import OffloadingManager


def hold_for_busy_chunk(manager: OffloadingManager, st: RequestState, keys: Sequence[bytes], hits: int,
                        own_chunks: int, limit_s: float, now: float | None = None) -> bool:
    """True: ask vLLM to come back next step, the hit stops at ``keys[hits]``, which is being written
    into the host tier. ``hits``: the request's hit (chunks) in every tier; ``own_chunks``: the
    leading chunks vLLM's own prefix cache holds. A request is held ``MIN_HOLDS`` times, then for at
    most ``limit_s`` in all, counted from its first hold (``st.held_since``)."""
    if not own_chunks <= hits < len(keys) or not manager.busy_in_host(keys[hits]):
        return False
    return _within_budget(st, limit_s, now)


def hold_for_staging_room(manager: OffloadingManager, st: RequestState, chunk_keys: Sequence[bytes],
                          partial: PartialChunk | None, limit_s: float, now: float | None = None) -> bool:
    """True: ask vLLM to come back next step, the host tier cannot stage now the chunks a load would read
    (``chunk_keys``: the hit past vLLM's own cache, then ``partial``) that only a lower tier holds. A direct
    tier's chunks (a P/D producer's) need no staging slot."""
    keys = [*chunk_keys, partial.key] if partial is not None else chunk_keys
    host = manager.host
    # the tier each load reads, as prepare_load chooses it; a key READY nowhere (a state-layer model's last
    # chunk, which loads under its state key) is not counted
    staged = sum(1 for key in keys if key not in host.ready and any(key in t.ready for t in manager.lower)
                 and not manager.load_source(key).spec.direct)
    if staged == 0 or staged > host.spec.num_slots or host.has_room(staged, set(keys)):
        return False
    return _within_budget(st, limit_s, now)


#: A request may be held this many times whatever the clock says; past that, within ``limit_s`` of its
#: first hold. Why: what a hold waits for lands a step later, and a step of a busy engine can outlast
#: ``deadlines.lookup_s`` (eight 4k-token conversations on two CPU cores: over a second), which would
#: spend a wall-clock budget in one step (seen as ``staging_no_slot``, docs/PERFORMANCE.md, Serving).
MIN_HOLDS = 3


def _within_budget(st: RequestState, limit_s: float, now: float | None) -> bool:
    """Whether ``st``'s request may be held once more (and count it): its first ``MIN_HOLDS`` holds
    always, later ones within ``limit_s`` of its first hold."""
    now = time.monotonic() if now is None else now
    if st.held_since is None:
        st.held_since = now
    if st.holds < MIN_HOLDS or now - st.held_since < limit_s:
        st.holds += 1
        return True
    return False
