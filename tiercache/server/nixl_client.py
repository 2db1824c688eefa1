"""The client side of the NIXL data path: an agent, its registered memory, and where a view lives.

The server moves values by itself (READ for a put, WRITE for a get); the
client only has to tell it *where*: addresses inside memory registered with
its agent. Two kinds of registered memory:

* long-lived buffers of the caller (:meth:`NixlClientSide.register`, e.g. an
  engine's pinned host slab): a view inside one is used in place, zero copy;
* a staging area this object allocates and registers once, split into one
  arena per I/O thread: any other view is copied through it (one memcpy).

Registering memory changes the agent's metadata; :attr:`NixlClientSide.version`
counts the changes so each connection resends it (AGENT_META) before it next
names the new memory.

Progress: the agent runs no progress thread (NIXL's spins a whole core, idle
or not). While a PUT_REMOTE/GET_REMOTE is in flight the waiting I/O thread
calls :meth:`progress` until the reply arrives: the server's transfer (and,
the first time, UCX's connection set-up) needs this side to answer.

Threading: the agent is created without thread synchronisation, so every call
into it (register, metadata, progress) holds this object's lock; any thread
may call any method. Each arena belongs to one I/O thread. Ownership: the staging area belongs to this object;
registered caller buffers stay the caller's and must outlive this object.
"""

from __future__ import annotations

import bisect
import logging
import mmap
import os
import threading
import uuid

import numpy as np

logger = logging.getLogger(__name__)


def view_address(view: memoryview) -> int:
    """Address of the first byte of a (C-contiguous) view, read-only views included."""
    return int(np.frombuffer(view, np.uint8).ctypes.data) if len(view) else 0


class NixlClientSide:
    def __init__(self, staging_bytes: int, arenas: int) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.agent_name = f"tiercache-client-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.agent = nixl_agent(self.agent_name, nixl_agent_config(backends=["UCX"], enable_prog_thread=False))
        self._lock = threading.Lock()
        self._starts: list[int] = []  # registered caller regions, sorted by start
        self._ends: list[int] = []
        self._regs: list[object] = []
        arena_bytes = max(1 << 20, staging_bytes // max(1, arenas)) & ~4095
        self.arena_bytes = arena_bytes
        self._staging = mmap.mmap(-1, arena_bytes * arenas)
        self._staging_np = np.frombuffer(self._staging, np.uint8)
        self._staging_addr = int(self._staging_np.ctypes.data)
        self._regs.append(self.agent.register_memory([(self._staging_addr, len(self._staging), 0, "")], "DRAM"))
        self.version = 1
        self._metadata = self.agent.get_agent_metadata()

    def progress(self) -> None:
        """Let the agent make progress (one thread at a time; the others need not: it is shared)."""
        if self._lock.acquire(blocking=False):
            try:
                self.agent.get_new_notifs()
            finally:
                self._lock.release()

    def metadata(self) -> tuple[int, bytes]:
        with self._lock:
            return self.version, self._metadata

    def arena(self, index: int) -> tuple[memoryview, int]:
        """Arena ``index`` of the staging area: its view and address (one I/O thread's own)."""
        start = index * self.arena_bytes
        return memoryview(self._staging)[start : start + self.arena_bytes], self._staging_addr + start

    def register(self, buffer: memoryview) -> None:
        """Register a long-lived caller buffer: views inside it are then used in place."""
        view = memoryview(buffer).cast("B") if memoryview(buffer).format != "B" else memoryview(buffer)
        start = view_address(view)
        with self._lock:
            i = bisect.bisect_right(self._starts, start) - 1
            if i >= 0 and start + len(view) <= self._ends[i]:
                return  # inside a region registered already
            self._regs.append(self.agent.register_memory([(start, len(view), 0, "")], "DRAM"))
            j = bisect.bisect_left(self._starts, start)
            self._starts.insert(j, start)
            self._ends.insert(j, start + len(view))
            self.version += 1
            self._metadata = self.agent.get_agent_metadata()

    def locate(self, view: memoryview) -> int | None:
        """The address of ``view`` if it lies inside a registered caller buffer, else None."""
        if not self._starts:
            return None
        start = view_address(view)
        with self._lock:
            i = bisect.bisect_right(self._starts, start) - 1
            if i >= 0 and start + len(view) <= self._ends[i]:
                return start
        return None

    def close(self) -> None:
        with self._lock:
            for reg in self._regs:
                try:
                    self.agent.deregister_memory(reg)
                except Exception:
                    logger.debug("nixl: deregistering memory failed", exc_info=True)
            self._regs.clear()
