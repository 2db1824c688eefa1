"""Who gets a connection: a listener's cap and each peer address's, the oldest unauthenticated dropped first.

A connection that has not authenticated costs a socket (and a task or a
buffer) and has proven nothing; one that has authenticated is a client. So
when a new connection arrives and a cap is reached, :meth:`Admission.make_room`
names the *oldest connection that has not authenticated yet* to close in its
place (first among the new peer's own connections when the per-peer cap is
the one reached, then among all); only when every connection under the cap
has authenticated is the new one refused. A flood of silent connections (or
of connections stuck in a handshake) therefore churns through itself while
clients that authenticated keep their connections, and a new client that
authenticates promptly gets in.

``pending_rank`` says where a connection stands: None once it has
authenticated, else its eviction rank (lower goes first; among equal ranks
the oldest): the cache server ranks every connection before HELLO 0
(:mod:`tiercache.server.service`), the P/D side channel ranks silent
connections 0 and those mid-handshake 1 (:mod:`tiercache.pd.side_channel`).

Caps: ``max_connections`` for the listener, ``max_per_peer`` per peer IP
address (all ports of one host count together; loopback clients share
127.0.0.1).

The owner calls :meth:`add` when it accepts a connection, :meth:`discard`
when it forgets one (closed, or dropped here), and closes the victims
:meth:`make_room` returns (already discarded here).

Threading: one thread (the owner's accept loop) only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from typing import Generic, TypeVar

C = TypeVar("C", bound=Hashable)


class Admission(Generic[C]):
    """A listener's connections by peer, and who makes way for a newcomer (see the module)."""

    def __init__(self, max_connections: int, max_per_peer: int, pending_rank: Callable[[C], int | None]) -> None:
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer
        self._rank = pending_rank
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
            # (dropping one of the peer's own also brings the listener under its cap)
            victim = self._first_pending(mine)
        elif len(self._peer_of) >= self.max_connections:
            victim = self._oldest_pending()
        else:
            return []
        if victim is None:
            return None
        self.discard(victim)
        return [victim]

    def _oldest_pending(self) -> C | None:
        """The oldest connection still unauthenticated, lowest rank first (authenticated ones leave the queue here)."""
        pending = self._pending
        while pending:
            conn = next(iter(pending))
            if self._rank(conn) is not None:
                return self._first_pending(pending)
            pending.popitem(last=False)
        return None

    def _first_pending(self, conns: Iterable[C]) -> C | None:
        """The oldest of ``conns`` with the lowest rank (None: all have authenticated)."""
        best: C | None = None
        best_rank = 0
        for conn in conns:
            rank = self._rank(conn)
            if rank is None:
                continue
            if rank == 0:
                return conn  # nothing goes before the oldest rank-0 connection
            if best is None or rank < best_rank:
                best, best_rank = conn, rank
        return best
