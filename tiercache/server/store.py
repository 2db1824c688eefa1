"""The server's chunk store: one OffloadingManager over the host slab and the lower tiers.

This is the engine's pipeline minus the GPU: the same
:class:`~tiercache.manager.offloading.OffloadingManager` decides which slot a put takes,
what it evicts, where a get reads from and what is copied down; the same
backends (disk, LMDB, plugins) hold the lower tiers. Keys are the clients'
opaque bytes (they start with the client's namespace digest).

A put is two-phase: :meth:`ChunkStore.begin_put` reserves host slots (the
keys are STORING: invisible to exists/get), the connection receives the
values straight into them, and :meth:`ChunkStore.end_put` makes them READY
only if every byte arrived; on any failure (the client vanished mid-put, a
NIXL read failed) the slots are freed and nothing of the put remains. A get
pins its keys' slots (a lower-tier hit is first read into a host staging
slot), the connection sends from the slots, and :meth:`ChunkStore.end_get`
unpins them.

Budgets (:mod:`tiercache.server.budgets`): every begin call takes the
request's :class:`~tiercache.server.budgets.Charge` and charges each key's
slot and bytes *before* anything is reserved, pinned or read from a lower
tier; a key past its connection's or tenant's limit (or past the payload
bound, ``max_message_bytes``, which is the connection's byte limit) is
answered LIMIT. A lower-tier hit is charged its capacity (its size is not
known before it is read), so a GET never stages more than it may send. The
matching end call releases the charge.

The store's :class:`~tiercache.server.tier_pump.TierPump` (``store.pump``;
the server runs ``pump.run()`` as one task) moves bytes between the host slab
and the lower tiers: queued deletes, write-through/write-back demotions, the
staged reads of gets, and the polling of every backend job.

Threading: everything here runs on the event loop thread; the manager is
never locked. Lower-tier backends run their own I/O threads on the slot views
they are given, and drop them when they report the job (the
:class:`~tiercache.backend.Backend` contract).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from tiercache.backend import Backend, BackendContext
from tiercache.config.schema import ConfigError
from tiercache.manager.directory import TierSpec
from tiercache.manager.offloading import OffloadingManager
from tiercache.server.budgets import BudgetLimits, Budgets, Charge
from tiercache.server.config import ServerConfig
from tiercache.server.protocol import Status, TierStats
from tiercache.server.slab import Slab, slot_bytes_for
from tiercache.server.tier_pump import TierPump
from tiercache.tiers.registry import backend_class, create_backend

logger = logging.getLogger(__name__)

#: Namespace of the server's own lower tiers (the clients' namespaces are inside the keys).
SERVER_NAMESPACE = b"tcserver"


@dataclass
class PutTicket:
    """A put between :meth:`ChunkStore.begin_put` and :meth:`ChunkStore.end_put`."""

    keys: list[bytes]
    sizes: list[int]
    status: list[Status]
    slots: list[int]  # host slot of each accepted key (OK), -1 otherwise
    stored: list[bytes] = field(default_factory=list)  # keys holding a STORING slot
    charge: Charge | None = None  # released by end_put


@dataclass
class GetTicket:
    """A get between :meth:`ChunkStore.begin_get` and :meth:`ChunkStore.end_get`."""

    keys: list[bytes]
    status: list[Status]
    slots: list[int]
    sizes: list[int]
    pinned: list[bytes]  # unique keys pinned by prepare_load
    staged: list[bytes] = field(default_factory=list)  # keys this get reads from a lower tier
    host_hits: int = 0
    lower_hits: int = 0
    charge: Charge | None = None  # released by end_get


class ChunkStore:
    def __init__(self, config: ServerConfig) -> None:
        host = config.tiers[0]
        slot_bytes = slot_bytes_for(config.max_value_bytes)
        num_slots = host.capacity // slot_bytes
        if num_slots < 1:
            raise ConfigError(
                f"tiers.0.capacity: {host.capacity} bytes holds no slot of {slot_bytes} bytes "
                f"(max_value_bytes {config.max_value_bytes} + trailer)"
            )
        self.config = config
        self.when_full = config.when_full
        specs = [TierSpec(host.name, num_slots, host.policy)]
        classes: dict[str, type[Backend]] = {}
        for index, tier in enumerate(config.tiers[1:], start=1):
            cls = backend_class(tier.backend)
            if getattr(cls, "shared", False):
                raise ConfigError(f"tiers.{index}.backend: {tier.backend!r} is a shared tier, not a medium")
            slots = tier.capacity // cls.footprint(slot_bytes)
            if slots < 1:
                raise ConfigError(f"tiers.{index}.capacity: {tier.capacity} bytes holds no chunk")
            classes[tier.name] = cls
            specs.append(TierSpec(tier.name, slots, tier.policy, tier.mode))
        self.manager = OffloadingManager(specs)
        self.backends: dict[str, Backend] = {}
        self._footprints = {name: cls.footprint(slot_bytes) for name, cls in classes.items()}
        for index, tier in enumerate(config.tiers[1:], start=1):
            context = BackendContext(tier.name, SERVER_NAMESPACE, slot_bytes, tier.capacity)
            self.backends[tier.name] = create_backend(tier, context, index)
        self.slab = Slab(num_slots, config.max_value_bytes)  # after the config is known good
        self.budgets = Budgets(BudgetLimits.from_config(config, num_slots))
        self._tier_backend = {t.name: t.backend for t in config.tiers}
        self._capacity = {t.name: t.capacity for t in config.tiers}
        # key -> resolved when the get that is staging it from a lower tier has ended (the
        # chunk is then READY in the host tier, or gone); other gets of the key wait for it
        self._staging: dict[bytes, asyncio.Future[None]] = {}
        self.counters = dict.fromkeys(
            ("put_keys", "stored", "get_keys", "hits", "misses", "lower_hits", "tier_failures",
             "deleted"), 0,
        )
        self.pump = TierPump(self.manager, self.backends, self.slab, self.counters)
        self._recover()

    # ------------------------------------------------------------------ start-up
    def _recover(self) -> None:
        """Adopt what persistent lower tiers still hold (a warm restart)."""
        for name, backend in self.backends.items():
            keys = list(backend.recover())
            over = self.manager.cascade.adopt(name, keys)
            if over:
                backend.delete(over)
            if keys:
                logger.info("server tier %s: %d chunks recovered (%d over budget)", name, len(keys), len(over))

    @property
    def host(self):  # type: ignore[no-untyped-def]
        return self.manager.host

    # ------------------------------------------------------------------ lookups
    def _held(self, key: bytes) -> bool:
        if key in self.host.ready:
            return True
        if key in self.host.storing:
            return False
        return any(key in t.ready for t in self.manager.lower)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return [self._held(k) for k in keys]

    def delete(self, keys: Sequence[bytes]) -> int:
        dropped = self.manager.discard(list(dict.fromkeys(keys)))
        self.counters["deleted"] += dropped
        self.pump.wake()
        return dropped

    # ------------------------------------------------------------------ puts
    def begin_put(self, keys: Sequence[bytes], sizes: Sequence[int], overwrite: bool,
                  charge: Charge | None = None) -> PutTicket:
        """Reserve host slots for the keys that may be stored; a status per key (OK: receive its bytes)."""
        charge = charge if charge is not None else self.budgets.charge("")
        n = len(keys)
        status = [Status.OK] * n
        slots = [-1] * n
        seen: set[bytes] = set()
        candidates: list[int] = []
        replace: list[bytes] = []
        host = self.host
        for i, (key, size) in enumerate(zip(keys, sizes)):
            if not 0 < size <= self.slab.max_value_bytes:
                status[i] = Status.BAD_SIZE
            elif key in seen or key in host.storing or any(key in t.storing for t in self.manager.lower):
                status[i] = Status.BUSY  # written by another request (or copied down) right now
            elif self._held(key):
                if overwrite:
                    replace.append(key)
                    candidates.append(i)
                else:
                    status[i] = Status.PRESENT
            else:
                candidates.append(i)
            seen.add(key)
        if replace:
            self.manager.discard(replace)
        if self.when_full == "refuse" and len(candidates) > len(host.free_slots):
            for i in candidates[len(host.free_slots):]:
                status[i] = Status.FULL
            candidates = candidates[: len(host.free_slots)]
        # the budgets: a slot and the value's bytes each, in order; past a refusal every key is LIMIT
        taken = charge.take_many("r", [keys[i] for i in candidates], [sizes[i] for i in candidates])
        allowed = candidates[:taken]
        for i in candidates[taken:]:
            status[i] = Status.LIMIT
        plan = self.manager.prepare_store([keys[i] for i in allowed]) if allowed else None
        placed = dict(zip(plan.keys, plan.slots)) if plan is not None else {}
        stored: list[bytes] = []
        for i in allowed:
            slot = placed.get(keys[i])
            if slot is None:
                status[i] = Status.FULL
            else:
                slots[i] = slot
                stored.append(keys[i])
        charge.settle("r", stored, sum(sizes[i] for i in allowed if slots[i] >= 0))
        self.counters["put_keys"] += n
        return PutTicket(list(keys), list(sizes), status, slots, stored, charge)

    def end_put(self, ticket: PutTicket, ok: bool) -> None:
        """All bytes of the accepted keys arrived (``ok``) or the put failed: READY or gone."""
        if ticket.charge is not None:
            ticket.charge.release()
        if not ticket.stored:
            return
        if ok:
            for slot, size in zip(ticket.slots, ticket.sizes):
                if slot >= 0:
                    self.slab.seal(slot, size)
            self.counters["stored"] += len(ticket.stored)
        else:
            for i, slot in enumerate(ticket.slots):
                if slot >= 0:
                    ticket.status[i] = Status.FAILED
        self.manager.complete_store(ticket.stored, ok=ok)
        ticket.stored = []
        self.pump.wake()

    # ------------------------------------------------------------------ gets
    async def begin_get(self, keys: Sequence[bytes], capacities: Sequence[int],
                        charge: Charge | None = None) -> GetTicket:
        """Pin (staging from lower tiers first) the keys this get may send; a status per key."""
        charge = charge if charge is not None else self.budgets.charge("")
        unique = list(dict.fromkeys(keys))
        waits = [self._staging[k] for k in unique if k in self._staging]
        if waits:  # another get is reading these from a lower tier: wait for it, then share
            await asyncio.wait(waits)
        ticket = GetTicket(list(keys), [Status.MISS] * len(keys), [-1] * len(keys), [0] * len(keys), [],
                           charge=charge)
        host_sizes: dict[bytes, int] = {}  # a host hit's size, read once (its slot is pinned below)
        chosen = self._bound_get(keys, capacities, ticket.status, charge, host_sizes)
        plan = self.manager.prepare_load(chosen) if chosen else None
        slot_of: dict[bytes, int] = {}
        failed: set[bytes] = set()
        if plan is not None:
            ticket.pinned = list(plan.keys)
            slot_of = dict(zip(plan.keys, plan.slots))
            staged = [(k, t, s) for k, t, s, st in zip(plan.keys, plan.tiers, plan.slots, plan.staged) if st]
            ticket.lower_hits = len(staged)
            ticket.host_hits = len(plan.keys) - len(staged)
            if staged:
                ticket.staged = [k for k, _, _ in staged]
                loop = asyncio.get_running_loop()
                for key in ticket.staged:
                    self._staging[key] = loop.create_future()
                reading = asyncio.ensure_future(self.pump.stage(staged))
                try:
                    failed = await asyncio.shield(reading)
                except asyncio.CancelledError:
                    # The lower tier still writes into the staging slots: release them (and the
                    # pins) only when its job has reported, then let the cancellation through.
                    reading.add_done_callback(lambda _, t=ticket: self._abandon(t))
                    raise
        if failed:
            self.manager.complete_load(list(failed), failed=failed)  # frees their staging slots
            self.manager.discard(list(failed))  # the lower copy is bad: never again
            ticket.pinned = [k for k in ticket.pinned if k not in failed]
            self.counters["tier_failures"] += len(failed)
        for i, key in enumerate(keys):
            if ticket.status[i] is not Status.OK:
                continue  # refused before anything was pinned
            slot = slot_of.get(key)
            size = None if slot is None or key in failed else host_sizes.get(key) or self.slab.size_of(slot)
            if slot is None:
                ticket.status[i] = Status.MISS  # no host slot to stage it into
            elif size is None:
                ticket.status[i] = Status.FAILED
            elif size > capacities[i]:
                ticket.status[i] = Status.BAD_SIZE
            else:
                ticket.slots[i] = slot
                ticket.sizes[i] = size
        charge.settle("p", ticket.pinned, sum(ticket.sizes))
        hits = sum(1 for s in ticket.status if s is Status.OK)
        self.counters["get_keys"] += len(keys)
        self.counters["hits"] += hits
        self.counters["misses"] += len(keys) - hits
        self.counters["lower_hits"] += ticket.lower_hits
        return ticket

    def _bound_get(self, keys: Sequence[bytes], capacities: Sequence[int], status: list[Status],
                   charge: Charge, host_sizes: dict[bytes, int]) -> list[bytes]:
        """Which keys a get may serve, decided before any is pinned or staged (statuses set: OK for now;
        ``host_sizes``: filled with each host hit's size).

        A host hit is charged its size, a lower-tier hit its capacity (at most
        ``max_value_bytes``: its size is known only once it is read); a key
        charged again (twice in one get) costs its bytes again, not its slot.
        """
        host_ready = self.host.ready
        host_storing = self.host.storing
        lower_ready = [t.ready for t in self.manager.lower]
        wanted: list[int] = []
        wanted_sizes: list[int] = []
        for i, key in enumerate(keys):
            slot = host_ready.get(key)
            if slot is not None:
                size = self.slab.size_of(slot)
                if size is None:
                    status[i] = Status.FAILED
                    continue
                if size > capacities[i]:
                    status[i] = Status.BAD_SIZE
                    continue
                host_sizes[key] = size
            elif key not in host_storing and any(key in r for r in lower_ready):
                size = min(capacities[i], self.slab.max_value_bytes)
            else:
                continue  # MISS
            wanted.append(i)
            wanted_sizes.append(size)
        taken = charge.take_many("p", [keys[i] for i in wanted], wanted_sizes)
        for i in wanted[taken:]:
            status[i] = Status.LIMIT
        chosen: dict[bytes, None] = {}
        for i in wanted[:taken]:
            status[i] = Status.OK
            chosen[keys[i]] = None
        return list(chosen)

    def end_get(self, ticket: GetTicket) -> None:
        """The values were sent (or the send failed): unpin the slots (staged chunks stay in host)."""
        if ticket.charge is not None:
            ticket.charge.release()
        if ticket.pinned:
            self.manager.complete_load(ticket.pinned)
            ticket.pinned = []
            self.pump.wake()
        for key in ticket.staged:
            done = self._staging.pop(key, None)
            if done is not None and not done.done():
                done.set_result(None)
        ticket.staged = []

    def _abandon(self, ticket: GetTicket) -> None:
        """A get cancelled while staging: its staged chunks are dropped, every pin released."""
        self.manager.complete_load(ticket.pinned, failed=set(ticket.staged))
        ticket.pinned = []
        self.end_get(ticket)

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        for name, backend in self.backends.items():
            try:
                backend.close()
            except Exception:
                logger.exception("server tier %s: close failed", name)

    # ------------------------------------------------------------------ stats
    def tier_stats(self) -> list[TierStats]:
        out = []
        for tier in self.manager.tiers:
            name = tier.name
            if tier is self.host:
                used = tier.used_slots * self.slab.slot_bytes
            else:
                backend_stats = getattr(self.backends[name], "stats", None)
                stats = backend_stats() if callable(backend_stats) else {}
                used = int(stats.get("bytes_used", tier.used_slots * self._footprints[name]))
            s = tier.stats
            out.append(TierStats(
                name=name, backend=self._tier_backend[name], capacity_bytes=self._capacity[name],
                used_bytes=used, chunks=len(tier.ready), hit_chunks=s.hit_chunks,
                stored_chunks=s.stored_chunks, evictions=s.evictions,
            ))
        return out
