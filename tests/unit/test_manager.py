"""Unit tests of the scheduler-side OffloadingManager (tiercache/manager/offloading.py).

Every state transition of a chunk in a tier is exercised with both eviction
policies: absent -> STORING (prepare_store) -> READY (complete_store ok) or
absent again (complete_store failed); READY -> pinned (prepare_load) -> READY
(complete_load); READY -> absent (eviction, reset). A hypothesis state machine
then drives random operation sequences against a small model of the expected
directory and checks the invariants listed in manager.py's docstring.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tiercache.events import ChunkEvent, EventKind
from tiercache.manager.offloading import ChunkState, OffloadingManager, TierSpec
from tiercache.manager.plans import LoadPlan, StorePlan
from tiercache.manager.policies import POLICIES

NAMESPACE = b"\x01" * 8
GROUP = (0).to_bytes(4, "big")
HOST = "host"


def prefix_hash(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "big"), digest_size=32).digest()


def key(i: int) -> bytes:
    """A well-formed 44-byte chunk key: namespace digest | prefix hash | group."""
    return NAMESPACE + prefix_hash(i) + GROUP


def ks(*ids: int) -> list[bytes]:
    return [key(i) for i in ids]


@pytest.fixture(params=sorted(POLICIES))
def policy(request: pytest.FixtureRequest) -> str:
    return request.param


def manager(policy: str, slots: int) -> OffloadingManager:
    return OffloadingManager([TierSpec(HOST, slots, policy)])


def store(m: OffloadingManager, keys: list[bytes], ok: bool = True) -> StorePlan | None:
    """prepare_store + complete_store of whatever was planned."""
    plan = m.prepare_store(keys)
    if plan is not None:
        m.complete_store(list(plan.keys), ok=ok)
    return plan


def state(m: OffloadingManager, k: bytes) -> ChunkState | None:
    found = m.state_of(k)
    return None if found is None else found[0]


def pins(m: OffloadingManager, k: bytes) -> int:
    found = m.state_of(k)
    assert found is not None
    return found[2]


def used(m: OffloadingManager) -> int:
    return m.usage()[HOST][0]


def removed_keys(events: list[ChunkEvent]) -> list[bytes]:
    return [k for e in events if e.kind is EventKind.REMOVED for k in e.keys]


# ------------------------------------------------------------------------ construction
def test_constructor_validates_tiers() -> None:
    with pytest.raises(ValueError):
        OffloadingManager([])
    with pytest.raises(ValueError):
        OffloadingManager([TierSpec("a", 1), TierSpec("a", 2)])
    with pytest.raises(ValueError):
        OffloadingManager([TierSpec("a", -1)])
    with pytest.raises(ValueError, match="lru"):
        OffloadingManager([TierSpec("a", 1, "fifo")])


def test_new_manager_is_empty(policy: str) -> None:
    m = manager(policy, 4)
    assert m.usage() == {HOST: (0, 4)}
    assert m.events.take() == []
    stats = m.stats()
    assert (stats.lookups, stats.lookup_chunks, stats.lookup_hit_chunks) == (0, 0, 0)
    assert set(stats.tiers[HOST].as_dict().values()) == {0}


# ----------------------------------------------------------------------------- lookup
def test_lookup_on_empty_manager(policy: str) -> None:
    m = manager(policy, 4)
    assert m.lookup([]) == 0
    assert m.lookup(ks(0, 1, 2)) == 0


def test_lookup_counts_longest_ready_prefix(policy: str) -> None:
    m = manager(policy, 8)
    store(m, ks(0, 1, 2))
    assert m.lookup(ks(0, 1, 2)) == 3  # full
    assert m.lookup(ks(0, 1, 2, 3, 4)) == 3  # partial
    assert m.lookup(ks(0, 3, 1)) == 1  # stops at the first miss
    assert m.lookup(ks(5, 0, 1)) == 0  # leading miss
    assert m.lookup(ks(2, 1)) == 2  # order of the prefix is the caller's


def test_lookup_has_no_side_effects_on_order(policy: str) -> None:
    m = manager(policy, 2)
    store(m, ks(0))
    store(m, ks(1))
    m.lookup(ks(0))  # a lookup is not an access
    plan = store(m, ks(2))
    assert plan is not None and plan.evicted == (key(0),)


# ------------------------------------------------------------------------------ store
def test_prepare_store_then_complete_ok_makes_ready(policy: str) -> None:
    m = manager(policy, 4)
    plan = m.prepare_store(ks(0, 1))
    assert plan is not None
    assert plan.tier == HOST and plan.keys == tuple(ks(0, 1))
    assert len(set(plan.slots)) == 2 and all(0 <= s < 4 for s in plan.slots)
    assert plan.evicted == () and plan.skipped_present == 0
    for k, slot in zip(plan.keys, plan.slots):
        assert m.state_of(k) == (ChunkState.STORING, slot, 0)
    assert m.lookup(ks(0, 1)) == 0  # STORING is a miss
    assert used(m) == 2

    m.complete_store(ks(0, 1), ok=True)
    for k, slot in zip(plan.keys, plan.slots):
        assert m.state_of(k) == (ChunkState.READY, slot, 0)
    assert m.lookup(ks(0, 1)) == 2
    assert m.stats().tiers[HOST].stored_chunks == 2


def test_failed_store_leaves_no_trace(policy: str) -> None:
    m = manager(policy, 2)
    plan = m.prepare_store(ks(0, 1))
    assert plan is not None
    m.events.take()
    m.complete_store(ks(0, 1), ok=False)
    assert m.state_of(key(0)) is None and m.state_of(key(1)) is None
    assert m.lookup(ks(0)) == 0
    assert used(m) == 0
    assert m.events.take() == []  # nothing was ever stored
    tier = m.stats().tiers[HOST]
    assert (tier.store_failures, tier.stored_chunks, tier.evictions) == (2, 0, 0)
    # Both slots are free again: a full-size store fits without evicting.
    again = m.prepare_store(ks(2, 3))
    assert again is not None and again.evicted == ()
    assert sorted(again.slots) == sorted(plan.slots)


def test_partly_failed_store(policy: str) -> None:
    m = manager(policy, 4)
    m.prepare_store(ks(0, 1, 2))
    m.complete_store(ks(0, 2), ok=True)
    m.complete_store(ks(1), ok=False)
    assert m.lookup(ks(0, 1, 2)) == 1
    assert state(m, key(2)) is ChunkState.READY and state(m, key(1)) is None
    assert used(m) == 2


def test_complete_store_ignores_unknown_and_ready_keys(policy: str) -> None:
    m = manager(policy, 4)
    m.complete_store(ks(9), ok=True)
    m.complete_store(ks(9), ok=False)
    store(m, ks(0))
    m.events.take()
    m.complete_store(ks(0), ok=True)  # already READY: no double count, no event
    m.complete_store(ks(0), ok=False)  # a READY chunk is not dropped by a late failure
    assert state(m, key(0)) is ChunkState.READY
    tier = m.stats().tiers[HOST]
    assert (tier.stored_chunks, tier.store_failures) == (1, 0)
    assert m.events.take() == [] and used(m) == 1


def test_storing_keys_are_never_evicted(policy: str) -> None:
    m = manager(policy, 2)
    assert m.prepare_store(ks(0, 1)) is not None  # both STORING, tier full
    assert m.prepare_store(ks(2)) is None
    assert state(m, key(0)) is ChunkState.STORING and state(m, key(1)) is ChunkState.STORING
    assert m.stats().tiers[HOST].store_refused == 1
    m.complete_store(ks(0, 1))
    plan = m.prepare_store(ks(2))
    # A chain's tail goes first: its head is what every later chunk depends on.
    assert plan is not None and plan.evicted == (key(1),)


def test_storing_key_skipped_when_mixed_with_ready(policy: str) -> None:
    m = manager(policy, 2)
    store(m, ks(0))
    m.prepare_store(ks(1))  # STORING
    plan = m.prepare_store(ks(2, 3))
    assert plan is not None
    assert plan.keys == (key(2),) and plan.evicted == (key(0),)
    assert state(m, key(1)) is ChunkState.STORING
    assert m.stats().tiers[HOST].store_refused == 1


def test_partial_plan_covers_a_leading_part(policy: str) -> None:
    m = manager(policy, 3)
    store(m, ks(0, 1))
    m.prepare_load(ks(0))  # pinned
    plan = m.prepare_store(ks(5, 6, 7))
    assert plan is not None
    assert plan.keys == (key(5), key(6))  # a prefix of what was missing
    assert plan.evicted == (key(1),)
    assert len(set(plan.slots)) == 2
    assert m.stats().tiers[HOST].store_refused == 1
    assert state(m, key(7)) is None
    assert used(m) == 3


def test_full_tier_of_pinned_and_storing_refuses(policy: str) -> None:
    m = manager(policy, 3)
    store(m, ks(0, 1))
    m.prepare_load(ks(0, 1))
    m.prepare_store(ks(2))  # STORING
    m.events.take()
    assert m.prepare_store(ks(3, 4)) is None  # never raises
    assert m.stats().tiers[HOST].store_refused == 2
    assert m.stats().tiers[HOST].evictions == 0
    assert m.events.take() == []
    assert used(m) == 3
    assert [state(m, k) for k in ks(0, 1, 2)] == [
        ChunkState.READY,
        ChunkState.READY,
        ChunkState.STORING,
    ]


def test_zero_slot_tier_refuses_everything(policy: str) -> None:
    m = manager(policy, 0)
    assert m.prepare_store(ks(0, 1)) is None
    assert m.stats().tiers[HOST].store_refused == 2
    assert m.usage() == {HOST: (0, 0)}


def test_duplicate_keys_in_one_prepare_store(policy: str) -> None:
    m = manager(policy, 4)
    plan = m.prepare_store(ks(0, 1, 0, 1, 2))
    assert plan is not None
    assert plan.keys == tuple(ks(0, 1, 2))
    assert len(set(plan.slots)) == 3
    assert used(m) == 3


def test_present_keys_are_skipped_and_touched(policy: str) -> None:
    m = manager(policy, 3)
    store(m, ks(0))
    store(m, ks(1))
    store(m, ks(2))
    plan = m.prepare_store(ks(0, 3))
    assert plan is not None
    assert plan.keys == (key(3),) and plan.skipped_present == 1
    assert plan.evicted == (key(1),)  # key 0 was touched by the store offer
    assert state(m, key(0)) is ChunkState.READY


def test_all_present_returns_none(policy: str) -> None:
    m = manager(policy, 3)
    store(m, ks(0, 1))
    assert m.prepare_store(ks(0, 1)) is None
    assert m.prepare_store([]) is None
    assert m.stats().tiers[HOST].store_refused == 0


def test_store_never_evicts_a_key_of_its_own_offer(policy: str) -> None:
    """Evicting key 1 to store key 2 would break the prefix [1, 2] it belongs to."""
    m = manager(policy, 2)
    store(m, ks(0, 1))
    m.prepare_load(ks(0))  # the only other candidate is pinned
    assert m.prepare_store(ks(1, 2)) is None
    assert state(m, key(1)) is ChunkState.READY
    assert m.stats().tiers[HOST].store_refused == 1


def test_slots_are_reused_after_eviction(policy: str) -> None:
    m = manager(policy, 2)
    first = store(m, ks(0, 1))
    second = store(m, ks(2, 3))
    assert first is not None and second is not None
    assert sorted(second.slots) == sorted(first.slots)
    assert set(second.evicted) == set(ks(0, 1))


# ------------------------------------------------------------------------------- load
def test_prepare_load_pins_and_returns_plan(policy: str) -> None:
    m = manager(policy, 4)
    stored = store(m, ks(0, 1))
    assert stored is not None
    plan = m.prepare_load(ks(0, 1))
    assert isinstance(plan, LoadPlan)
    assert plan.keys == tuple(ks(0, 1)) and plan.tiers == (HOST, HOST)
    assert plan.slots == stored.slots
    assert pins(m, key(0)) == 1 and pins(m, key(1)) == 1
    m.prepare_load(ks(0))
    assert pins(m, key(0)) == 2
    m.complete_load(ks(0, 1))
    assert pins(m, key(0)) == 1 and pins(m, key(1)) == 0
    m.complete_load(ks(0))
    assert pins(m, key(0)) == 0
    m.complete_load(ks(0))  # extra completion: ignored, never negative
    assert pins(m, key(0)) == 0


def test_prepare_load_of_missing_key_raises_and_pins_nothing(policy: str) -> None:
    m = manager(policy, 4)
    store(m, ks(0))
    m.prepare_store(ks(1))  # STORING is not loadable either
    with pytest.raises(KeyError):
        m.prepare_load(ks(0, 2))
    with pytest.raises(KeyError):
        m.prepare_load(ks(0, 1))
    assert pins(m, key(0)) == 0
    assert m.stats().tiers[HOST].loads == 0


def test_pinned_key_is_never_evicted(policy: str) -> None:
    m = manager(policy, 2)
    store(m, ks(0))
    store(m, ks(1))
    load = m.prepare_load(ks(0))
    m.touch(ks(1))  # key 0 is now the policy's first candidate, but pinned
    for i in range(2, 12):  # the tier churns while the load is in flight
        plan = store(m, ks(i))
        assert plan is not None
        assert key(0) not in plan.evicted
        assert load.slots[0] not in plan.slots  # its slot is never handed out
        assert m.state_of(key(0)) == (ChunkState.READY, load.slots[0], 1)
    m.complete_load(ks(0))
    plan = store(m, ks(20, 21))
    assert plan is not None and key(0) in plan.evicted


def test_load_then_complete_allows_eviction(policy: str) -> None:
    m = manager(policy, 1)
    store(m, ks(0))
    m.prepare_load(ks(0))
    assert m.prepare_store(ks(1)) is None
    m.complete_load(ks(0))
    plan = m.prepare_store(ks(1))
    assert plan is not None and plan.evicted == (key(0),)


# ------------------------------------------------------------------------------ touch
def test_touch_changes_eviction_order(policy: str) -> None:
    m = manager(policy, 3)
    for i in range(3):
        store(m, ks(i))
    m.touch(ks(0))
    plan = store(m, ks(3))
    assert plan is not None and plan.evicted == (key(1),)


def test_touch_ignores_missing_and_storing_keys(policy: str) -> None:
    m = manager(policy, 2)
    store(m, ks(0))
    m.prepare_store(ks(1))
    m.touch(ks(7, 1))
    assert m.state_of(key(7)) is None
    assert state(m, key(1)) is ChunkState.STORING


# ----------------------------------------------------------------------------- events
def test_events_stored_removed_and_drained(policy: str) -> None:
    m = manager(policy, 2)
    store(m, ks(0, 1))
    events = m.events.take()
    assert events == [ChunkEvent(EventKind.STORED, HOST, tuple(ks(0, 1)))]
    assert events[0].prefix_hashes() == [prefix_hash(0), prefix_hash(1)]
    assert m.events.take() == []

    store(m, ks(2))
    assert m.events.take() == [
        ChunkEvent(EventKind.REMOVED, HOST, (key(1),)),
        ChunkEvent(EventKind.STORED, HOST, (key(2),)),
    ]
    m.reset()
    events = m.events.take()
    assert [e.kind for e in events] == [EventKind.REMOVED]
    assert set(events[0].keys) == {key(0), key(2)}
    assert m.events.take() == []


def test_failed_store_emits_no_event_but_frees(policy: str) -> None:
    m = manager(policy, 1)
    m.prepare_store(ks(0))
    m.complete_store(ks(0), ok=False)
    assert m.events.take() == []


# ------------------------------------------------------------------------------ stats
def test_stats_counters(policy: str) -> None:
    m = manager(policy, 2)
    store(m, ks(0, 1))
    m.lookup(ks(0, 1, 2))
    m.lookup(ks(3))
    m.prepare_load(ks(0, 1))
    m.complete_load(ks(0, 1))
    store(m, ks(4), ok=False)  # evicts one to make room, then fails
    survivor = [k for k in ks(0, 1) if state(m, k) is not None]
    assert len(survivor) == 1
    m.prepare_load(survivor)  # pinned: the next store cannot evict it
    assert m.prepare_store(ks(5, 6)) is not None  # one fits, one refused
    stats = m.stats()
    assert (stats.lookups, stats.lookup_chunks, stats.lookup_hit_chunks) == (2, 4, 2)
    tier = stats.tiers[HOST]
    assert tier.stored_chunks == 2
    assert tier.store_failures == 1
    assert tier.evictions == 1
    assert tier.store_refused == 1
    assert tier.loads == 3 and tier.hit_chunks == 3


def test_stats_is_a_snapshot(policy: str) -> None:
    m = manager(policy, 2)
    snap = m.stats()
    snap.tiers[HOST].stored_chunks = 99
    store(m, ks(0))
    assert m.stats().tiers[HOST].stored_chunks == 1
    assert snap.tiers[HOST].stored_chunks == 99


# ------------------------------------------------------------------ reset / shutdown
def test_reset_drops_only_ready_unpinned(policy: str) -> None:
    m = manager(policy, 5)
    store(m, ks(0, 1, 2))
    load = m.prepare_load(ks(0))
    m.prepare_store(ks(3))  # STORING
    m.events.take()
    assert m.reset() == 2
    assert [e.kind for e in m.events.take()] == [EventKind.REMOVED]
    assert m.state_of(key(0)) == (ChunkState.READY, load.slots[0], 1)
    assert state(m, key(3)) is ChunkState.STORING
    assert state(m, key(1)) is None and state(m, key(2)) is None
    assert used(m) == 2
    m.complete_store(ks(3))
    assert m.lookup(ks(3)) == 1
    m.complete_load(ks(0))
    plan = store(m, ks(4, 5, 6, 7))  # 3 free slots + 1 evicted (key 0 or key 3)
    assert plan is not None and len(plan.keys) == 4
    assert len(plan.evicted) == 1 and plan.evicted[0] in (key(0), key(3))


def test_reset_of_empty_manager(policy: str) -> None:
    m = manager(policy, 3)
    assert m.reset() == 0
    assert m.events.take() == []


def test_shutdown_forgets_everything(policy: str) -> None:
    m = manager(policy, 3)
    store(m, ks(0, 1))
    m.prepare_load(ks(0))
    m.shutdown()
    assert m.usage() == {HOST: (0, 3)}
    assert m.lookup(ks(0)) == 0
    assert m.prepare_store(ks(2, 3, 4)) is not None


# ----------------------------------------------------------------------- several tiers
def place_in_lower_tier(m: OffloadingManager, tier_name: str, k: bytes) -> int:
    """Make ``k`` READY in a lower tier only, as after a restart (``adopt``)."""
    assert m.cascade.adopt(tier_name, [k]) == []
    return m.state_of(k, tier_name)[1]  # type: ignore[index]


def two_tiers(policy: str, host: int = 2, disk: int = 4, mode: str = "write_through") -> OffloadingManager:
    return OffloadingManager([TierSpec(HOST, host, policy), TierSpec("disk", disk, policy, mode)])  # type: ignore[arg-type]


def test_lookup_and_staged_load_across_tiers(policy: str) -> None:
    m = two_tiers(policy, mode="write_back")  # no copies go down on their own here
    store(m, ks(0))
    disk_slot = place_in_lower_tier(m, "disk", key(1))
    assert m.usage() == {HOST: (1, 2), "disk": (1, 4)}
    assert m.lookup(ks(0, 1, 2)) == 2
    plan = m.prepare_load(ks(0, 1))
    assert plan.tiers == (HOST, "disk") and plan.staged == (False, True)
    staging = plan.slots[1]
    assert m.state_of(key(1), HOST) == (ChunkState.STORING, staging, 0)  # host slot reserved
    assert m.state_of(key(1), "disk") == (ChunkState.READY, disk_slot, 1)  # source pinned
    assert m.lookup(ks(1)) == 0  # busy while staged: a second load would race the first
    m.complete_load(ks(0, 1))
    assert pins(m, key(0)) == 0
    assert m.state_of(key(1), "disk") == (ChunkState.READY, disk_slot, 0)
    assert m.state_of(key(1), HOST) == (ChunkState.READY, staging, 0)  # promoted
    with pytest.raises(KeyError):
        m.prepare_load(ks(1, 2))
    assert m.reset() == 3
    assert m.usage() == {HOST: (0, 2), "disk": (0, 4)}
    assert m.deletes.take() == {"disk": [key(1)]}


def test_failed_staged_load_frees_staging_and_discard_deletes(policy: str) -> None:
    m = two_tiers(policy)
    place_in_lower_tier(m, "disk", key(0))
    plan = m.prepare_load(ks(0))
    m.complete_load(ks(0), failed={key(0)})
    assert m.state_of(key(0), HOST) is None and plan.slots[0] in m.host.free_slots
    assert m.discard(ks(0)) == 1  # the caller drops the bad chunk from its tier
    assert m.lookup(ks(0)) == 0 and m.deletes.take() == {"disk": [key(0)]}


def test_staging_evicts_host_but_stops_when_no_room(policy: str) -> None:
    m = two_tiers(policy, host=1, mode="write_back")
    store(m, ks(5))
    m.prepare_load(ks(5))  # pinned: the only host slot cannot be used for staging
    for i in (0, 1):
        place_in_lower_tier(m, "disk", key(i))
    plan = m.prepare_load(ks(0, 1))
    assert plan.keys == ()
    assert m.state_of(key(0), "disk")[2] == 0  # type: ignore[index]  # nothing pinned for a miss
    m.complete_load(ks(5))
    plan = m.prepare_load(ks(0, 1))
    assert plan.keys == (key(0),)  # one staging slot (host key 5 evicted), the rest is a miss
    assert m.state_of(key(5), HOST) is None


def test_write_through_demotes_every_store(policy: str) -> None:
    m = two_tiers(policy)
    store(m, ks(0, 1))
    (plan,) = m.cascade.prepare_demotions()
    assert plan.tier == "disk" and plan.keys == (key(0), key(1))
    assert plan.host_slots == (m.state_of(key(0), HOST)[1], m.state_of(key(1), HOST)[1])  # type: ignore[index]
    assert pins(m, key(0)) == 1  # the host copy is pinned while the backend reads it
    assert m.cascade.prepare_demotions() == []
    m.cascade.complete_demotion("disk", plan.keys, failed={key(1)})
    assert pins(m, key(0)) == 0
    assert m.state_of(key(0), "disk")[0] is ChunkState.READY  # type: ignore[index]
    assert m.state_of(key(1), "disk") is None
    assert m.stats().tiers["disk"].store_failures == 1
    store(m, ks(2))  # host full: evicts key 1 (LRU tail); key 0 stays on disk anyway
    (plan,) = m.cascade.prepare_demotions()
    assert plan.keys == (key(2),)


def test_write_through_chunks_are_not_evicted_before_their_copy(policy: str) -> None:
    m = two_tiers(policy)
    store(m, ks(0, 1))  # both queued for the disk tier: pinned in the host tier
    assert store(m, ks(2)) is None  # no room: nothing evictable yet
    (plan,) = m.cascade.prepare_demotions()
    m.cascade.complete_demotion("disk", plan.keys)
    assert pins(m, key(0)) == pins(m, key(1)) == 0
    plan2 = store(m, ks(2))
    assert plan2 is not None and len(plan2.evicted) == 1
    assert m.lookup(ks(0, 1)) == 2  # the evicted one is still on disk


def test_reset_abandons_pending_write_through_copies(policy: str) -> None:
    m = two_tiers(policy)
    store(m, ks(0, 1))
    assert m.reset() == 2 and m.cascade.prepare_demotions() == []
    assert m.usage() == {HOST: (0, 2), "disk": (0, 4)}


def test_held_back_chunks_go_down_only_once_released(policy: str) -> None:
    """A live request's partial chunks (connector/partial_chunks.py) stay in the host tier until released."""
    m = two_tiers(policy, host=4, disk=4)
    m.cascade.hold_back(ks(0))
    store(m, ks(0, 1))
    (plan,) = m.cascade.prepare_demotions()
    assert plan.keys == (key(1),) and pins(m, key(0)) == 0  # not queued, so not pinned
    m.cascade.complete_demotion("disk", plan.keys)
    m.cascade.release_held_back(ks(0, 1))  # key 1 was never held back: ignored
    (plan,) = m.cascade.prepare_demotions()
    assert plan.keys == (key(0),)
    # released while its store is in flight: queued when the store completes
    m.cascade.hold_back(ks(2))
    stored = m.prepare_store(ks(2))
    m.cascade.release_held_back(ks(2))
    assert m.cascade.prepare_demotions() == []  # not READY yet
    m.complete_store(list(stored.keys))  # type: ignore[union-attr]
    (plan,) = m.cascade.prepare_demotions()
    assert plan.keys == (key(2),)


def test_a_held_back_chunk_discarded_never_goes_down(policy: str) -> None:
    m = two_tiers(policy, host=4, disk=4)
    m.cascade.hold_back(ks(0, 1))
    store(m, ks(0))
    stored = m.prepare_store(ks(1))
    assert m.discard(ks(0, 1)) == 1  # key 0 READY; key 1's store still in flight
    m.complete_store(list(stored.keys))  # type: ignore[union-attr]
    assert state(m, key(1)) is None and m.usage()[HOST] == (0, 4)  # never READY, its slot free again
    m.cascade.release_held_back(ks(0, 1))  # forgotten when discarded: nothing to release
    assert m.cascade.prepare_demotions() == []
    store(m, ks(1))  # the same key stored again later is an ordinary store
    assert state(m, key(1)) is ChunkState.READY


def test_write_back_leaves_held_back_chunks(policy: str) -> None:
    m = two_tiers(policy, host=2, mode="write_back")
    m.cascade.hold_back(ks(0))
    store(m, ks(0, 1))
    (plan,) = m.cascade.prepare_demotions()
    assert plan.keys == (key(1),)


def test_lower_tier_eviction_queues_deletes(policy: str) -> None:
    m = two_tiers(policy, host=4, disk=2)
    store(m, ks(0, 1))
    (p1,) = m.cascade.prepare_demotions()
    m.cascade.complete_demotion("disk", p1.keys)
    store(m, ks(2))
    (p2,) = m.cascade.prepare_demotions()
    assert p2.keys == (key(2),)
    deletes = m.deletes.take()["disk"]
    assert len(deletes) == 1 and deletes[0] in (key(0), key(1))
    assert m.usage()["disk"] == (2, 2)


def test_write_back_demotes_cold_chunks_above_watermark(policy: str) -> None:
    m = two_tiers(policy, host=4, mode="write_back")
    store(m, ks(0, 1))
    assert m.cascade.prepare_demotions() == []  # half full: nothing to do
    store(m, ks(2, 3))
    plans = m.cascade.prepare_demotions(max_keys=2)
    assert len(plans) == 1 and len(plans[0].keys) == 2


def test_adopt_respects_budget(policy: str) -> None:
    m = two_tiers(policy, disk=2)
    extra = m.cascade.adopt("disk", ks(0, 1, 2))
    assert len(extra) == 1 and m.usage()["disk"] == (2, 2)
    assert m.lookup(ks(0, 1)) == 2


# --------------------------------------------------------------- state machine (random)
class ManagerMachine(RuleBasedStateMachine):
    """Random operation sequences against a model of the expected directory.

    The model holds, per key, its state, slot and pin count. Every victim must
    be allowed (READY, unpinned, not part of the offer); with LRU the model also
    keeps the recency order and checks the victims are exactly the least
    recently used allowed keys (ARC's choice is only checked to be allowed).
    """

    POLICY = "lru"
    NUM_KEYS = 14
    CAPACITY = 5

    def __init__(self) -> None:
        super().__init__()
        self.m = manager(self.POLICY, self.CAPACITY)
        self.state: dict[bytes, ChunkState] = {}
        self.slot: dict[bytes, int] = {}
        self.pins: dict[bytes, int] = {}
        self.pending_stores: list[tuple[bytes, ...]] = []
        self.pending_loads: list[tuple[bytes, ...]] = []
        self.events: list[tuple[EventKind, list[bytes]]] = []
        self.recency: dict[bytes, None] = {}  # READY keys, least recently used first
        self.doomed: dict[bytes, list[int]] = {}  # discarded while pinned: key -> slots held
        self.discarded_storing: set[bytes] = set()  # discarded while their store was in flight

    # ---- helpers
    def _use(self, keys: Iterable[bytes]) -> None:
        # The manager marks a request's keys last-first: the prefix head ends most recent.
        for k in reversed(list(keys)):
            if self.state.get(k) is ChunkState.READY:
                self.recency.pop(k, None)
                self.recency[k] = None

    def _doomed_slots(self) -> int:
        return sum(len(held) for held in self.doomed.values())

    def _ready(self) -> list[bytes]:
        return [k for k, s in self.state.items() if s is ChunkState.READY]

    def _evictable(self, offer: set[bytes]) -> list[bytes]:
        return [k for k in self._ready() if self.pins[k] == 0 and k not in offer]

    def _forget(self, k: bytes) -> None:
        del self.state[k], self.slot[k]
        if k not in self.doomed:  # a doomed key's pins belong to its old load
            del self.pins[k]
        self.recency.pop(k, None)

    # ---- rules
    @rule(ids=st.lists(st.integers(0, NUM_KEYS - 1), min_size=1, max_size=6))
    def prepare_store(self, ids: list[int]) -> None:
        offer = ks(*ids)
        missing = list(dict.fromkeys(k for k in offer if k not in self.state))
        free = self.CAPACITY - len(self.state) - self._doomed_slots()
        evictable = set(self._evictable(set(offer)))
        plan = self.m.prepare_store(offer)
        self._use(offer)  # present READY keys of the offer are touched
        if plan is None:
            assert not missing or (free == 0 and not evictable)
            return
        assert plan.keys == tuple(missing[: len(plan.keys)])
        assert len(plan.keys) == min(len(missing), free + len(evictable))
        assert set(plan.evicted) <= evictable
        assert len(plan.evicted) == max(0, len(plan.keys) - free)
        if self.POLICY == "lru":
            lru_first = [k for k in self.recency if k in evictable]
            assert list(plan.evicted) == lru_first[: len(plan.evicted)]
        for k in plan.evicted:
            self._forget(k)
        if plan.evicted:
            self.events.append((EventKind.REMOVED, sorted(plan.evicted)))
        taken = set(self.slot.values()) | {x for held in self.doomed.values() for x in held}
        assert len(set(plan.slots)) == len(plan.slots)
        assert not taken & set(plan.slots), "a slot was handed to two keys"
        for k, s in zip(plan.keys, plan.slots):
            self.state[k], self.slot[k] = ChunkState.STORING, s
            self.pins.setdefault(k, 0)
        self.pending_stores.append(plan.keys)

    @precondition(lambda self: self.pending_stores)
    @rule(
        index=st.integers(0, 99),
        ok=st.sampled_from([True, True, True, False]),
        failed_tail=st.sampled_from([0, 0, 0, 1, 2]),
    )
    def complete_store(self, index: int, ok: bool, failed_tail: int) -> None:
        keys = self.pending_stores.pop(index % len(self.pending_stores))
        # A job completes in two calls, its failed chunks separately, as the connector does.
        cut = max(0, len(keys) - failed_tail)
        done, failed = keys[:cut], keys[cut:]
        self.m.complete_store(list(done), ok=ok)
        self.m.complete_store(list(failed), ok=False)
        gone = self.discarded_storing.intersection(keys)  # never READY: their slots are free again
        self.discarded_storing -= gone
        for k in gone:
            self._forget(k)
        done = tuple(k for k in done if k not in gone)
        failed = tuple(k for k in failed if k not in gone)
        if ok and done:
            self.events.append((EventKind.STORED, sorted(done)))
        for k in done:
            if ok:
                self.state[k] = ChunkState.READY
            else:
                self._forget(k)
        if ok:
            self._use(done)
        for k in failed:
            self._forget(k)

    @precondition(lambda self: self.pending_stores)
    @rule()
    def complete_all_stores(self) -> None:
        """The transfer side drains: every job in flight succeeds."""
        while self.pending_stores:
            self.complete_store(0, ok=True, failed_tail=0)

    @rule(ids=st.lists(st.integers(0, NUM_KEYS - 1), max_size=6))
    def lookup(self, ids: list[int]) -> None:
        expected = 0
        for k in ks(*ids):
            if self.state.get(k) is not ChunkState.READY:
                break
            expected += 1
        assert self.m.lookup(ks(*ids)) == expected

    @rule(data=st.data())
    def prepare_load(self, data: st.DataObject) -> None:
        ready = self._ready()
        if not ready:
            return
        keys = tuple(data.draw(st.lists(st.sampled_from(ready), min_size=1, max_size=4)))
        plan = self.m.prepare_load(keys)
        assert plan.slots == tuple(self.slot[k] for k in keys)
        self._use(keys)
        for k in keys:
            self.pins[k] += 1
        self.pending_loads.append(keys)

    @rule(id_=st.integers(0, NUM_KEYS - 1))
    def prepare_load_missing(self, id_: int) -> None:
        k = key(id_)
        if self.state.get(k) is ChunkState.READY:
            return
        before = {x: self.pins[x] for x in self._ready()}
        with pytest.raises(KeyError):
            self.m.prepare_load(self._ready()[:1] + [k])
        assert all(self.m.state_of(x)[2] == before[x] for x in before)  # type: ignore[index]

    @precondition(lambda self: self.pending_loads)
    @rule(index=st.integers(0, 99))
    def complete_load(self, index: int) -> None:
        keys = self.pending_loads.pop(index % len(self.pending_loads))
        self.m.complete_load(keys)
        for k in keys:
            self.pins[k] -= 1
            if self.pins[k] == 0 and k in self.doomed:
                del self.doomed[k]  # its last load is done: the slot is free again
                if k not in self.state:
                    del self.pins[k]

    @rule(data=st.data())
    def discard(self, data: st.DataObject) -> None:
        """A load failed: its chunks are dropped (doomed while still pinned)."""
        ready = self._ready()
        if not ready:
            return
        keys = data.draw(st.lists(st.sampled_from(ready), min_size=1, max_size=3, unique=True))
        assert self.m.discard(keys) == len(keys)
        assert self.m.lookup(keys[:1]) == 0
        for k in keys:
            if self.pins[k]:
                self.doomed.setdefault(k, []).append(self.slot[k])
            self._forget(k)
        self.events.append((EventKind.REMOVED, sorted(keys)))

    @rule(data=st.data())
    def discard_storing(self, data: st.DataObject) -> None:
        """A store in flight is superseded (a partial chunk): a miss, and never READY when it completes."""
        storing = [k for k, s in self.state.items() if s is ChunkState.STORING]
        if not storing:
            return
        k = data.draw(st.sampled_from(storing))
        assert self.m.discard([k]) == 0  # nothing READY dropped now
        assert self.m.lookup([k]) == 0
        self.discarded_storing.add(k)

    @rule(ids=st.lists(st.integers(0, NUM_KEYS - 1), max_size=4))
    def touch(self, ids: list[int]) -> None:
        self.m.touch(ks(*ids))
        self._use(ks(*ids))

    @precondition(lambda self: len(self.state) == self.CAPACITY)
    @rule()
    def reset(self) -> None:
        dropped = [k for k in self._ready() if self.pins[k] == 0]
        assert self.m.reset() == len(dropped)
        for k in dropped:
            self._forget(k)
        if dropped:
            self.events.append((EventKind.REMOVED, sorted(dropped)))

    # ---- invariants
    @invariant()
    def directory_matches_model(self) -> None:
        used_slots, total = self.m.usage()[HOST]
        assert used_slots == len(self.state) + self._doomed_slots() <= total == self.CAPACITY
        held = list(self.slot.values()) + [x for h in self.doomed.values() for x in h]
        assert len(set(held)) == len(held)
        for k, s in self.state.items():
            pins = self.pins[k] if s is ChunkState.READY else 0
            assert self.m.state_of(k) == (s, self.slot[k], pins)
        for i in range(self.NUM_KEYS):
            if key(i) not in self.state:
                assert self.m.state_of(key(i)) is None

    @invariant()
    def events_match_model(self) -> None:
        got = [(e.kind, sorted(e.keys)) for e in self.m.events.take()]
        assert all(e_keys for _, e_keys in got), "an event without keys"
        assert got == self.events
        self.events = []

    @invariant()
    def pinned_keys_are_ready(self) -> None:
        for k, n in self.pins.items():
            assert n >= 0
            if n:
                assert k in self.doomed or self.state[k] is ChunkState.READY


def _machine_for(policy: str) -> type[ManagerMachine]:
    return type(f"ManagerMachine_{policy}", (ManagerMachine,), {"POLICY": policy})


_MACHINE_SETTINGS = settings(
    max_examples=100,
    stateful_step_count=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestManagerMachineLRU = _machine_for("lru").TestCase
TestManagerMachineLRU.settings = _MACHINE_SETTINGS
TestManagerMachineARC = _machine_for("arc").TestCase
TestManagerMachineARC.settings = _MACHINE_SETTINGS


# ---------------------------------------------------------------- discard (failed loads)
def test_discard_unpinned_is_a_miss_and_frees_its_slot(policy: str) -> None:
    m = manager(policy, 2)
    store(m, ks(0, 1))
    m.events.take()
    assert m.discard(ks(1)) == 1
    assert m.lookup(ks(0, 1)) == 1 and used(m) == 1
    assert m.events.take() == [ChunkEvent(EventKind.REMOVED, HOST, (key(1),))]
    assert m.discard(ks(1, 7)) == 0  # already gone, never stored: nothing to drop


def test_discard_pinned_holds_slot_until_the_load_completes(policy: str) -> None:
    m = manager(policy, 2)
    store(m, ks(0, 1))
    (held,) = m.prepare_load(ks(0)).slots
    assert m.discard(ks(0)) == 1
    assert m.lookup(ks(0)) == 0  # a miss at once: vLLM recomputes instead of retrying
    assert used(m) == 2  # the in-flight load still reads the slot
    plan = store(m, ks(2))  # room comes from evicting key 1, never from the held slot
    assert plan is not None and plan.slots[0] != held and plan.evicted == (key(1),)
    m.complete_load(ks(0))
    assert used(m) == 1 and held in m.tiers[0].free_slots


def test_discard_restore_discard_while_pinned_leaks_no_slot(policy: str) -> None:
    m = manager(policy, 3)
    store(m, ks(0))
    m.prepare_load(ks(0))
    m.discard(ks(0))
    store(m, ks(0))  # stored again while the old load still pins the key
    m.discard(ks(0))
    assert used(m) == 2
    m.complete_load(ks(0))
    assert used(m) == 0


def test_direct_tier_loads_without_a_host_staging_slot(policy: str) -> None:
    """A P/D producer in mode direct: its chunks land in engine blocks, no host slot is taken."""
    m = OffloadingManager([TierSpec(HOST, 1, policy), TierSpec("disk", 4, policy, "write_back"),
                           TierSpec("peer_direct", 8, "lru", "read_only", shared=True, direct=True)])
    store(m, ks(5))
    m.prepare_load(ks(5))  # the only host slot is pinned: nothing could be staged now
    place_in_lower_tier(m, "disk", key(2))
    m.cascade.learn("peer_direct", ks(0, 1))
    assert m.lookup(ks(0, 1, 2)) == 3
    plan = m.prepare_load(ks(0, 1, 2))
    assert plan.keys == tuple(ks(0, 1))  # the disk chunk needs a staging slot: none free, the plan stops
    assert plan.tiers == ("peer_direct", "peer_direct") and plan.slots == (-1, -1)
    assert plan.staged == (False, False)
    assert m.state_of(key(0), "peer_direct")[2] == 1  # type: ignore[index]  # pinned
    assert m.usage()[HOST] == (1, 1)  # no host slot taken
    m.complete_load(ks(0, 1))
    assert m.state_of(key(0), "peer_direct")[2] == 0  # type: ignore[index]
    assert m.state_of(key(0), HOST) is None  # nothing promoted: it was never in host memory
    m.cascade.forget("peer_direct", ks(0, 1))
    assert m.lookup(ks(0)) == 0
