"""The server's NIXL (UCX) data path: READ a put's values from the client, WRITE a get's into it.

The server has one NIXL agent with its whole host slab registered once (one
DRAM region). A client that has NIXL sends its agent name and metadata in
HELLO (and again in AGENT_META when it registers more memory); the server
loads it (``add_remote_agent``; loading again updates it) once a throwaway
process has loaded it first and survived (:mod:`tiercache.nixl_vetting`: a
malformed UCX address aborts the process that loads it), and then moves
values between its slots and the client's registered buffers with one
transfer per request. The control messages and replies still go over the TCP
connection; a transfer error fails the request's keys, never the connection.

Threading: event loop thread only. The agent has no progress thread (NIXL's
busy-polls a whole core even when idle, with ``pthrDelay = 0``): the transfer
*is* driven by ``check_xfer_state``, which the transfer's coroutine calls
between the loop's other work: back to back for the first
time a healthy transfer of its size takes, then after sleeps that grow
to ``_POLL_MAX_S`` (a big or stuck transfer costs no CPU), so many transfers
of many connections progress at once without a thread each, and none spins.

Deadlines: a transfer gets ``timeout_s`` plus its bytes at
``min_transfer_rate`` (a client that stops progressing its agent, or names
memory that never answers, cannot hold the slots for ever). A transfer past
its deadline, or whose request is cancelled, is cancelled
(``release_xfer_handle``); if NIXL cannot cancel it, it may still touch the
slots, so they stay reserved/pinned: the endpoint's reaper keeps polling it
and frees them (the caller's ``settle``) only once it has ended. Its keys are
answered FAILED either way.

Buffers: the slab belongs to the
:class:`~tiercache.server.store.ChunkStore`; a transfer touches only slots
the store has STORING or pinned for the request that started it, and the
request's ``settle`` callback (called exactly once, when no transfer can
touch them any more) is what ends that.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from tiercache.nixl_vetting import MetadataVetter

logger = logging.getLogger(__name__)

# Poll back to back (yielding to the loop) while a healthy transfer would still be running (its
# bytes at _FAST_RATE, plus _YIELD_S; at most _YIELD_MAX_S), then sleep between polls.
_YIELD_S = 0.0005
_FAST_RATE = 2e9
_YIELD_MAX_S = 0.05
_POLL_MIN_S = 0.0001
_POLL_MAX_S = 0.002
_REAP_EVERY_S = 0.05
_DONE = ("DONE", "ERR")

#: Called once when no transfer can touch a request's slots any more; its argument: all bytes moved.
Settle = Callable[[bool], None]


def nixl_available() -> bool:
    try:
        from nixl._api import nixl_agent
    except Exception:
        return False
    return True


class NixlEndpoint:
    """The server's agent: the slab registered, remote agents loaded per client."""

    def __init__(self, name: str, address: int, nbytes: int, timeout_s: float = 30.0,
                 min_transfer_rate: int = 1 << 20) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = f"{name}-{os.getpid()}"
        self.timeout_s = timeout_s
        self.min_transfer_rate = min_transfer_rate
        self.agent = nixl_agent(self.name, nixl_agent_config(backends=["UCX"], enable_prog_thread=False))
        self._reg = self.agent.register_memory([(address, nbytes, 0, "")], "DRAM")
        self._peers: dict[str, int] = {}  # remote agent name -> connections using it
        self._stuck: list[tuple[Any, Settle]] = []  # transfers NIXL could not cancel, until they end
        self._reaper: asyncio.Task[None] | None = None
        self.vetter = MetadataVetter(timeout_s=timeout_s)
        self.vetter.start()

    async def vet(self, metadata: bytes) -> str:
        """The agent name ``metadata`` loads as, once a throwaway agent loaded it; MetadataRefused if not.

        Call before :meth:`add_peer` / :meth:`update_peer` with the same bytes (they load unvetted).
        """
        return await asyncio.to_thread(self.vetter.vet, metadata)

    def add_peer(self, metadata: bytes) -> str:
        """Load (or reload) a client's agent metadata; its agent name."""
        name = self.agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._peers[name] = self._peers.get(name, 0) + 1
        return name

    def update_peer(self, metadata: bytes) -> None:
        self.agent.add_remote_agent(metadata)

    def drop_peer(self, name: str) -> None:
        count = self._peers.get(name, 0) - 1
        if count > 0:
            self._peers[name] = count
            return
        self._peers.pop(name, None)
        try:
            self.agent.remove_remote_agent(name)
        except Exception:  # already gone: nothing to release
            logger.debug("nixl: removing agent %s failed", name, exc_info=True)

    def deadline_s(self, nbytes: int) -> float:
        """Seconds a transfer of ``nbytes`` may take."""
        return self.timeout_s + nbytes / self.min_transfer_rate

    @property
    def stuck(self) -> int:
        """Transfers past their deadline that NIXL could not cancel (their slots still held)."""
        return len(self._stuck)

    async def transfer(
        self, op: str, local: Sequence[tuple[int, int]], remote: Sequence[tuple[int, int]], peer: str,
        settle: Settle,
    ) -> bool:
        """``op`` "READ" (remote -> local slots) or "WRITE" (slots -> remote); True if DONE in time.

        ``settle(ok)`` is called exactly once, when the transfer can no longer
        touch the slots: before this returns (or raises), or later from the
        reaper for a transfer that could not be cancelled.
        """
        if not local:
            settle(True)
            return True
        agent = self.agent
        handle = None
        nbytes = sum(n for _, n in local)
        try:
            local_descs = agent.get_xfer_descs([(a, n, 0) for a, n in local], "DRAM")
            remote_descs = agent.get_xfer_descs([(a, n, 0) for a, n in remote], "DRAM")
            handle = agent.initialize_xfer(op, local_descs, remote_descs, peer)
            state = agent.transfer(handle)
            state = await self._poll(handle, state, self.deadline_s(nbytes),
                                     min(_YIELD_S + nbytes / _FAST_RATE, _YIELD_MAX_S))
        except asyncio.CancelledError:
            self._end(handle, settle, None)
            raise
        except Exception as exc:
            logger.warning("nixl: %s with %s refused: %s", op, peer, exc)  # e.g. memory it never registered
            logger.debug("nixl: %s with %s", op, peer, exc_info=True)
            self._end(handle, settle, None)
            return False
        if state == "ERR":
            logger.warning("nixl: %s of %d buffers from/to %s failed", op, len(local), peer)
        elif state != "DONE":
            logger.warning("nixl: %s of %d buffers from/to %s not done in %.1fs: cancelled",
                           op, len(local), peer, self.deadline_s(nbytes))
        self._end(handle, settle, state)
        return state == "DONE"

    async def _poll(self, handle: Any, state: str, timeout_s: float, eager_s: float) -> str:
        """Drive the transfer until it ends or ``timeout_s`` passes (polling back to back for ``eager_s``)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + timeout_s
        pause = 0.0
        while state not in _DONE:
            now = loop.time()
            if now >= deadline:
                return state
            if now - start > eager_s:
                pause = min(max(pause * 2, _POLL_MIN_S), _POLL_MAX_S, deadline - now)
            await asyncio.sleep(pause)  # other connections run; then progress this transfer
            state = self.agent.check_xfer_state(handle)
        return state

    def _end(self, handle: Any, settle: Settle, state: str | None) -> None:
        """Release the handle (cancelling it if it still runs) and settle, or leave both to the reaper."""
        if handle is not None and not self._release(handle):
            self._stuck.append((handle, settle))
            if self._reaper is None or self._reaper.done():
                loop = asyncio.get_running_loop()
                self._reaper = loop.create_task(self._reap(), name="tiercache-nixl-reaper")
            return
        settle(state == "DONE")

    def _release(self, handle: Any) -> bool:
        try:
            self.agent.release_xfer_handle(handle)
        except Exception:
            logger.debug("nixl: releasing a transfer handle failed", exc_info=True)
            return False
        return True

    async def _reap(self) -> None:
        """Poll the transfers that could not be cancelled; settle each once it has ended."""
        while self._stuck:
            await asyncio.sleep(_REAP_EVERY_S)
            still: list[tuple[Any, Settle]] = []
            for handle, settle in self._stuck:
                try:
                    self.agent.check_xfer_state(handle)  # progress it
                except Exception:
                    logger.debug("nixl: polling a stuck transfer failed", exc_info=True)
                if self._release(handle):  # ended, or cancelled now: the slots are safe
                    settle(False)
                else:
                    still.append((handle, settle))
            self._stuck = still

    def close(self) -> None:
        self.vetter.close()
        for handle, settle in self._stuck:
            if self._release(handle):
                settle(False)
            else:  # the process is ending: its slab goes with it
                logger.warning("nixl: a transfer could not be cancelled at shutdown")
        self._stuck = []
        if self._reaper is not None:
            self._reaper.cancel()
        for name in list(self._peers):
            self._peers[name] = 1
            self.drop_peer(name)
        try:
            self.agent.deregister_memory(self._reg)
        except Exception:
            logger.debug("nixl: deregistering the slab failed", exc_info=True)
