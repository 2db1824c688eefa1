"""Deadlines of one connection's requests: a frame must arrive, and its reply be taken, in time.

A client controls how fast its bytes arrive and how fast it reads the reply;
the server must not wait on it for ever while it holds slots for it (a PUT's
reserved slots while its payload trickles in, a GET's pinned slots while the
client does not read). :class:`FrameClock` puts one deadline on each request,
around the connection's read-serve-reply step (a timer that cancels the
step, the way :func:`asyncio.timeout` does, written out for Python 3.10):

* receive: from the request's first byte, its header, body and payload must
  have arrived within ``frame_timeout_s`` plus the payload at
  ``min_transfer_rate`` bytes per second (a big PUT gets more time, a
  byte-a-second slowloris gets ``frame_timeout_s``);
* serve: the server's own work (staging from lower tiers, a NIXL transfer,
  which has its own deadline in :mod:`tiercache.server.nixl_path`) runs
  without the client's deadline;
* send: the reply (header, body and values) must be taken by the client
  within ``frame_timeout_s`` plus its bytes at ``min_transfer_rate``.

A missed deadline cancels the step: the handler's ``finally`` frees what it
reserved or pinned (``end_put(ok=False)``, ``end_get``) and the connection
closes with :class:`FrameTimeout` (an ERROR frame ``timeout``, when the
request was not fully received) or :class:`ReplyTimeout` (no ERROR frame: a
reply is half sent and the client is not reading anyway).

Idle time between requests is bounded separately (``idle_timeout_s``, in the
connection's loop), and HELLO by ``hello_timeout_s``.

Threading: event loop thread only; one clock per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from tiercache.server.protocol import HEADER_BYTES, Header, ProtocolError


class FrameTimeout(ProtocolError):
    """A request's frame did not arrive within its deadline."""

    code = "timeout"


class ReplyTimeout(FrameTimeout):
    """A reply was not taken by the client within its deadline (nothing more is sent)."""


class FrameClock:
    """One connection's request deadlines (see the module docstring)."""

    def __init__(self, frame_timeout_s: float, min_transfer_rate: int) -> None:
        self.frame_timeout_s = frame_timeout_s
        self.min_transfer_rate = min_transfer_rate
        self._task: asyncio.Task[Any] | None = None  # the step under a deadline, while it runs
        self._timer: asyncio.TimerHandle | None = None
        self._expired = False
        self._started = 0.0
        self._phase = "receive"
        self._budget_s = frame_timeout_s

    def allowance(self, nbytes: int) -> float:
        """Seconds a transfer of ``nbytes`` may take: the fixed part plus the bytes at the minimum rate."""
        return self.frame_timeout_s + nbytes / self.min_transfer_rate

    @contextlib.asynccontextmanager
    async def request(self) -> AsyncIterator[FrameClock]:
        """The deadline of one request, from its first byte (which has arrived) to its reply's last."""
        task = asyncio.current_task()
        assert task is not None
        self._task, self._expired, self._phase = task, False, "receive"
        self._started = asyncio.get_running_loop().time()
        self._budget_s = self.frame_timeout_s
        self._arm(self._started + self._budget_s)
        try:
            yield self
        except asyncio.CancelledError:
            if not self._expired:
                raise  # a drain, not the deadline
            uncancel = getattr(task, "uncancel", None)  # 3.11+: the cancel was ours, consumed here
            if uncancel is not None:
                uncancel()
            if self._phase == "send":
                raise ReplyTimeout(f"the reply was not read within {self._budget_s:.1f}s") from None
            raise FrameTimeout(f"the request did not arrive within {self._budget_s:.1f}s") from None
        finally:
            self._arm(None)
            self._task = None

    def received(self, header: Header) -> None:
        """Header and body are in: a payload extends the receive deadline; without one, serving starts."""
        if self._task is None:
            return
        if header.payload_len:
            self._budget_s = self.allowance(HEADER_BYTES + header.body_len + header.payload_len)
            self._arm(self._started + self._budget_s)
        else:
            self._arm(None)

    def sending(self, nbytes: int) -> None:
        """A reply of ``nbytes`` starts now: the send deadline replaces the receive deadline."""
        if self._task is None:
            return
        self._phase = "send"
        self._budget_s = self.allowance(nbytes)
        self._arm(asyncio.get_running_loop().time() + self._budget_s)

    def _arm(self, when: float | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if when is not None and not self._expired:
            self._timer = asyncio.get_running_loop().call_at(when, self._expire)

    def _expire(self) -> None:
        self._timer = None
        if self._task is not None and not self._task.done():
            self._expired = True
            self._task.cancel()
