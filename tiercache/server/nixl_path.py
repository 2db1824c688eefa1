"""The server's NIXL (UCX) data path: READ a put's values from the client, WRITE a get's into it.

The server has one NIXL agent with its whole host slab registered once (one
DRAM region). A client that has NIXL sends its agent name and metadata in
HELLO (and again in AGENT_META when it registers more memory); the server
loads it (``add_remote_agent``; loading again updates it) and then moves
values between its slots and the client's registered buffers with one
transfer per request. The control messages and replies still go over the TCP
connection; a transfer error fails the request's keys, never the connection.

Threading: event loop thread only. The agent has no progress thread (NIXL's
busy-polls a whole core even when idle, with ``pthrDelay = 0``): the transfer
*is* driven by ``check_xfer_state``, which the loop calls between its other
work (``await asyncio.sleep(0)`` each round) until the transfer ends, so many
transfers of many connections progress at once without a thread each. Buffers: the slab belongs to the
:class:`~tiercache.server.store.ChunkStore`; a transfer touches only slots
the store has STORING or pinned for the request that started it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence

logger = logging.getLogger(__name__)

_CANCEL_WAIT_S = 5.0


def nixl_available() -> bool:
    try:
        from nixl._api import nixl_agent  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install (missing libs) is "not available" too
        return False
    return True


class NixlEndpoint:
    """The server's agent: the slab registered, remote agents loaded per client."""

    def __init__(self, name: str, address: int, nbytes: int) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = f"{name}-{os.getpid()}"
        self.agent = nixl_agent(self.name, nixl_agent_config(backends=["UCX"], enable_prog_thread=False))
        self._reg = self.agent.register_memory([(address, nbytes, 0, "")], "DRAM")
        self._peers: dict[str, int] = {}  # remote agent name -> connections using it

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

    async def transfer(
        self, op: str, local: Sequence[tuple[int, int]], remote: Sequence[tuple[int, int]], peer: str
    ) -> bool:
        """``op`` "READ" (remote -> local slots) or "WRITE" (slots -> remote); True if DONE."""
        if not local:
            return True
        agent = self.agent
        handle = None
        try:
            local_descs = agent.get_xfer_descs([(a, n, 0) for a, n in local], "DRAM")
            remote_descs = agent.get_xfer_descs([(a, n, 0) for a, n in remote], "DRAM")
            handle = agent.initialize_xfer(op, local_descs, remote_descs, peer)
            state = agent.transfer(handle)
            try:
                while state not in ("DONE", "ERR"):
                    await asyncio.sleep(0)  # other connections run; then progress this transfer
                    state = agent.check_xfer_state(handle)
            except asyncio.CancelledError:
                # The caller frees the slots next: the transfer must not touch them any more.
                deadline = time.monotonic() + _CANCEL_WAIT_S
                while state not in ("DONE", "ERR") and time.monotonic() < deadline:
                    time.sleep(0.0005)  # noqa: ASYNC251 - must not yield: the slots are freed next
                    state = agent.check_xfer_state(handle)
                raise
            if state == "ERR":
                logger.warning("nixl: %s of %d buffers from/to %s failed", op, len(local), peer)
            return state == "DONE"
        except Exception:
            logger.warning("nixl: %s with %s failed", op, peer, exc_info=True)
            return False
        finally:
            if handle is not None:
                try:
                    agent.release_xfer_handle(handle)
                except Exception:
                    logger.debug("nixl: releasing a transfer handle failed", exc_info=True)

    def close(self) -> None:
        for name in list(self._peers):
            self._peers[name] = 1
            self.drop_peer(name)
        try:
            self.agent.deregister_memory(self._reg)
        except Exception:
            logger.debug("nixl: deregistering the slab failed", exc_info=True)
