"""Lower tiers (disk, LMDB, plugins) as the connector sees them: sizes, recovery, construction.

Scheduler side: how many chunks each lower tier holds (its byte budget over the
backend's per-chunk footprint), and, at start-up, which chunks a persistent tier
still holds from an earlier run (``Backend.recover``, adopted into the manager).
Worker side: the backend objects themselves, one per lower tier per worker.
A tier that cannot be opened (an unwritable directory, a bad option) is a
ConfigError at start-up, naming the tier.
"""

from __future__ import annotations

import logging

from tiercache.backend import Backend, BackendContext
from tiercache.config import ConfigError, TierCacheConfig
from tiercache.directory import TierSpec
from tiercache.manager import OffloadingManager
from tiercache.plugins import backend_class, create_backend

from tiercache.connector.engine_info import ChunkGeometry

logger = logging.getLogger(__name__)


def _check_shareable(geometry: ChunkGeometry, config: TierCacheConfig) -> None:
    if len(config.tiers) > 1 and not geometry.keyspace(config).namespace.stable_across_processes:
        raise ConfigError(
            f"tiers: persistent tiers need block hashes that are stable across processes; "
            f"prefix_caching_hash_algo={geometry.engine.hash_algo!r} is seeded per process. "
            "Use sha256 (vLLM's default) or set PYTHONHASHSEED."
        )


def lower_tier_specs(config: TierCacheConfig, geometry: ChunkGeometry) -> list[TierSpec]:
    _check_shareable(geometry, config)
    specs: list[TierSpec] = []
    for index, tier in enumerate(config.tiers[1:], start=1):
        cls = backend_class(tier.backend)
        footprint = cls.footprint(geometry.slot_bytes)
        slots = tier.capacity // footprint
        if slots < 1:
            raise ConfigError(
                f"tiers.{index}.capacity: {tier.capacity} bytes holds no chunk "
                f"(one chunk takes {footprint} bytes in backend {tier.backend!r})"
            )
        # A shared tier's budget is the other side's business; here it bounds what we remember.
        specs.append(TierSpec(tier.name, slots, tier.policy, "write_through" if cls.shared else tier.mode, cls.shared))
    return specs


def _context(tier_name: str, capacity: int, digest: bytes, geometry: ChunkGeometry, rank: int) -> BackendContext:
    return BackendContext(
        tier_name=tier_name,
        namespace=digest,
        chunk_bytes=geometry.slot_bytes,
        capacity_bytes=capacity,
        rank=rank,
        world_size=geometry.engine.world_size,
    )


def make_backends(
    config: TierCacheConfig, geometry: ChunkGeometry, digest: bytes, rank: int, shared_only: bool = False
) -> dict[str, Backend]:
    backends: dict[str, Backend] = {}
    for index, tier in enumerate(config.tiers[1:], start=1):
        if shared_only and not backend_class(tier.backend).shared:
            continue
        try:
            backends[tier.name] = create_backend(
                tier, _context(tier.name, tier.capacity, digest, geometry, rank), index
            )
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(f"tiers.{index} ({tier.name}, backend {tier.backend}): cannot open: {exc}") from exc
    return backends


def recover_lower_tiers(
    config: TierCacheConfig, geometry: ChunkGeometry, digest: bytes, manager: OffloadingManager
) -> dict[str, list[bytes]]:
    """Adopt what each persistent tier still holds; return per tier the keys over budget (to delete)."""
    extra: dict[str, list[bytes]] = {}
    if len(config.tiers) < 2:
        return extra
    backends = make_backends(config, geometry, digest, rank=0)
    try:
        for name, backend in backends.items():
            if backend.shared:
                continue  # looked up per request, not recovered
            keys = [k for k in backend.recover() if k.startswith(digest)]
            over = manager.adopt(name, keys)
            if over:
                extra[name] = over
            logger.info("tiercache: tier %s recovered %d chunks (%d over budget)", name, len(keys), len(over))
    finally:
        for backend in backends.values():
            backend.close()
    return extra
