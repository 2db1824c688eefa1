"""Cache poisoning through a shared Redis: a writer without the MAC key cannot make a chunk load.

Any client of a Redis server the Redis tier shares can SET a chunk's key. The
tier stores frames (tiercache/integrity.py) and verifies them on load; with a
``mac_key`` only frames written with the same key load. A real redis-server
(tests/integration/redis_servers.py), the tier (:class:`RedisBackend`) against
it, the intruder a plain redis-py client.

Every forgery an intruder without the key can make (an xxh3 frame of its own
bytes, a MAC frame under its own key, the engine's valid frame of another key
replayed) is a failed key counted in ``checksum_failures``, the view left
untouched. Negative controls: the same SET framed *with* the key loads the
intruder's bytes; without a ``mac_key`` an xxh3 frame of its bytes loads.
"""

from __future__ import annotations

import pytest
from tiercache.backends.redis.backend import RedisBackend, RedisSettings, redis_key

from tests.integration.redis_servers import (
    RedisServer,
    TierDriver,
    redis_server,
)
from tiercache.backend import BackendContext
from tiercache.integrity import MacKey, encode_frame
from tiercache.testing.conformance import SENTINEL, make_key, make_payload

CHUNK = 16 * 1024
NS = b"poison-r"
MAC_SECRET = "the-engines-own-mac-secret-0123"


@pytest.fixture()
def server(redis_server: RedisServer) -> RedisServer:
    with redis_server.client() as raw:
        raw.flushall()
    return redis_server


def open_tier(server: RedisServer, mac_key: str | None) -> tuple[RedisBackend, TierDriver]:
    context = BackendContext(tier_name="redis", namespace=NS, chunk_bytes=CHUNK, capacity_bytes=1 << 30)
    tier = RedisBackend(RedisSettings(url=server.url, mac_key=mac_key), context)
    return tier, TierDriver(tier, CHUNK)


def keys(first: int, n: int) -> list[bytes]:
    return [NS + make_key(i)[len(NS):] for i in range(first, first + n)]


def test_forged_chunks_are_refused_and_counted(server: RedisServer) -> None:
    tier, driver = open_tier(server, MAC_SECRET)
    try:
        ks = keys(0, 4)
        assert driver.put(ks).ok
        evil = make_payload(ks[0], CHUNK, version=66)
        with server.client() as raw:
            replay = raw.get(redis_key(ks[3]))
            raw.set(redis_key(ks[0]), encode_frame(NS, ks[0], evil))
            raw.set(redis_key(ks[1]), encode_frame(NS, ks[1], evil, mac=MacKey("an intruder's own secret")))
            raw.set(redis_key(ks[2]), replay)
        result, got = driver.get(ks)
        assert result.failed_keys == tuple(ks[:3])
        assert all(got[k] == bytes([SENTINEL]) * CHUNK for k in ks[:3])  # no byte reached the view
        assert got[ks[3]] == make_payload(ks[3], CHUNK)
        assert tier.stats()["checksum_failures"] == 3
    finally:
        tier.close()


def test_negative_control_a_writer_with_the_key_does_poison(server: RedisServer) -> None:
    tier, driver = open_tier(server, MAC_SECRET)
    try:
        (key,) = keys(10, 1)
        assert driver.put([key]).ok
        evil = make_payload(key, CHUNK, version=66)
        with server.client() as raw:
            raw.set(redis_key(key), encode_frame(NS, key, evil, mac=MacKey(MAC_SECRET)))
        result, got = driver.get([key])
        assert result.ok and got[key] == evil and tier.stats()["checksum_failures"] == 0
    finally:
        tier.close()


def test_negative_control_without_a_mac_key_an_xxh3_frame_poisons(server: RedisServer) -> None:
    tier, driver = open_tier(server, None)
    try:
        (key,) = keys(20, 1)
        assert driver.put([key]).ok
        evil = make_payload(key, CHUNK, version=66)
        with server.client() as raw:
            raw.set(redis_key(key), encode_frame(NS, key, evil))
        result, got = driver.get([key])
        assert result.ok and got[key] == evil
    finally:
        tier.close()
