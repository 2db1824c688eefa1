"""Lower tiers (disk, LMDB, plugins) as the connector sees them: sizes, recovery, construction.

Scheduler side: how many chunks each lower tier holds (its byte budget over the
backend's per-chunk footprint), and, at start-up, which chunks a persistent tier
still holds from an earlier run (``Backend.recover``, adopted into the manager).
Worker side: the backend objects themselves, one per lower tier per worker.
Every backend is wrapped in a :class:`~tiercache.tiers.sharded_backend.ShardedBackend`:
the medium holds store shards named by KV head (tiercache/shards.py), so TP
ranks never read each other's bytes and engines of any TP size share chunks.
A tier that cannot be opened (an unwritable directory, a bad option) is a
ConfigError at start-up, naming the tier.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from tiercache.backend import Backend, BackendContext
from tiercache.config.schema import ConfigError, TierCacheConfig
from tiercache.manager.directory import TierSpec
from tiercache.manager.offloading import OffloadingManager
from tiercache.tiers.registry import backend_class, create_backend
from tiercache.tiers.sharded_backend import ShardedBackend
from tiercache.shards import HEAD_SHARD, HeadSlicer, ShardSet

from tiercache.connector.engine_info import ChunkGeometry
from tiercache.connector.scheduler_state import RequestState
from tiercache.tiers.shared_lookup import SharedLookup

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
        shards = geometry.engine.shard_set(0)
        footprint = max(1, shards.shard_count) * cls.footprint(_value_bytes(geometry, shards))
        slots = tier.capacity // footprint
        if slots < 1:
            raise ConfigError(
                f"tiers.{index}.capacity: {tier.capacity} bytes holds no chunk "
                f"(one chunk takes {footprint} bytes in backend {tier.backend!r})"
            )
        # A shared tier's budget is the other side's business; here it bounds what we remember.
        specs.append(TierSpec(tier.name, slots, tier.policy, "write_through" if cls.shared else tier.mode, cls.shared))
    return specs


def _value_bytes(geometry: ChunkGeometry, shards: ShardSet) -> int:
    """Bytes of one value on the medium: a head shard, or (rank shards) a rank's whole chunk."""
    return geometry.shard_bytes if shards.kind == HEAD_SHARD and not shards.ignore_rank else geometry.slot_bytes


def _context(tier_name: str, capacity: int, digest: bytes, geometry: ChunkGeometry, rank: int,
             shards: ShardSet) -> BackendContext:
    return BackendContext(
        tier_name=tier_name,
        namespace=digest,
        chunk_bytes=_value_bytes(geometry, shards),
        capacity_bytes=capacity,
        rank=rank,
        world_size=geometry.engine.world_size,
    )


def make_backends(
    config: TierCacheConfig, geometry: ChunkGeometry, digest: bytes, rank: int, shared_only: bool = False,
    shards: ShardSet | None = None, slicer: HeadSlicer | None = None,
) -> dict[str, Backend]:
    """One wrapped backend per lower tier. ``shards``: the store shards this process reads and
    writes (default: rank ``rank``'s head shards); ``slicer`` cuts them (workers only)."""
    shards = shards if shards is not None else geometry.engine.shard_set(rank)
    backends: dict[str, Backend] = {}
    for index, tier in enumerate(config.tiers[1:], start=1):
        if shared_only and not backend_class(tier.backend).shared:
            continue
        try:
            inner = create_backend(tier, _context(tier.name, tier.capacity, digest, geometry, rank, shards), index)
            backends[tier.name] = ShardedBackend(inner, shards, slicer)
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
            over = manager.cascade.adopt(name, keys)
            if over:
                extra[name] = over
            logger.info("tiercache: tier %s recovered %d chunks (%d over budget)", name, len(keys), len(over))
    finally:
        for backend in backends.values():
            backend.close()
    return extra


def ask_shared_tiers(shared: SharedLookup, st: RequestState, token: str, keys: list[bytes], hits: int,
                     manager: OffloadingManager, any_of: Sequence[bytes] = ()) -> int | None:
    """Scheduler: extend a request's local hit with what the shared tiers hold; None while they are
    asked (the first call waits at most ``deadlines.lookup_wait_s``, later ones not at all:
    tiercache/tiers/shared_lookup.py). Asked once per request. ``any_of``: keys asked about one by
    one (a state-layer model's state keys), learned wherever present."""
    if st.shared_asked:
        return hits
    if not shared.asking(token):
        shared.ask(token, keys[hits:], any_of)
        answer = shared.answer(token, first=True)
    else:
        answer = shared.answer(token)
    if answer is None:
        return None
    for tier, present in answer.items():
        if present:
            manager.cascade.learn(tier, present)
    st.shared_asked = True
    return manager.lookup(keys) or 0
