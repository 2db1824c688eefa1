"""Asynchronous lookups in shared tiers (Redis, the cache server), off the scheduler thread.

A shared tier is written by other engines too, so the manager cannot know what
it holds; it has to ask. Asking must never hold up vLLM's scheduler for long
(docs/architecture.md, Shared tiers): :meth:`SharedLookup.ask` starts a
``Backend.contains`` call on a small thread pool and returns at once; the
first :meth:`answer` may wait up to ``first_wait_s`` (a few milliseconds: a
store on the same host or rack answers within them, and the request is then
scheduled in this step instead of the next, which on a busy engine is a
whole forward pass later); after that the connector answers vLLM "not yet"
(``None``) and a later step's :meth:`answer` hands back which leading keys each
tier holds, without waiting. A tier that does not answer within ``timeout_s``
or fails counts as holding nothing (a miss, never an error).

Threading: ``ask``/``answer``/``forget``/``close`` from the scheduler thread;
``contains`` runs on the pool threads (backends must allow that).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

from tiercache import faults
from tiercache.backend import Backend

logger = logging.getLogger(__name__)


class SharedLookup:
    def __init__(self, backends: dict[str, Backend], timeout_s: float = 1.0, first_wait_s: float = 0.0) -> None:
        self.backends = backends
        self.timeout_s = timeout_s
        self.first_wait_s = min(first_wait_s, timeout_s)  # the longest one answer() call may wait
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(backends)), thread_name_prefix="tiercache-lookup")
        self._pending: dict[str, tuple[float, Sequence[bytes], Sequence[bytes], dict[str, Future[list[bool]]]]] = {}

    def asking(self, token: str) -> bool:
        return token in self._pending

    def ask(self, token: str, keys: Sequence[bytes], any_of: Sequence[bytes] = ()) -> None:
        """Start asking every shared tier which of ``keys`` (and of ``any_of``) it holds."""
        asked = [*keys, *any_of]
        futures = {name: self._pool.submit(backend.contains, asked) for name, backend in self.backends.items()}
        self._pending[token] = (time.monotonic(), tuple(keys), tuple(any_of), futures)

    def answer(self, token: str, first: bool = False) -> dict[str, list[bytes]] | None:
        """Per tier, the leading ``keys`` it holds and the ``any_of`` keys it holds; None while some
        tier is still thinking. ``first``: the call right after :meth:`ask`, which waits up to
        ``first_wait_s`` for the answer; any other call returns at once."""
        started, keys, any_of, futures = self._pending[token]
        if first and self.first_wait_s > 0:
            wait(futures.values(), timeout=self.first_wait_s)
        late = time.monotonic() - started > self.timeout_s
        if not late and not all(f.done() for f in futures.values()):
            return None
        del self._pending[token]
        out: dict[str, list[bytes]] = {}
        for name, fut in futures.items():
            if not fut.done():
                faults.record(faults.LOOKUP_TIMEOUT, f"shared tier {name} did not answer a lookup in "
                              f"{self.timeout_s:g}s: a miss", where=name)
                fut.cancel()
                continue
            try:
                present = fut.result()
            except Exception as exc:  # noqa: BLE001 - a miss, never an error
                faults.record(faults.BACKEND_EXCEPTION, exc, where=f"{name}.contains")
                continue
            prefix: list[bytes] = []
            for key, held in zip(keys, present):
                if not held:
                    break
                prefix.append(key)
            prefix.extend(key for key, held in zip(any_of, present[len(keys):]) if held)
            out[name] = prefix
        return out

    def forget(self, token: str) -> None:
        entry = self._pending.pop(token, None)
        if entry is not None:
            for fut in entry[3].values():
                fut.cancel()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for backend in self.backends.values():
            try:
                backend.close()
            except Exception:
                logger.exception("tiercache: closing a shared tier failed")
