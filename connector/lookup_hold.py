"""Whether a lookup waits a step for a chunk still being written into the host tier.

A lookup counts the leading chunks READY in some tier. A chunk that is being
written into the host tier right now is not READY: another request's load is
staging it from disk, LMDB or a shared store (in async load mode, while vLLM
does not yet cache that request's blocks), or an earlier load's report is late
after a stalled store. The hit would stop before that chunk and vLLM would
recompute it and everything after it, although the chunk lands within a step
or two. Such a lookup is *held* instead: the scheduler answers vLLM "ask again
next step" (``get_num_new_matched_tokens`` returns None), for at most
``deadlines.lookup_s`` per request; past that the hit is what it is.

Not held: a hit that stops inside vLLM's own prefix cache (``own_chunks``: vLLM
serves those chunks itself, a busy copy of them changes nothing), and a hit
that covers every chunk.

Threading: vLLM's scheduler thread only (the manager and the request's state
belong to it).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from tiercache.connector.scheduler_state import RequestState

from tiercache.manager.offloading import OffloadingManager


def hold_for_busy_chunk(manager: OffloadingManager, st: RequestState, keys: Sequence[bytes], hits: int,
                        own_chunks: int, limit_s: float, now: float | None = None) -> bool:
    """True: ask vLLM to come back next step, the hit stops at ``keys[hits]``, which is being written
    into the host tier. ``hits``: the request's hit (chunks) in every tier; ``own_chunks``: the
    leading chunks vLLM's own prefix cache holds. A request is held for at most ``limit_s`` in all,
    counted from its first hold (``st.held_since``)."""
    if not own_chunks <= hits < len(keys) or not manager.busy_in_host(keys[hits]):
        return False
    now = time.monotonic() if now is None else now
    if st.held_since is None:
        st.held_since = now
    return now - st.held_since < limit_s
