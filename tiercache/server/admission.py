"""Who gets a connection: the server's cap and each peer address's, the oldest unauthenticated dropped first.

A connection that has not said HELLO costs the server a socket and a task
and has proven nothing; one that has authenticated is a client. So when a
new connection arrives and a cap is reached, :meth:`Admission.make_room`
names the *oldest connection that has not authenticated yet* to close in its
place (first among the new peer's own connections when the per-peer cap is
the one reached, then among all); only when every connection under the cap
has authenticated is the new one refused (``too_many_connections``). A flood
of silent connections (or of connections stuck in HELLO) therefore churns
through itself while clients that authenticated keep their connections, and
a new client that says HELLO promptly gets in.

Caps: ``max_connections`` for the server, ``max_connections_per_peer`` per
peer IP address (all ports of one host count together; loopback clients
share 127.0.0.1).

The service calls :meth:`add` when it accepts a connection,
:meth:`discard` when it forgets one (closed, or dropped here), and acts on
the victims :meth:`make_room` returns (forget, then cancel their task: the
task closes its socket). A connection counts as authenticated once its
``tenant`` is set (HELLO presented a good token).

Threading: event loop thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Protocol, TypeVar


class Admitted(Protocol):
    """What admission reads of a connection: its tenant, None until HELLO succeeded."""

    @property
    def tenant(self) -> object | None: ...


C = TypeVar("C", bound=Admitted)


class Admission(Generic[C]):
    def __init__(self, max_connections: int, max_per_peer: int) -> None:
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer
        # not authenticated when last looked at, oldest first (authenticated ones leave lazily)
        self._pending: OrderedDict[C, str] = OrderedDict()
        self._by_peer: dict[str, dict[C, None]] = {}  # every connection of a peer, oldest first
        self._peer_of: dict[C, str] = {}

    def __len__(self) -> int:
        return len(self._peer_of)

    def add(self, conn: C, peer: str) -> None:
        self._peer_of[conn] = peer
        self._pending[conn] = peer
        self._by_peer.setdefault(peer, {})[conn] = None

    def discard(self, conn: C) -> None:
        peer = self._peer_of.pop(conn, None)
        self._pending.pop(conn, None)
        if peer is not None:
            mine = self._by_peer.get(peer)
            if mine is not None:
                mine.pop(conn, None)
                if not mine:
                    del self._by_peer[peer]

    def peers(self) -> int:
        return len(self._by_peer)

    def make_room(self, peer: str) -> list[C] | None:
        """Room for a new connection from ``peer``: who to drop for it ([] if none); None: refuse it."""
        mine = self._by_peer.get(peer, {})
        if len(mine) >= self.max_per_peer:
            # (dropping one of the peer's own also brings the server under its cap)
            victim = next((c for c in mine if c.tenant is None), None)
        elif len(self._peer_of) >= self.max_connections:
            victim = self._oldest_pending()
        else:
            return []
        if victim is None:
            return None
        self.discard(victim)
        return [victim]

    def _oldest_pending(self) -> C | None:
        """The oldest connection still unauthenticated (authenticated ones leave the queue here)."""
        pending = self._pending
        while pending:
            conn = next(iter(pending))
            if conn.tenant is None:
                return conn
            pending.popitem(last=False)
        return None
