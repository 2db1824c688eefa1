"""The P/D consumer's start-up warm-up: handshakes and READs before the first hand-off needs them.

A consumer learns a producer's address from a hand-off's params, so without
this its first hand-off from each producer pays, inside its load, the
handshake (the producer's NIXL metadata vetted in a throwaway process first:
~8 ms on the 2-core test machine) and a cold READ (UCX wiring its endpoint,
the producer's regions unknown yet: 7.3 ms against 5.3 for the next ones), and
cannot run inline on the worker thread (only a read from a producer already
shaken hands with can). An operator who names producers with their port in
``pd.trusted_producers`` knows them in advance: :class:`WarmUp` shakes hands
with each (this rank's producer rank) from start-up, in the background, and
READs a little of every region a hand-off reads
(:meth:`tiercache.pd.tagged_reads.TaggedReader.warm`).

A producer not reachable yet (the two engines start together) is tried again
every second for ``pd.warm_up_s``; one that refuses us or fails the
authentication is logged (and remembered, as a read would) at once, and not
tried again. Nothing here is needed for correctness: a warm-up that fails
leaves the first hand-off to shake hands as before.

Threads: one thread of its own. Each attempt holds the consumer's ``io_lock``
(the links and the agent are the reader's), so a read from another producer
may wait up to one handshake attempt (``tiercache.pd.link.HELLO_ATTEMPT_S``).
"""

from __future__ import annotations

import logging
import threading
import time

from tiercache.pd.channel import ChannelError
from tiercache.pd.link import Address, PeerLinks
from tiercache.pd.tagged_reads import TaggedReader

logger = logging.getLogger(__name__)

RETRY_S = 1.0  # between rounds of attempts at the producers not reached yet


class WarmUp:
    """The warm-up thread of one consumer reader; ``counters["warmed_peers"]`` counts producers warmed up."""

    def __init__(self, links: PeerLinks, reads: TaggedReader, io_lock: threading.Lock,
                 counters: dict[str, int], read_timeout_s: float) -> None:
        self._links = links
        self._reads = reads
        self._io_lock = io_lock
        self._counters = counters
        self._read_timeout_s = read_timeout_s
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, producers: list[Address], for_s: float) -> None:
        """Warm up ``producers`` (side-channel addresses of producer ranks) for up to ``for_s`` seconds."""
        self._thread = threading.Thread(target=self._run, args=(list(producers), for_s),
                                        name="tiercache-pd-warmup", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        """Stop trying (the reader is closing); returns once the thread ended, or after a read timeout."""
        self._closing.set()
        if self._thread is not None:
            self._thread.join(timeout=self._read_timeout_s + 5)

    def _run(self, pending: list[Address], for_s: float) -> None:
        deadline = time.monotonic() + for_s
        self._links.wait_ready(min(for_s, self._read_timeout_s))  # the vetter's start, outside the lock
        while pending and not self._closing.is_set() and time.monotonic() < deadline:
            for addr in list(pending):
                if self._closing.is_set():
                    return
                with self._io_lock:
                    try:
                        link = self._links.warm(addr)
                    except ChannelError:  # refused or not authenticated: logged, never tried again
                        pending.remove(addr)
                        continue
                    if link is None:  # not reachable yet
                        continue
                    pending.remove(addr)
                    try:
                        reads = self._reads.warm(link, time.monotonic() + self._read_timeout_s)
                    except ChannelError as exc:  # the first hand-off shakes hands again
                        logger.info("tiercache P/D: warm-up READ from %s failed: %s", link.address, exc)
                        self._links.drop(addr)
                        continue
                self._counters["warmed_peers"] += 1
                logger.info("tiercache P/D: warmed up producer %s (%d READs)", link.address, reads)
            self._closing.wait(RETRY_S)
        if pending and not self._closing.is_set():
            logger.info("tiercache P/D: no warm-up with %s within %.0f s (their first hand-off shakes hands)",
                        ", ".join(f"{h}:{p}" for h, p in pending), for_s)
