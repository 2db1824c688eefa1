"""Unit tests of the eviction policies (tiercache/manager/policies/).

The policies only order the resident keys of one tier; pins and slots are the
manager's business and are tested in test_manager.py. Here: LRU ordering,
ARC's lists (T1/T2 and the ghosts B1/B2) and its adaptive target ``p``, the
bookkeeping of ``evicted``/``remove``, and ``make_policy``.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercache.manager.policies import POLICIES, ARCPolicy, EvictionPolicy, LRUPolicy, make_policy


def k(i: int) -> bytes:
    """A short distinct key (policies treat keys as opaque bytes)."""
    return b"key-%04d" % i


def keys(*ids: int) -> list[bytes]:
    return [k(i) for i in ids]


def evict_first(policy: EvictionPolicy, count: int) -> list[bytes]:
    """Evict the ``count`` best candidates, as the manager does with no pins."""
    victims = list(policy.candidates())[:count]
    for key in victims:
        policy.evicted(key)
    return victims


# --------------------------------------------------------------------- common contract
@pytest.fixture(params=sorted(POLICIES))
def policy(request: pytest.FixtureRequest) -> EvictionPolicy:
    return make_policy(request.param, 8)


def test_insert_contains_len(policy: EvictionPolicy) -> None:
    assert len(policy) == 0 and k(1) not in policy
    for i in range(3):
        policy.insert(k(i))
    assert len(policy) == 3
    assert all(k(i) in policy for i in range(3))
    assert sorted(policy.candidates()) == keys(0, 1, 2)


def test_access_of_unknown_key_is_a_noop(policy: EvictionPolicy) -> None:
    policy.insert(k(0))
    policy.access(k(9))
    assert k(9) not in policy and len(policy) == 1


def test_evicted_and_remove_forget_the_key(policy: EvictionPolicy) -> None:
    for i in range(3):
        policy.insert(k(i))
    policy.evicted(k(0))
    policy.remove(k(1))
    policy.remove(k(7))  # unknown: no error
    assert list(policy.candidates()) == [k(2)]
    assert len(policy) == 1 and k(0) not in policy and k(1) not in policy


def test_clear(policy: EvictionPolicy) -> None:
    for i in range(4):
        policy.insert(k(i))
    evict_first(policy, 2)
    policy.clear()
    assert len(policy) == 0 and list(policy.candidates()) == []


def test_negative_capacity_is_rejected() -> None:
    for name in POLICIES:
        with pytest.raises(ValueError):
            make_policy(name, -1)


# -------------------------------------------------------------------------------- LRU
def test_lru_candidates_oldest_first() -> None:
    lru = LRUPolicy(4)
    for i in range(4):
        lru.insert(k(i))
    assert list(lru.candidates()) == keys(0, 1, 2, 3)


def test_lru_access_moves_to_most_recent() -> None:
    lru = LRUPolicy(4)
    for i in range(4):
        lru.insert(k(i))
    lru.access(k(0))
    lru.access(k(2))
    assert list(lru.candidates()) == keys(1, 3, 0, 2)


def test_lru_reinsert_moves_to_most_recent() -> None:
    lru = LRUPolicy(4)
    for i in range(3):
        lru.insert(k(i))
    lru.insert(k(0))
    assert list(lru.candidates()) == keys(1, 2, 0)
    assert len(lru) == 3


def test_lru_eviction_order_after_evictions() -> None:
    lru = LRUPolicy(4)
    for i in range(4):
        lru.insert(k(i))
    assert evict_first(lru, 2) == keys(0, 1)
    lru.insert(k(4))
    lru.access(k(2))
    assert list(lru.candidates()) == keys(3, 4, 2)


# -------------------------------------------------------------------------------- ARC
def lists(arc: ARCPolicy) -> tuple[list[bytes], list[bytes], list[bytes], list[bytes]]:
    """(T1, T2, B1, B2) in order, oldest first."""
    return list(arc._t1), list(arc._t2), list(arc._b1), list(arc._b2)


def test_arc_insert_goes_to_t1() -> None:
    arc = ARCPolicy(4)
    arc.insert(k(0))
    arc.insert(k(1))
    assert lists(arc) == (keys(0, 1), [], [], [])


def test_arc_access_promotes_t1_to_t2_then_refreshes_t2() -> None:
    arc = ARCPolicy(4)
    for i in range(3):
        arc.insert(k(i))
    arc.access(k(1))
    assert lists(arc)[:2] == (keys(0, 2), keys(1))
    arc.access(k(0))
    assert lists(arc)[:2] == (keys(2), keys(1, 0))
    arc.access(k(1))  # already in T2: moves to its MRU end
    assert lists(arc)[:2] == (keys(2), keys(0, 1))


def test_arc_reinsert_of_resident_key_counts_as_access() -> None:
    arc = ARCPolicy(4)
    arc.insert(k(0))
    arc.insert(k(0))
    assert lists(arc)[:2] == ([], keys(0))
    assert len(arc) == 1


def test_arc_evicted_keys_become_ghosts_of_their_list() -> None:
    arc = ARCPolicy(4)
    for i in range(3):
        arc.insert(k(i))
    arc.access(k(2))  # T1 = [0, 1], T2 = [2]
    arc.evicted(k(0))
    arc.evicted(k(2))
    assert lists(arc) == (keys(1), [], keys(0), keys(2))
    assert k(0) not in arc and k(2) not in arc and len(arc) == 1


def test_arc_remove_leaves_no_ghost() -> None:
    arc = ARCPolicy(4)
    arc.insert(k(0))
    arc.insert(k(1))
    arc.access(k(1))
    arc.remove(k(0))
    arc.remove(k(1))
    assert lists(arc) == ([], [], [], [])


def test_arc_ghost_hit_in_b1_grows_target() -> None:
    arc = ARCPolicy(4)
    for i in range(4):
        arc.insert(k(i))
    evict_first(arc, 1)  # k0 -> B1
    assert arc.target_t1 == 0.0
    arc.insert(k(0))  # ghost hit in B1: recency was undervalued
    assert arc.target_t1 == 1.0
    t1, t2, b1, _ = lists(arc)
    assert k(0) in t2 and k(0) not in t1 and k(0) not in b1


def test_arc_b1_delta_is_ratio_of_ghost_sizes() -> None:
    arc = ARCPolicy(8)
    for i in range(4):
        arc.insert(k(i))
        arc.access(k(i))  # all in T2
    arc.insert(k(4))
    for key in keys(0, 1, 2):
        arc.evicted(key)  # B2 = [0, 1, 2]
    arc.evicted(k(4))  # B1 = [4]
    arc.insert(k(4))  # |B2| / |B1| = 3
    assert arc.target_t1 == 3.0


def test_arc_ghost_hit_in_b2_shrinks_target() -> None:
    arc = ARCPolicy(4)
    arc.target_t1 = 3.0
    for i in range(3):
        arc.insert(k(i))
        arc.access(k(i))  # T2 = [0, 1, 2]
    arc.evicted(k(0))  # from T2 -> B2
    assert lists(arc)[3] == keys(0)
    arc.insert(k(0))  # ghost hit in B2: frequency was undervalued
    assert arc.target_t1 == 2.0
    assert k(0) in lists(arc)[1] and k(0) not in lists(arc)[3]


def test_arc_target_is_capped_at_capacity() -> None:
    arc = ARCPolicy(2)
    arc.target_t1 = 1.5
    arc.insert(k(0))
    arc.evicted(k(0))
    arc.insert(k(0))  # B1 hit: p + 1 would exceed the capacity
    assert arc.target_t1 == 2.0


def test_arc_target_never_goes_below_zero() -> None:
    arc = ARCPolicy(2)
    arc.target_t1 = 0.5
    arc.insert(k(0))
    arc.access(k(0))
    arc.evicted(k(0))
    arc.insert(k(0))  # B2 hit: p - 1 would be negative
    assert arc.target_t1 == 0.0


def test_arc_ghost_lists_bounded_by_capacity() -> None:
    capacity = 4
    arc = ARCPolicy(capacity)
    for i in range(50):
        arc.insert(k(i))
        if i % 3 == 0:
            arc.access(k(i))
        while len(arc) > capacity:
            evict_first(arc, 1)
        _, _, b1, b2 = lists(arc)
        assert len(b1) + len(b2) <= capacity
    _, _, b1, b2 = lists(arc)
    assert len(b1) + len(b2) == capacity
    assert len(arc) <= capacity


def test_arc_oldest_ghosts_are_forgotten_first() -> None:
    arc = ARCPolicy(2)
    for i in range(4):
        arc.insert(k(i))
    evict_first(arc, 3)  # B1 would be [0, 1, 2], capped at 2
    assert lists(arc)[2] == keys(1, 2)


def test_arc_candidates_t1_first_when_above_target() -> None:
    arc = ARCPolicy(8)
    for i in range(4):
        arc.insert(k(i))
    arc.access(k(0))  # T1 = [1, 2, 3], T2 = [0]; p = 0
    assert list(arc.candidates()) == keys(1, 2, 3, 0)


def test_arc_candidates_t2_first_when_t1_within_target() -> None:
    arc = ARCPolicy(8)
    for i in range(4):
        arc.insert(k(i))
    arc.access(k(0))
    arc.target_t1 = 3.0  # |T1| == p: T1 is not above target
    assert list(arc.candidates()) == keys(0, 1, 2, 3)


def test_arc_candidates_follow_target_within_a_batch() -> None:
    """A batch eviction takes from T1 only down to ``p``, then from T2 (ARC's REPLACE)."""
    arc = ARCPolicy(8)
    for i in range(6):
        arc.insert(k(i))
    for i in (0, 1):
        arc.access(k(i))  # T1 = [2, 3, 4, 5], T2 = [0, 1]
    arc.target_t1 = 2.0
    assert list(arc.candidates()) == keys(2, 3, 0, 1, 4, 5)
    arc.target_t1 = 2.5  # T1 goes to 3 (> 2.5), then 2: two T1 victims first
    assert list(arc.candidates()) == keys(2, 3, 0, 1, 4, 5)
    arc.target_t1 = 3.5
    assert list(arc.candidates()) == keys(2, 0, 1, 3, 4, 5)


def test_arc_candidates_fall_back_to_t1_when_t2_empty() -> None:
    arc = ARCPolicy(4)
    for i in range(3):
        arc.insert(k(i))
    arc.target_t1 = 4.0
    assert list(arc.candidates()) == keys(0, 1, 2)


def test_arc_clear_resets_target_and_ghosts() -> None:
    arc = ARCPolicy(4)
    arc.insert(k(0))
    arc.evicted(k(0))
    arc.insert(k(0))
    arc.clear()
    assert arc.target_t1 == 0.0 and lists(arc) == ([], [], [], [])


# ------------------------------------------------------------------------ make_policy
@pytest.mark.parametrize(("name", "cls"), [("lru", LRUPolicy), ("arc", ARCPolicy)])
def test_make_policy_builds_the_named_policy(name: str, cls: type[EvictionPolicy]) -> None:
    policy = make_policy(name, 16)
    assert isinstance(policy, cls)
    assert policy.capacity == 16 and policy.name == name


def test_make_policy_unknown_name_lists_valid_ones() -> None:
    with pytest.raises(ValueError) as err:
        make_policy("fifo", 4)
    message = str(err.value)
    assert "fifo" in message
    for name in POLICIES:
        assert repr(name) in message


# ------------------------------------------------------------------- batch == one by one
def _snapshot(policy: EvictionPolicy) -> object:
    if isinstance(policy, ARCPolicy):
        return lists(policy), policy.target_t1
    return list(policy.candidates())


_batch_ops = st.lists(
    st.tuples(
        st.sampled_from(["insert", "access", "evict"]),
        st.lists(st.integers(0, 11), max_size=5),
    ),
    max_size=30,
)


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=150, deadline=None, database=None)
@given(ops=_batch_ops)
def test_batch_calls_equal_one_by_one(name: str, ops: list[tuple[str, list[int]]]) -> None:
    batch, single = make_policy(name, 4), make_policy(name, 4)
    for op, ids in ops:
        if op == "evict":  # evict the first candidates, as many as ids asks for
            victims = list(batch.candidates())[: len(ids)]
            assert victims == list(single.candidates())[: len(ids)]
            batch.evicted_many(victims)
            for key in victims:
                single.evicted(key)
        else:
            getattr(batch, f"{op}_many")(keys(*ids))
            for key in keys(*ids):
                getattr(single, op)(key)
        assert _snapshot(batch) == _snapshot(single)
