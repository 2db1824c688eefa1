"""SharedLookup: contains() off the scheduler thread, prefix answers, timeouts and failures."""

from __future__ import annotations

import time
from collections.abc import Sequence

from tiercache.testing.memory_backend import MemoryBackend
from tiercache.tiers.shared_lookup import SharedLookup
from tiercache.transfer.host_slab import HostSlab


def k(i: int) -> bytes:
    return bytes([i]) * 44


class SlowTier(MemoryBackend):
    """An in-memory tier that answers lookups late (a slow or hung shared store)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(HostSlab(4, 64, pin_memory=False))
        self.delay_s = delay_s

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        time.sleep(self.delay_s)
        return super().contains(keys)


class BrokenTier(MemoryBackend):
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        raise ConnectionError("store is down")


def wait_answer(lookup: SharedLookup, token: str) -> dict[str, list[bytes]]:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        ans = lookup.answer(token)
        if ans is not None:
            return ans
        time.sleep(0.01)
    raise AssertionError("no answer")


def test_answers_the_held_prefix_per_tier() -> None:
    a, b = MemoryBackend(HostSlab(4, 64, pin_memory=False)), MemoryBackend(HostSlab(4, 64, pin_memory=False))
    a.submit_put(1, [k(0), k(1), k(3)], [memoryview(bytearray(8))] * 3)
    b.submit_put(1, [k(0)], [memoryview(bytearray(8))])
    lookup = SharedLookup({"a": a, "b": b})
    lookup.ask("r1", [k(0), k(1), k(2), k(3)])
    assert lookup.asking("r1")
    assert wait_answer(lookup, "r1") == {"a": [k(0), k(1)], "b": [k(0)]}  # a prefix: k(3) is useless
    assert not lookup.asking("r1")
    lookup.close()


def test_slow_tier_is_not_waited_for_and_times_out_as_a_miss() -> None:
    lookup = SharedLookup({"slow": SlowTier(0.5)}, timeout_s=0.1)
    lookup.ask("r", [k(0)])
    t0 = time.monotonic()
    assert lookup.answer("r") is None and time.monotonic() - t0 < 0.05  # never blocks the caller
    assert wait_answer(lookup, "r") == {}  # late: nothing learned, a miss
    lookup.close()


def test_failing_tier_is_a_miss_and_forget_drops_the_question() -> None:
    lookup = SharedLookup({"down": BrokenTier(HostSlab(4, 64, pin_memory=False))})
    lookup.ask("r", [k(0)])
    assert wait_answer(lookup, "r") == {}
    lookup.ask("r2", [k(0)])
    lookup.forget("r2")
    assert not lookup.asking("r2")
    lookup.close()


def test_any_of_keys_are_answered_one_by_one_after_the_prefix() -> None:
    """A state-layer model's state keys: each held one is learned, wherever the prefix ends."""
    tier = MemoryBackend(HostSlab(8, 64, pin_memory=False))
    tier.submit_put(1, [k(0), k(10), k(12)], [memoryview(bytearray(8))] * 3)
    lookup = SharedLookup({"t": tier})
    lookup.ask("r", [k(0), k(1)], any_of=[k(10), k(11), k(12)])
    assert wait_answer(lookup, "r") == {"t": [k(0), k(10), k(12)]}
    lookup.close()


def test_the_first_answer_waits_briefly_and_no_longer() -> None:
    """A store that answers within ``first_wait_s`` is answered in the same call (the request is
    scheduled this step); a slower one is not waited for past it; later calls never wait."""
    quick = SlowTier(0.003)
    quick.submit_put(1, [k(0)], [memoryview(bytearray(8))])
    lookup = SharedLookup({"quick": quick}, timeout_s=1.0, first_wait_s=0.5)
    lookup.ask("r", [k(0), k(1)])
    assert lookup.answer("r", first=True) == {"quick": [k(0)]}
    lookup.ask("no-wait", [k(0)])
    assert lookup.answer("no-wait") is None  # control: the same store, asked without the wait
    assert wait_answer(lookup, "no-wait") == {"quick": [k(0)]}
    slow = SharedLookup({"slow": SlowTier(0.5)}, timeout_s=1.0, first_wait_s=0.02)
    slow.ask("s", [k(0)])
    t0 = time.monotonic()
    assert slow.answer("s", first=True) is None  # a slower store: not waited for past first_wait_s
    assert time.monotonic() - t0 < 0.2
    assert SharedLookup({}, timeout_s=0.01, first_wait_s=5.0).first_wait_s == 0.01  # never past the deadline
    for one in (lookup, slow):
        one.close()
