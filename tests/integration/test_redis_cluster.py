"""The Redis tier on a real 3-master Redis Cluster started on loopback ports (no mocks).

The cluster (three redis-server processes with ``--cluster-enabled yes``,
joined by ``redis-cli --cluster create --cluster-replicas 0``) is started once
for this module and flushed before each test.

* batched puts and gets of many chunks: keys carry no hash tag, so they spread
  over the slots and all three masters, and each pipeline is split per node;
* asynchronous and blocking lookups;
* a slot in the middle of a migration (IMPORTING / MIGRATING, some keys moved
  with MIGRATE): the old owner answers ASK for the moved keys and the tier
  follows it; once the slot is handed over the old owner answers MOVED and
  the tier follows that too (redis-py updates its slot map);
* ``redis-cli --cluster reshard`` moving a few hundred slots, with the
  chunks in them, while the tier holds a stale slot map: every chunk still
  loads, and no connection error is counted.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator

import pytest
from redis.crc import key_slot
from tiercache.backends.redis.backend import LinkState, RedisBackend, RedisSettings, redis_key

from tests.integration.redis_servers import (  # noqa: F401 (redis_cluster is a fixture)
    RedisClusterNodes,
    TierDriver,
    redis_cluster,
)
from tiercache.backend import BackendContext
from tiercache.testing.conformance import make_key

NS = b"clust-ns"
CHUNK = 4 << 10


def keys(first: int, count: int) -> list[bytes]:
    return [make_key(i, NS) for i in range(first, first + count)]


@pytest.fixture
def cluster(redis_cluster: RedisClusterNodes) -> RedisClusterNodes:  # noqa: F811
    redis_cluster.wait_ok()
    for server in redis_cluster.servers:
        with server.client() as raw:
            raw.flushall()
    return redis_cluster


@pytest.fixture
def tier(cluster: RedisClusterNodes) -> Iterator[RedisBackend]:
    settings = RedisSettings(cluster=True, nodes=tuple(cluster.seeds), pipeline_batch=32)
    backend = RedisBackend(settings, BackendContext("cluster", NS, CHUNK, 64 << 20))
    yield backend
    backend.close()


def test_batched_round_trip_spreads_over_masters(
    cluster: RedisClusterNodes, tier: RedisBackend
) -> None:
    drive = TierDriver(tier, CHUNK)
    stored = keys(0, 600)
    jobs = [stored[i : i + 100] for i in range(0, len(stored), 100)]
    for batch in jobs:
        result = drive.put(batch)
        assert result.ok_keys == tuple(batch), f"{len(result.failed_keys)} puts failed"
    drive.assert_loads(stored)
    slots = Counter(key_slot(redis_key(k)) for k in stored)
    assert len(slots) > 500, "keys of one namespace should spread over the slots"
    held = []
    for server in cluster.servers:
        with server.client() as raw:
            held.append(raw.dbsize())
    assert sum(held) == len(stored) and min(held) > 100, f"keys per master: {held}"
    stats = tier.stats()
    assert stats["puts"] == stats["gets"] == 600 and stats["connection_errors"] == 0


def test_lookups(cluster: RedisClusterNodes, tier: RedisBackend) -> None:
    drive = TierDriver(tier, CHUNK)
    stored, missing = keys(0, 50), keys(1000, 50)
    assert drive.put(stored).ok
    asked = [k for pair in zip(stored, missing) for k in pair]
    expected = [True, False] * 50
    assert tier.contains(asked) == expected
    tier.submit_contains("req", asked)
    deadline = time.monotonic() + 10
    answers: list = []
    while not answers and time.monotonic() < deadline:
        answers = tier.poll_contains()
        time.sleep(0.005)
    assert answers == [("req", expected)]


def test_seed_from_url(cluster: RedisClusterNodes) -> None:
    settings = RedisSettings(cluster=True, url=f"redis://{cluster.seeds[1]}/0")
    backend = RedisBackend(settings, BackendContext("cluster", NS, CHUNK, 64 << 20))
    try:
        drive = TierDriver(backend, CHUNK)
        assert drive.put(keys(0, 40)).ok
        drive.assert_loads(keys(0, 40))
        assert backend.state is LinkState.UP
    finally:
        backend.close()


def test_ask_then_moved_during_a_slot_migration(
    cluster: RedisClusterNodes, tier: RedisBackend
) -> None:
    drive = TierDriver(tier, CHUNK)
    stored = keys(0, 3000)  # about 5 keys per slot of the 16384 / 3000
    for i in range(0, len(stored), 500):
        assert drive.put(stored[i : i + 500]).ok
    by_slot: dict[int, list[bytes]] = {}
    for key in stored:
        by_slot.setdefault(key_slot(redis_key(key)), []).append(key)
    slot, in_slot = max(by_slot.items(), key=lambda item: len(item[1]))
    assert len(in_slot) >= 2
    source = cluster.owner_of(slot)
    target = next(s for s in cluster.servers if s is not source)
    source_id, target_id = cluster.node_id(source), cluster.node_id(target)
    moved, staying = in_slot[:1], in_slot[1:]
    with target.client() as raw_target, source.client() as raw_source:
        raw_target.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
        raw_source.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
        _migrate(raw_source, target, moved)
        raw_source.config_resetstat()
        # ASK for the moved key, a plain answer for the others, in one pipeline
        drive.assert_loads(in_slot + keys(0, 20))
        assert drive.put(moved, version=1).ok  # a SET of a moved key follows ASK as well
        assert _redirections(source, "ASK") >= 2, "the source never answered ASK"
        _migrate(raw_source, target, staying)
        for server in (target, source, *cluster.servers):
            with server.client() as raw:
                raw.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
        assert raw_target.exists(*(redis_key(k) for k in in_slot)) == len(in_slot)
    cluster.wait_ok()
    result, _ = drive.get(in_slot)  # the tier's slot map is stale: MOVED
    assert result.ok
    assert _redirections(source, "MOVED") >= 1, "the source never answered MOVED"
    drive.assert_loads(moved, version=1)
    drive.assert_loads(staying)
    assert tier.stats()["connection_errors"] == 0


def _migrate(raw_source: object, target: object, moving: list[bytes]) -> None:
    raw_source.execute_command(  # type: ignore[attr-defined]
        "MIGRATE", "127.0.0.1", target.port, "", 0, 5000,  # type: ignore[attr-defined]
        "KEYS", *(redis_key(k) for k in moving),
    )


def test_reshard_with_redis_cli(cluster: RedisClusterNodes, tier: RedisBackend) -> None:
    drive = TierDriver(tier, CHUNK)
    stored = keys(0, 1000)
    for i in range(0, len(stored), 250):
        assert drive.put(stored[i : i + 250]).ok
    source, target = cluster.servers[0], cluster.servers[1]
    before = _held_by(source)
    cluster.cli(
        "--cluster", "reshard", source.address,
        "--cluster-from", cluster.node_id(source), "--cluster-to", cluster.node_id(target),
        "--cluster-slots", "300", "--cluster-yes",
    )
    cluster.wait_ok()
    assert _held_by(source) < before, "the reshard moved none of the chunks"
    with source.client() as raw:
        raw.config_resetstat()
    drive.assert_loads(stored)
    assert _redirections(source, "MOVED") >= 1, "the tier's slot map was never stale"
    assert drive.put(stored[:100], version=2).ok
    drive.assert_loads(stored[:100], version=2)
    assert tier.stats()["connection_errors"] == 0 and tier.state is LinkState.UP


def _held_by(server: object) -> int:
    with server.client() as raw:  # type: ignore[attr-defined]
        return int(raw.dbsize())


def _redirections(server: object, kind: str) -> int:
    """How many ``kind`` (ASK, MOVED) error replies ``server`` sent since its last RESETSTAT."""
    with server.client() as raw:  # type: ignore[attr-defined]
        errors = raw.info("errorstats")
    return int(errors.get(f"errorstat_{kind}", {}).get("count", 0))
