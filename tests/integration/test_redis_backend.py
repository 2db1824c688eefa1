"""The Redis tier (backends/redis/backend.py) against a real, single redis-server (no mocks).

* round trip, key layout (``tc:`` + chunk key) and frame layout, as a plain
  client sees them; options through the plugin path (pydantic errors name the key);
* TTL: every SET carries EX, and expired chunks are misses;
* framing: a value flipped, truncated, replaced by garbage or by another
  key's frame (all with a raw client, behind the tier's back) fails its load,
  counts in ``checksum_failures`` and leaves the caller's buffer untouched;
* asynchronous lookups: ``submit_contains`` / ``poll_contains``;
* faults: the server killed (SIGKILL) while jobs run: every job is reported,
  the keys fail, the tier counts the error and goes down, submit and poll
  never block, reconnect attempts follow the backoff; the server restarted on
  its port: the tier reconnects and works again. A tier opened while no
  server listens, and a server that stops answering (SIGSTOP), likewise.

The session's server (``redis_server``) is flushed before each test that
uses it; fault tests start servers of their own.
"""

from __future__ import annotations

import pathlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from tiercache.backends.redis.backend import (
    KEY_TAG,
    LinkState,
    RedisBackend,
    RedisSettings,
    redis_key,
)

from tests.integration.redis_servers import (
    RedisServer,
    TierDriver,
    pick_port,
    redis_server,
)
from tiercache.backend import BackendContext, JobResult
from tiercache.config.schema import ConfigError, TierConfig
from tiercache.integrity import FRAME_MAGIC, compact_header_len
from tiercache.testing.conformance import (
    OTHER_NAMESPACE,
    SENTINEL,
    make_key,
    make_payload,
    wait_for_jobs,
)
from tiercache.tiers import registry as plugins

NS = b"redis-ns"
CHUNK = 64 << 10
#: Fast failure and reconnect for the fault tests.
FAULT_OPTIONS: dict[str, Any] = {
    "socket_timeout": 0.5, "connect_timeout": 0.5,
    "reconnect_initial_s": 0.05, "reconnect_max_s": 0.4,
}


def context(chunk: int = CHUNK, namespace: bytes = NS) -> BackendContext:
    return BackendContext("redis-test", namespace, chunk, 64 << 20)


def keys(first: int, count: int, namespace: bytes = NS) -> list[bytes]:
    return [make_key(i, namespace) for i in range(first, first + count)]


def wait_until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {timeout}s")
        time.sleep(0.01)


@pytest.fixture
def server(redis_server: RedisServer) -> RedisServer:
    with redis_server.client() as raw:
        raw.flushall()
    return redis_server


@pytest.fixture
def opened() -> Iterator[list[RedisBackend]]:
    """Backends a test opens, closed after it."""
    tiers: list[RedisBackend] = []
    yield tiers
    for tier in tiers:
        tier.close()


def open_tier(opened: list[RedisBackend], url: str, ctx: BackendContext | None = None,
              **options: Any) -> RedisBackend:
    tier = RedisBackend(RedisSettings(url=url, **options), ctx or context())
    opened.append(tier)
    return tier


# ------------------------------------------------------------------------ basics
def test_round_trip_keys_and_frames(server: RedisServer, opened: list[RedisBackend]) -> None:
    tier = open_tier(opened, server.url, pipeline_batch=3)  # several round trips per job
    drive = TierDriver(tier, CHUNK)
    stored = keys(0, 10)
    result = drive.put(stored)
    assert result.ok_keys == tuple(stored) and result.bytes == 10 * CHUNK
    drive.assert_loads(stored)
    with server.client() as raw:
        assert set(raw.scan_iter(match=KEY_TAG + b"*")) == {redis_key(k) for k in stored}
        value = raw.get(redis_key(stored[0]))
    assert value is not None and value.startswith(FRAME_MAGIC)
    assert len(value) == compact_header_len(len(stored[0])) + CHUNK
    stats = tier.stats()
    assert (stats["puts"], stats["gets"], stats["state"], stats["up"]) == (10, 10, "up", 1)
    assert stats["connection_errors"] == 0 and stats["checksum_failures"] == 0
    assert list(tier.recover()) == []


def test_options_through_the_plugin_path(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(plugins.BUILTIN_BACKENDS, "redis", "tiercache.backends.redis.backend:RedisBackend")
    tier_config = TierConfig(name="r", backend="redis", capacity=64 << 20,
                             options={"url": server.url, "ttl_seconds": 60})
    tier = plugins.create_backend(tier_config, context())
    try:
        assert isinstance(tier, RedisBackend) and tier.settings.ttl_seconds == 60
        assert TierDriver(tier, CHUNK).put(keys(0, 1)).ok
    finally:
        tier.close()
    bad = tier_config.model_copy(update={"options": {"url": server.url, "ttl": 60}})
    with pytest.raises(ConfigError, match=r"tiers\.2\.options\.ttl: unknown key"):
        plugins.create_backend(bad, context(), index=2)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"url": "http://x:1"}, "scheme"),
        ({"nodes": ["127.0.0.1:7000"]}, "cluster: true"),
        ({"cluster": True, "nodes": ["no-port"]}, "host:port"),
        ({"cluster": True, "url": "unix:///tmp/r.sock"}, "no unix"),  # rediss:// is allowed
        ({"reconnect_initial_s": 2, "reconnect_max_s": 1}, "reconnect_max_s"),
        ({"io_threads": 8, "max_connections": 9}, "max_connections"),
        ({"url": "redis://:pw@h:1/0", "password": "pw"}, "either in the url"),
        ({"ttl_seconds": 0}, "ttl_seconds"),
    ],
)
def test_settings_are_validated(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RedisSettings(**options)


def test_password_is_not_shown() -> None:
    assert "hunter2" not in repr(RedisSettings(password="hunter2"))


def test_refused_keys_and_views(server: RedisServer, opened: list[RedisBackend]) -> None:
    tier = open_tier(opened, server.url)
    good = keys(0, 1)[0]
    foreign = make_key(1, OTHER_NAMESPACE)
    too_long = NS + bytes(200)
    views = [memoryview(make_payload(k, CHUNK)) for k in (good, foreign, too_long)]
    oversized = memoryview(bytes(CHUNK + 1))
    tier.submit_put(1, [good, foreign, too_long, make_key(2, NS)], [*views, oversized])
    result = wait_for_jobs(tier, [1])[1]
    assert result.ok_keys == (good,)
    assert result.failed_keys == (foreign, too_long, make_key(2, NS))
    tier.submit_get(2, [good], [memoryview(bytes(CHUNK))])  # read-only buffer: refused
    assert wait_for_jobs(tier, [2])[2].failed_keys == (good,)
    small = bytearray(CHUNK // 2)  # intact frame, wrong length for this buffer
    tier.submit_get(3, [good], [memoryview(small)])
    assert wait_for_jobs(tier, [3])[3].failed_keys == (good,)
    assert small == bytearray(CHUNK // 2) and tier.stats()["checksum_failures"] == 0
    odd: list[Any] = [good, ["not", "a", "key"], "text", None]  # never an exception
    tier.submit_put(4, odd, [memoryview(make_payload(good, CHUNK))] * 4)
    result = wait_for_jobs(tier, [4])[4]
    assert result.ok_keys == (good,) and result.failed_keys == tuple(odd[1:])
    tier.submit_contains("odd", odd)
    wait_until(lambda: tier.poll_contains() == [("odd", [True, False, False, False])], 5, "odd")
    assert tier.contains(odd) == [True, False, False, False]
    tier.delete(odd)


def test_delete_and_lookups(server: RedisServer, opened: list[RedisBackend]) -> None:
    tier = open_tier(opened, server.url)
    drive = TierDriver(tier, CHUNK)
    stored = keys(0, 4)
    missing = keys(100, 2)
    assert drive.put(stored).ok
    asked = [stored[0], missing[0], stored[1], make_key(0, OTHER_NAMESPACE), missing[1]]
    assert tier.contains(asked) == [True, False, True, False, False]
    tier.submit_contains("req-a", asked)
    tier.submit_contains(("req", 2), [])
    tier.delete(stored[:2])  # lookups and gets miss deleted keys from now on
    tier.submit_contains("req-b", stored)
    answers: dict[Any, list[bool]] = {}
    wait_until(lambda: answers.update(tier.poll_contains()) or len(answers) == 3, 5, "answered")
    assert answers[("req", 2)] == []
    assert answers["req-b"] == [False, False, True, True]
    # req-a raced the delete: its deleted keys may read either way, the others may not.
    assert [answers["req-a"][i] for i in (1, 3, 4)] == [False, False, False]
    result, got = drive.get(stored)
    assert result.ok_keys == tuple(stored[2:]) and result.failed_keys == tuple(stored[:2])
    assert got[stored[0]] == bytes([SENTINEL]) * CHUNK
    wait_until(lambda: tier.contains(stored) == [False, False, True, True], 5, "deleted")
    with server.client() as raw:
        assert raw.exists(*(redis_key(k) for k in stored)) == 2
    assert tier.poll_contains() == []


# ----------------------------------------------------------------------------- TTL
def test_ttl_expires_chunks(server: RedisServer, opened: list[RedisBackend]) -> None:
    tier = open_tier(opened, server.url, ttl_seconds=1)
    forever = open_tier(opened, server.url)
    drive = TierDriver(tier, CHUNK)
    expiring, kept = keys(0, 3), keys(10, 1)
    assert drive.put(expiring).ok and TierDriver(forever, CHUNK).put(kept).ok
    with server.client() as raw:
        assert all(0 < raw.pttl(redis_key(k)) <= 1000 for k in expiring)
        assert raw.pttl(redis_key(kept[0])) == -1  # no TTL: no expiry
    drive.assert_loads(expiring)
    time.sleep(1.2)
    result, _ = drive.get(expiring + kept)
    assert result.ok_keys == tuple(kept) and result.failed_keys == tuple(expiring)
    assert tier.contains(expiring) == [False] * 3


# ------------------------------------------------------------------------- framing
def test_damaged_values_fail_and_are_counted(
    server: RedisServer, opened: list[RedisBackend]
) -> None:
    tier = open_tier(opened, server.url)
    drive = TierDriver(tier, CHUNK)
    flipped, truncated, garbage, swapped, good = stored = keys(0, 5)
    assert drive.put(stored).ok
    payload_at = compact_header_len(len(flipped))
    with server.client() as raw:
        byte = raw.getrange(redis_key(flipped), payload_at + 999, payload_at + 999)
        raw.setrange(redis_key(flipped), payload_at + 999, bytes([byte[0] ^ 0x01]))
        raw.set(redis_key(truncated), raw.get(redis_key(truncated))[:-1])
        raw.set(redis_key(garbage), b"not a frame")
        raw.set(redis_key(swapped), raw.get(redis_key(good)))  # intact, but good's frame
    result, got = drive.get(stored)
    assert result.ok_keys == (good,)
    assert result.failed_keys == (flipped, truncated, garbage, swapped)
    for key in result.failed_keys:
        assert got[key] == bytes([SENTINEL]) * CHUNK, "a rejected frame left bytes in the view"
    stats = tier.stats()
    assert stats["checksum_failures"] == 4 and stats["get_failures"] == 4
    assert drive.put(result.failed_keys).ok  # recomputed and stored again
    drive.assert_loads(stored)


def test_another_namespace_sees_nothing(server: RedisServer, opened: list[RedisBackend]) -> None:
    mine = open_tier(opened, server.url)
    other = open_tier(opened, server.url, context(namespace=OTHER_NAMESPACE))
    stored = keys(0, 2)
    assert TierDriver(mine, CHUNK).put(stored).ok
    result, _ = TierDriver(other, CHUNK).get(stored)  # keys of another namespace: refused
    assert result.failed_keys == tuple(stored) and other.contains(stored) == [False, False]


# -------------------------------------------------------------------------- faults
def test_server_killed_mid_run_then_restarted(
    tmp_path: pathlib.Path, opened: list[RedisBackend]
) -> None:
    server = RedisServer(tmp_path / "redis").start()
    try:
        tier = open_tier(opened, server.url, **FAULT_OPTIONS)
        _run_through_a_kill(tier, server)
        assert tier.state is LinkState.DOWN and tier.stats()["up"] == 0
        _check_down_behaviour(tier)
        server.restart()
        wait_until(lambda: tier.state is LinkState.UP, 5, "reconnected")
        stats = tier.stats()
        assert stats["reconnects"] == 1 and stats["state"] == "up"
        drive = TierDriver(tier, CHUNK)
        fresh = keys(5000, 4)
        assert drive.put(fresh).ok  # the restarted server is empty: chunks are recomputed
        drive.assert_loads(fresh)
    finally:
        server.stop()


def _run_through_a_kill(tier: RedisBackend, server: RedisServer) -> None:
    """Keep puts and gets in flight for 1.5 s and kill the server 0.4 s in; check the jobs."""
    submitted: dict[int, list[bytes]] = {}
    results: dict[int, JobResult] = {}
    slowest = 0.0
    job = next_key = 0
    stored: list[bytes] = []
    start = time.monotonic()
    killed_at = None
    while time.monotonic() - start < 1.5:
        if killed_at is None and time.monotonic() - start > 0.4:
            server.kill()
            killed_at = time.monotonic()
        job += 1
        submitted[job] = batch = keys(next_key, 4)
        next_key += 4
        began = time.perf_counter()
        if job % 2 or not stored:
            tier.submit_put(job, batch, [memoryview(make_payload(k, CHUNK)) for k in batch])
        else:
            submitted[job] = batch = stored[-4:]
            tier.submit_get(job, batch, [memoryview(bytearray(CHUNK)) for _ in batch])
        for result in tier.poll():
            assert result.job_id not in results
            results[result.job_id] = result
            if result.job_id % 2:
                stored += result.ok_keys
        slowest = max(slowest, time.perf_counter() - began)
        time.sleep(0.005)
    results.update(wait_for_jobs(tier, set(submitted) - set(results), timeout=10))
    assert set(results) == set(submitted)
    assert slowest < 0.1, f"submit + poll took {slowest:.3f}s while the server died"
    assert any(r.ok for r in results.values()), "nothing succeeded before the kill"
    late = [r for j, r in results.items() if j > max(results) - 20]
    assert all(r.failed_keys == tuple(submitted[r.job_id]) for r in late)
    stats = tier.stats()
    assert stats["connection_errors"] >= 1
    assert stats["put_failures"] + stats["get_failures"] > 0


def _check_down_behaviour(tier: RedisBackend) -> None:
    """While down: jobs fail at once, lookups answer False, attempts keep to the backoff."""
    attempts_before = tier.stats()["connect_attempts"]
    began = time.monotonic()
    drive = TierDriver(tier, CHUNK, timeout=1.0)
    result = drive.put(keys(9000, 2))
    assert result.failed_keys == tuple(keys(9000, 2))
    assert time.monotonic() - began < 0.2, "a job waited for a dead server"
    assert tier.contains(keys(0, 3)) == [False] * 3
    tier.submit_contains("while-down", keys(0, 2))
    wait_until(lambda: tier.poll_contains() == [("while-down", [False, False])], 1, "answered")
    time.sleep(1.5 - (time.monotonic() - began))
    attempts = tier.stats()["connect_attempts"] - attempts_before
    # Waits of 0.05, 0.1, 0.2, 0.4, 0.4, ... (each up to 25% longer): at most 6 in 1.5 s.
    assert 2 <= attempts <= 6, f"{attempts} connection attempts in 1.5 s of downtime"


def test_opened_while_no_server_listens(tmp_path: pathlib.Path, opened: list[RedisBackend]) -> None:
    server = RedisServer(tmp_path / "redis")
    server.port = pick_port()
    began = time.perf_counter()
    tier = open_tier(opened, server.url, **FAULT_OPTIONS)
    assert time.perf_counter() - began < 0.1, "construction waited for the server"
    drive = TierDriver(tier, CHUNK)
    assert drive.put(keys(0, 2)).failed_keys == tuple(keys(0, 2))
    assert tier.state is LinkState.DOWN and tier.stats()["reconnects"] == 0
    try:
        server.restart()
        wait_until(lambda: tier.state is LinkState.UP, 5, "connected")
        assert drive.put(keys(0, 2)).ok
        drive.assert_loads(keys(0, 2))
    finally:
        server.stop()


def test_server_that_stops_answering(tmp_path: pathlib.Path, opened: list[RedisBackend]) -> None:
    server = RedisServer(tmp_path / "redis").start()
    try:
        tier = open_tier(opened, server.url, **FAULT_OPTIONS)
        drive = TierDriver(tier, CHUNK)
        stored = keys(0, 4)
        assert drive.put(stored).ok
        server.pause()
        job = drive.next_job()
        began = time.monotonic()
        tier.submit_get(job, stored, [memoryview(bytearray(CHUNK)) for _ in stored])
        tier.submit_contains("paused", stored)
        assert time.monotonic() - began < 0.05, "submit waited for a server that does not answer"
        result = wait_for_jobs(tier, [job], timeout=5)[job]  # poll() never blocks (kit check)
        assert result.failed_keys == tuple(stored)
        assert time.monotonic() - began < 0.5 + 1.0, "the job outlived the socket timeout"
        wait_until(lambda: tier.poll_contains() == [("paused", [False] * 4)], 3, "answered")
        assert tier.state is LinkState.DOWN
        server.resume()
        wait_until(lambda: tier.state is LinkState.UP, 5, "reconnected")
        drive.assert_loads(stored)  # the server kept its data
        assert tier.stats()["reconnects"] == 1
    finally:
        server.stop()


def test_close_is_prompt_while_down(tmp_path: pathlib.Path) -> None:
    server = RedisServer(tmp_path / "redis")
    server.port = pick_port()
    tier = RedisBackend(RedisSettings(url=server.url, **FAULT_OPTIONS), context())
    for job in range(20):
        tier.submit_put(job, keys(job, 1), [memoryview(bytes(CHUNK))])
    began = time.monotonic()
    tier.close()
    tier.close()
    assert time.monotonic() - began < 2.0
    assert tier.poll() == [] and tier.poll_contains() == []
    left = [t.name for t in threading.enumerate() if t.name.startswith("redis-redis-test")]
    assert left == [], f"threads left running after close(): {left}"
