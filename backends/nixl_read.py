"""One NIXL READ, posted and polled to completion: the P/D consumer's data and tag reads.

:func:`read_to_completion` is the only place ``NixlPeerTier`` touches a NIXL
transfer handle: it makes the handle from two descriptor lists, posts it,
polls it until done (or the deadline), and always releases it. Any failure is a
``ChannelError`` naming the producer, so a transfer error fails the keys, never
the engine. :func:`thread_schedstat` reads the calling thread's CPU time and
run-queue wait, for the per-READ debug log.

Threads: called with the consumer's ``_io_lock`` held (one READ at a time per agent).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from tiercache.pd_channel import ChannelError

logger = logging.getLogger(__name__)


def read_to_completion(agent: Any, peer_agent: str, address: str, local: Any, local_mem: str, remote: Any,
                       remote_mem: str, deadline: float, poll_burst_s: float) -> None:
    """READ ``remote`` (on ``peer_agent``) into ``local``: descriptor lists or ``(N, 3)`` arrays.

    ``poll_burst_s``: how long to poll before yielding the GIL once (``inf``: never
    yield, for a read on the thread that owns the step). ChannelError if the READ
    fails or passes ``deadline`` (``time.monotonic``).
    """
    handle = None
    try:
        handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local, local_mem),
                                       agent.get_xfer_descs(remote, remote_mem), peer_agent)
        state = agent.transfer(handle)
        yield_at = time.monotonic() + poll_burst_s
        while state not in ("DONE", "ERR"):
            now = time.monotonic()
            if now > deadline:
                raise ChannelError(f"producer {address}: READ timed out")
            if now >= yield_at:
                time.sleep(0)
                yield_at = time.monotonic() + poll_burst_s
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise ChannelError(f"producer {address}: READ failed")
    except ChannelError:
        raise
    except Exception as exc:  # noqa: BLE001 - a transfer error fails the keys, never the engine
        raise ChannelError(f"producer {address}: READ failed: {type(exc).__name__}: {exc}") from exc
    finally:
        if handle is not None:
            try:
                agent.release_xfer_handle(handle)
            except Exception:  # noqa: BLE001
                logger.debug("tiercache P/D: releasing a transfer handle failed", exc_info=True)


def thread_schedstat() -> tuple[int, int]:
    """This thread's CPU time and run-queue wait so far, in ns (Linux; zeros elsewhere). Debug logs only."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            cpu, waited, _ = f.read().split()
        return int(cpu), int(waited)
    except (OSError, ValueError):
        return 0, 0
