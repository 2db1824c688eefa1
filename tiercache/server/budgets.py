"""What one connection and one tenant may hold of the server's host slots and bandwidth at once.

A request *holds* host slots while it is served: a PUT's reserved slots
(STORING until its last byte arrives, or its NIXL read ends), a GET's pinned
slots (its host hits and the staging slots of its lower-tier reads, until its
reply is sent or its NIXL write ends); and it has *in-flight bytes*: the
values it receives or sends. A client that stalls (never reads its reply,
trickles its payload, never progresses its NIXL agent) holds them until a
deadline (:mod:`tiercache.server.deadlines`) closes it. These budgets bound
how much it can hold meanwhile, so a stalled client starves only itself:

* per connection (one request at a time, so: per request): at most
  ``connection_slots`` distinct slots and ``connection_bytes`` bytes (the
  payload bound, ``max_message_bytes``, over TCP and NIXL alike);
* per tenant (every connection that authenticated as it; ``""`` before
  HELLO or without tenants): at most ``tenant_slots`` distinct slots and
  ``tenant_bytes`` in-flight bytes summed over its requests.

A key past a limit is answered ``LIMIT`` and nothing is reserved, pinned or
read for it (nor for the request's later keys: a batch is a prefix, and the
client sends the rest again once this request is done).

Slots are counted once per tenant however many of its requests hold them
(several readers of one chunk pin one slot): the tenant's usage is a
reference count per (kind, key), kind ``"p"`` for a pin and ``"r"`` for a
reservation (a put replacing a chunk that a get pins takes another slot).

Defaults (:meth:`BudgetLimits.from_config`, for each key left unset): a
connection may hold a quarter of the host slots, but at least what one
message of full-size values needs (``max_message_bytes // max_value_bytes``,
and at least 16): a client batching by the payload bound never meets the
slot limit, one sending thousands of tiny values (a slot each) does; a tenant
may hold half of the slots, but at least two connections' worth; neither
more than the slab. A tenant's in-flight bytes: half the host tier's bytes,
at least two messages. (On a slab of a few messages these floors leave
little to divide: size ``max_message_bytes`` well under the host tier.)

Threading: event loop thread only (the store calls :meth:`Charge.take` and
:meth:`Charge.settle` synchronously inside its begin/end calls).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tiercache.server.config import ServerConfig

_CONNECTION_SHARE, _CONNECTION_FLOOR = 4, 16
_TENANT_SHARE, _TENANT_CONNECTIONS = 2, 2

_Held = tuple[str, bytes]  # ("p" pinned | "r" reserved, store key)


@dataclass(frozen=True)
class BudgetLimits:
    connection_slots: int
    connection_bytes: int
    tenant_slots: int
    tenant_bytes: int

    @classmethod
    def from_config(cls, config: ServerConfig, num_slots: int) -> BudgetLimits:
        """The configured limits, each unset one derived from the slab's size (module docstring)."""
        message_slots = max(_CONNECTION_FLOOR, config.max_message_bytes // config.max_value_bytes)
        conn_slots = config.max_pinned_slots_per_connection
        if conn_slots is None:
            conn_slots = max(num_slots // _CONNECTION_SHARE, min(num_slots, message_slots))
        tenant_slots = config.max_pinned_slots_per_tenant
        if tenant_slots is None:
            tenant_slots = max(num_slots // _TENANT_SHARE, min(num_slots, _TENANT_CONNECTIONS * conn_slots))
        tenant_bytes = config.max_inflight_bytes_per_tenant
        if tenant_bytes is None:
            tenant_bytes = max(config.tiers[0].capacity // _TENANT_SHARE, 2 * config.max_message_bytes)
        return cls(conn_slots, config.max_message_bytes, tenant_slots, tenant_bytes)


@dataclass
class TenantUsage:
    """What one tenant's requests hold right now."""

    held: dict[_Held, int] = field(default_factory=dict)  # (kind, key) -> requests holding it
    nbytes: int = 0

    @property
    def slots(self) -> int:
        return len(self.held)


class Budgets:
    """Every tenant's usage against the limits; one per server (the store's ``budgets``)."""

    def __init__(self, limits: BudgetLimits) -> None:
        self.limits = limits
        self._usage: dict[str, TenantUsage] = {}
        self.refused = 0  # keys answered LIMIT by a budget (not by the payload bound alone)

    def charge(self, tenant: str) -> Charge:
        """A new request's charge, for the tenant named ``tenant`` ("" when none)."""
        return Charge(self, tenant)

    def usage(self, tenant: str) -> tuple[int, int]:
        """(slots, in-flight bytes) the tenant's requests hold now."""
        usage = self._usage.get(tenant)
        return (usage.slots, usage.nbytes) if usage is not None else (0, 0)

    def total(self) -> tuple[int, int]:
        """(slots, in-flight bytes) held by every tenant together."""
        return (sum(u.slots for u in self._usage.values()), sum(u.nbytes for u in self._usage.values()))

    def _tenant(self, tenant: str) -> TenantUsage:
        usage = self._usage.get(tenant)
        if usage is None:
            usage = self._usage[tenant] = TenantUsage()
        return usage

    def _drop_if_idle(self, tenant: str) -> None:
        usage = self._usage.get(tenant)
        if usage is not None and not usage.held and not usage.nbytes:
            del self._usage[tenant]


class Charge:
    """What one request holds, counted against its connection's limit and its tenant's.

    :meth:`take` adds one key's slot (if the request does not hold it yet)
    and bytes, or refuses, and then refuses everything after (a prefix);
    :meth:`settle` keeps only what the request ended up holding;
    :meth:`release` gives everything back (idempotent).
    """

    def __init__(self, budgets: Budgets, tenant: str) -> None:
        self.budgets = budgets
        self.tenant = tenant
        self.held: set[_Held] = set()
        self.nbytes = 0
        self.refused = False

    def take(self, kind: str, key: bytes, nbytes: int) -> bool:
        """Hold ``key``'s slot (``kind`` "p" pinned, "r" reserved) and ``nbytes`` more; False: LIMIT."""
        if self.refused:
            return False
        limits = self.budgets.limits
        usage = self.budgets._tenant(self.tenant)
        item = (kind, key)
        new_here = item not in self.held
        new_slot = new_here and item not in usage.held
        if (
            len(self.held) + new_here > limits.connection_slots
            or self.nbytes + nbytes > limits.connection_bytes
            or usage.slots + new_slot > limits.tenant_slots
            or usage.nbytes + nbytes > limits.tenant_bytes
        ):
            self.refused = True
            self.budgets.refused += 1
            self.budgets._drop_if_idle(self.tenant)
            return False
        if new_here:
            self.held.add(item)
            usage.held[item] = usage.held.get(item, 0) + 1
        self.nbytes += nbytes
        usage.nbytes += nbytes
        return True

    def take_many(self, kind: str, keys: Sequence[bytes], sizes: Sequence[int]) -> int:
        """:meth:`take` of each key in order; how many were taken (a prefix: the rest are LIMIT).

        When even ``len(keys)`` new slots and every byte fit every limit (the common case) the
        keys are taken in one pass, without a check per key."""
        if self.refused:
            return 0
        limits = self.budgets.limits
        usage = self.budgets._tenant(self.tenant)
        n, nbytes = len(keys), sum(sizes)
        if (len(self.held) + n > limits.connection_slots or self.nbytes + nbytes > limits.connection_bytes
                or usage.slots + n > limits.tenant_slots or usage.nbytes + nbytes > limits.tenant_bytes):
            for i, (key, size) in enumerate(zip(keys, sizes)):
                if not self.take(kind, key, size):
                    return i
            return n
        held, counts = self.held, usage.held
        for key in keys:
            item = (kind, key)
            if item not in held:
                held.add(item)
                counts[item] = counts.get(item, 0) + 1
        self.nbytes += nbytes
        usage.nbytes += nbytes
        return n

    def settle(self, kind: str, keys: Iterable[bytes], nbytes: int) -> None:
        """Keep only ``keys`` (of ``kind``) and at most ``nbytes``: the rest was not used after all."""
        keep = {(kind, k) for k in keys}
        usage = self.budgets._tenant(self.tenant)
        for item in [i for i in self.held if i not in keep]:
            self.held.discard(item)
            count = usage.held.get(item, 0) - 1
            if count > 0:
                usage.held[item] = count
            else:
                usage.held.pop(item, None)
        drop = max(0, self.nbytes - max(0, nbytes))
        self.nbytes -= drop
        usage.nbytes -= drop
        self.budgets._drop_if_idle(self.tenant)

    def release(self) -> None:
        """Give back everything this request holds (its slots are READY or free again)."""
        if self.held or self.nbytes:
            self.settle("", (), 0)
