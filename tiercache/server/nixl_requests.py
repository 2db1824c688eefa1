"""The server's PUT_REMOTE and GET_REMOTE: values moved by NIXL, each value's head in the message body.

A value may travel in two parts (the client tier's frames: a small header,
then the chunk, which stays in the engine's registered buffer):

* PUT_REMOTE with ``heads``: value ``i`` is ``heads[i]`` (written into the
  slot from the body by this module) followed by ``sizes[i] - len(heads[i])``
  bytes the server READs from ``addrs[i]`` into the slot at offset
  ``len(heads[i])``;
* GET_REMOTE with ``head_lens``: the reply's ``heads[i]`` is the value's first
  ``min(head_lens[i], size)`` bytes, and only the rest is WRITTEN to
  ``addrs[i]``.

Without ``heads``/``head_lens`` (empty lists) the whole value moves by NIXL,
as before they existed. Bounds (a hostile client must not make the server
touch bytes outside the request's slots): a head is at most
:data:`~tiercache.server.protocol.MAX_HEAD_BYTES` (msgspec) and at most its
value (``len(heads[i]) <= sizes[i]``, else the request is malformed); values
are bounded by the slot as for PUT (``begin_put``: BAD_SIZE); a get's head is
cut to the stored value's size, and what is written is the value's rest, never
more than ``capacities[i]`` minus the head (``begin_get`` refuses values past
the capacity). ``heads``/``head_lens`` of another length than ``keys`` are
malformed. Keys with nothing left to move once the head is taken need no
NIXL descriptor.

Budgets and deadlines: the caller (:class:`~tiercache.server.connection.Connection`)
passes the request's :class:`~tiercache.server.budgets.Charge`; the tenant
scoping of the keys and the frame clock are applied before these functions
run, as for every request.

Threading: event loop thread only. Buffers: slot views are touched only
between the store's begin and end calls (``end_put``/``end_get`` run from the
transfer's ``settle``, once no transfer can touch the slots).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tiercache.server import protocol as p

if TYPE_CHECKING:
    from tiercache.server.budgets import Charge
    from tiercache.server.nixl_path import NixlEndpoint
    from tiercache.server.slab import Slab
    from tiercache.server.store import ChunkStore

Runs = list[tuple[int, int]]


def _check_lengths(n: int, values: list[bytes] | list[int], name: str) -> None:
    if values and len(values) != n:
        raise p.MalformedBody(f"{n} keys but {len(values)} {name}")


async def put_remote(store: ChunkStore, nixl: NixlEndpoint, peer: str, body: p.PutRemote,
                     charge: Charge) -> tuple[list[p.Status], int]:
    """Serve one PUT_REMOTE: each key's status and the value bytes stored."""
    _check_lengths(len(body.keys), body.heads, "heads")
    heads = body.heads or [b""] * len(body.keys)
    for head, size in zip(heads, body.sizes):
        if len(head) > size:
            raise p.MalformedBody(f"a head of {len(head)} bytes for a value of {size}")
    ticket = store.begin_put(body.keys, body.sizes, body.overwrite, charge)
    slab = store.slab
    offsets = []
    for slot, head in zip(ticket.slots, heads):
        if slot >= 0 and head:
            slab.value(slot, len(head))[:] = head  # the slot is STORING: this request's own
        offsets.append(len(head))
    local, remote = nixl_pairs(slab, ticket.slots, ticket.sizes, body.addrs, offsets)
    # end_put runs once no transfer can write the slots any more (maybe later: nixl_path.py)
    ok = await nixl.transfer("READ", local, remote, peer, lambda done: store.end_put(ticket, done))
    status = [p.Status.FAILED if slot >= 0 and not ok else s for slot, s in zip(ticket.slots, ticket.status)]
    stored = sum(n for n, slot in zip(ticket.sizes, ticket.slots) if slot >= 0) if ok else 0
    return status, stored


async def get_remote(store: ChunkStore, nixl: NixlEndpoint, peer: str, body: p.GetRemote,
                     charge: Charge) -> p.GetReply:
    """Serve one GET_REMOTE: the reply (statuses, sizes, and heads when asked for)."""
    _check_lengths(len(body.keys), body.head_lens, "head_lens")
    ticket = await store.begin_get(body.keys, body.capacities, charge)
    slab = store.slab
    want = body.head_lens or [0] * len(body.keys)
    heads: list[bytes] = []
    offsets: list[int] = []
    for slot, size, n in zip(ticket.slots, ticket.sizes, want):
        cut = min(n, size) if slot >= 0 else 0  # never past the stored value
        heads.append(bytes(slab.value(slot, cut)) if cut else b"")  # copied while pinned
        offsets.append(cut)
    local, remote = nixl_pairs(slab, ticket.slots, ticket.sizes, body.addrs, offsets)
    # end_get runs once no transfer can read the slots any more (maybe later: nixl_path.py)
    if not await nixl.transfer("WRITE", local, remote, peer, lambda _: store.end_get(ticket)):
        for i, slot in enumerate(ticket.slots):
            if slot >= 0:
                ticket.status[i], ticket.sizes[i], heads[i] = p.Status.FAILED, 0, b""
    return p.GetReply([int(s) for s in ticket.status], ticket.sizes, heads if body.head_lens else [])


def nixl_pairs(slab: Slab, slots: list[int], sizes: list[int], addrs: list[int], offsets: list[int]
               ) -> tuple[Runs, Runs]:
    """(local, remote) (address, size) runs: each accepted slot's bytes from ``offsets[i]`` to its
    size, and the client's buffer at ``addrs[i]`` (slot -1, or nothing left past the head: left out)."""
    local: Runs = []
    remote: Runs = []
    for slot, size, addr, offset in zip(slots, sizes, addrs, offsets):
        rest = size - offset
        if slot >= 0 and rest > 0:
            local.append((slab.value_address(slot) + offset, rest))
            remote.append((addr, rest))
    return local, remote
