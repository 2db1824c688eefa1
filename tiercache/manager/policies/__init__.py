"""Eviction policies, one file each, chosen per tier by name in the config."""

from __future__ import annotations

from tiercache.manager.policies.arc import ARCPolicy
from tiercache.manager.policies.base import EvictionPolicy
from tiercache.manager.policies.lru import LRUPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """Instantiate the policy called ``name`` for a tier of ``capacity`` chunks."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"policy: unknown {name!r}, choose one of {sorted(POLICIES)}") from None
    return cls(capacity)


__all__ = ["ARCPolicy", "EvictionPolicy", "LRUPolicy", "POLICIES", "make_policy"]
