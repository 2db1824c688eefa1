"""NIXL READs posted and polled to completion: the P/D consumer's data and tag reads.

* :func:`read_to_completion` makes a handle from two descriptor lists, posts it,
  polls it until done (or the deadline), and always releases it: one data READ.
* :class:`TagMirror` holds a copy of a producer's whole tag array (one tag per
  host slot or KV block) and refreshes it with one handle made once and posted
  again for every hand-off. A hand-off's tags are a few of them; READing all
  (32 KiB for 4096 slots) costs microseconds, while making, posting and
  releasing a handle for the few took 0.1-0.15 ms inside a vLLM engine, a tenth
  of a 16 MiB hand-off's READ.

Any failure is a ``ChannelError`` naming the producer, so a transfer error
fails the keys, never the engine. :func:`thread_schedstat` reads the calling
thread's CPU time and run-queue wait, for the per-READ debug log.

Threads: used with the consumer's ``_io_lock`` held (one READ at a time per agent);
a ``TagMirror`` belongs to the :class:`tiercache.pd.tagged_reads.TaggedReader` that made it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from tiercache.pd.channel import TAG_BYTES, ChannelError

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
        post_and_wait(agent, handle, address, deadline, poll_burst_s)
    except ChannelError:
        raise
    except Exception as exc:  # noqa: BLE001 - a transfer error fails the keys, never the engine
        raise ChannelError(f"producer {address}: READ failed: {type(exc).__name__}: {exc}") from exc
    finally:
        _release(agent, handle)


def post_and_wait(agent: Any, handle: Any, address: str, deadline: float, poll_burst_s: float) -> None:
    """Post a prepared READ and poll it to completion (see :func:`read_to_completion`)."""
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


def _release(agent: Any, handle: Any) -> None:
    if handle is not None:
        try:
            agent.release_xfer_handle(handle)
        except Exception:  # noqa: BLE001
            logger.debug("tiercache P/D: releasing a transfer handle failed", exc_info=True)


class TagMirror:
    """A producer's whole tag array (``count`` tags at ``remote_addr``), READ by one reusable handle.

    For arrays up to :attr:`MAX_BYTES`; larger ones are cheaper to READ run by run.
    :meth:`read` happens after the data READ it guards, like any tag READ.
    :meth:`close` releases the handle and the registration (before the peer's agent goes).
    """

    MAX_BYTES = 256 << 10

    def __init__(self, agent: Any, peer_agent: str, address: str, remote_addr: int, count: int) -> None:
        self.agent, self.address = agent, address
        self.tags = np.zeros(count, dtype=np.uint64)
        span = (int(self.tags.ctypes.data), self.tags.nbytes, 0)
        self._reg = agent.register_memory([(*span, "")], "DRAM")
        self._handle = None
        try:
            self._handle = agent.initialize_xfer("READ", agent.get_xfer_descs([span], "DRAM"),
                                                 agent.get_xfer_descs([(remote_addr, count * TAG_BYTES, 0)], "DRAM"),
                                                 peer_agent)
        except Exception as exc:  # noqa: BLE001
            self.close()
            raise ChannelError(f"producer {address}: tag READ not prepared: {type(exc).__name__}: {exc}") from exc

    def read(self, deadline: float, poll_burst_s: float) -> np.ndarray:
        """The producer's tags now (this object's buffer: read it before the next call)."""
        try:
            post_and_wait(self.agent, self._handle, self.address, deadline, poll_burst_s)
        except ChannelError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise ChannelError(f"producer {self.address}: tag READ failed: {type(exc).__name__}: {exc}") from exc
        return self.tags

    def close(self) -> None:
        _release(self.agent, self._handle)
        self._handle = None
        try:
            self.agent.deregister_memory(self._reg)
        except Exception:  # noqa: BLE001
            logger.debug("tiercache P/D: deregistering a tag mirror failed", exc_info=True)


def thread_schedstat() -> tuple[int, int]:
    """This thread's CPU time and run-queue wait so far, in ns (Linux; zeros elsewhere). Debug logs only."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            cpu, waited, _ = f.read().split()
        return int(cpu), int(waited)
    except (OSError, ValueError):
        return 0, 0
