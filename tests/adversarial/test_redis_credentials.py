"""The Redis tier against real redis-server processes that demand credentials (loopback only).

* ``requirepass``: the tier with the password works; the same tier without it
  is refused (negative control: the server really enforces auth);
* an ACL user with the least privilege the tier needs (``auth.TIER_ACL``, the
  rules the error for a missing permission quotes), its password given as
  ``password``, ``password_env`` or ``password_file``;
  the user really is confined (a key outside ``tc:*`` is refused);
* a wrong password: :func:`connect` raises "authentication failed for user
  alice at 127.0.0.1:PORT", the tier opens without raising, logs that at
  ERROR, stays down and every job misses at once;
* credentials changed at run time (password rotated, user disabled, a
  permission revoked, with the server dropping the user's connections): jobs
  miss, counters count, no exception escapes; a rewritten ``password_file``
  brings the tier back by itself;
* secrets: neither the settings' repr, JSON, validation errors, config
  errors, connect errors nor any log line (all loggers, DEBUG) shows a password.
"""

from __future__ import annotations

import logging
import pathlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from pydantic import ValidationError
from tiercache.backends.redis.auth import TIER_ACL, RedisAuthError
from tiercache.backends.redis.backend import LinkState, RedisBackend, RedisSettings
from tiercache.backends.redis.client import close_client, connect

from tests.integration.redis_servers import Access, RedisServer, TierDriver
from tiercache.backend import BackendContext
from tiercache.config.schema import ConfigError, TierConfig
from tiercache.testing.conformance import make_key
from tiercache.tiers import registry

NS = b"auth-ns-"
CHUNK = 4 << 10
ADMIN_PW = "admin-Zq8v-secret"
ALICE_PW = "alice-Kx3m-secret"
NEW_PW = "alice-Rt7w-rotated"
WRONG_PW = "alice-Wr0ng-guess"
SECRETS = (ADMIN_PW, ALICE_PW, NEW_PW, WRONG_PW)
ALICE = ("alice", "on", f">{ALICE_PW}", *TIER_ACL)  # the least privilege the tier needs
FAST: dict[str, Any] = {
    "socket_timeout": 0.5, "connect_timeout": 0.5,
    "reconnect_initial_s": 0.05, "reconnect_max_s": 0.2,
}


def keys(first: int, count: int) -> list[bytes]:
    return [make_key(i, NS) for i in range(first, first + count)]


def context() -> BackendContext:
    return BackendContext("auth-test", NS, CHUNK, 64 << 20)


def wait_until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {timeout}s")
        time.sleep(0.01)


def assert_no_secret(texts: list[str]) -> None:
    for text in texts:
        for secret in SECRETS:
            assert secret not in text, f"a password leaked into: {text[:200]!r}"


def log_texts(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Every captured record, formatted with its traceback if it has one."""
    formatter = logging.Formatter("%(name)s %(levelname)s %(message)s")
    return [formatter.format(record) for record in caplog.records]


@pytest.fixture
def server(tmp_path: pathlib.Path) -> Iterator[RedisServer]:
    """A server whose default user has a password and which knows the ACL user alice."""
    server = RedisServer(tmp_path / "redis", access=Access(password=ADMIN_PW, users=(ALICE,)))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def opened() -> Iterator[list[RedisBackend]]:
    tiers: list[RedisBackend] = []
    yield tiers
    for tier in tiers:
        tier.close()


@pytest.fixture(autouse=True)
def all_logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Capture every logger at DEBUG; after the test, no record may hold a password."""
    caplog.set_level(logging.DEBUG)
    yield caplog
    assert_no_secret(log_texts(caplog))


def open_tier(opened: list[RedisBackend], url: str, **options: Any) -> RedisBackend:
    tier = RedisBackend(RedisSettings(url=url, **{**FAST, **options}), context())
    opened.append(tier)
    return tier


def auth_errors(caplog: pytest.LogCaptureFixture, user: str, where: str) -> list[str]:
    wanted = f"authentication failed for user {user} at {where}"
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.ERROR and wanted in r.getMessage()]


# -------------------------------------------------------------------------- requirepass
def test_requirepass_works_and_no_password_is_refused(
    server: RedisServer, opened: list[RedisBackend], caplog: pytest.LogCaptureFixture
) -> None:
    tier = open_tier(opened, server.url, password=ADMIN_PW)
    drive = TierDriver(tier, CHUNK)
    assert drive.put(keys(0, 3)).ok
    drive.assert_loads(keys(0, 3))
    assert tier.contains(keys(0, 4)) == [True, True, True, False]
    # Negative control: the same tier without the password is refused, so auth is exercised.
    bare = open_tier(opened, server.url)
    assert drive.put(keys(0, 1)).ok
    result, _ = TierDriver(bare, CHUNK).get(keys(0, 1))
    assert result.failed_keys == tuple(keys(0, 1)) and bare.state is LinkState.DOWN
    wait_until(lambda: auth_errors(caplog, "default", server.address), 5, "logged")
    assert "none is configured" in auth_errors(
        caplog, "default", server.address)[0]
    with pytest.raises(RedisAuthError, match=f"user default at {server.address}"):
        connect(RedisSettings(url=server.url, **FAST), "probe")


# ----------------------------------------------------------------------------- ACL user
@pytest.mark.parametrize("source", ["password", "password_env", "password_file"])
def test_acl_user_with_least_privilege(
    server: RedisServer, opened: list[RedisBackend], source: str, tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    options: dict[str, Any] = {"username": "alice"}
    if source == "password":
        options["password"] = ALICE_PW
    elif source == "password_env":
        monkeypatch.setenv("TC_TEST_REDIS_PW", ALICE_PW)
        options["password_env"] = "TC_TEST_REDIS_PW"
    else:
        (tmp_path / "pw").write_text(ALICE_PW + "\n")
        options["password_file"] = str(tmp_path / "pw")
    tier = open_tier(opened, server.url, **options)
    drive = TierDriver(tier, CHUNK)
    stored = keys(0, 5)
    assert drive.put(stored).ok
    drive.assert_loads(stored)
    tier.delete(stored[:2])
    wait_until(lambda: tier.contains(stored) == [False, False, True, True, True], 5, "deleted")
    stats = tier.stats()
    assert stats["server_errors"] == 0 and stats["connection_errors"] == 0
    with server.client() as admin:  # the tier named itself as alice
        assert any(c["user"] == "alice" and c["name"].startswith("tiercache-")
                   for c in admin.client_list())
    # The user really is confined: a key outside tc:* is refused (the rules are enforced).
    with server.client(username="alice", password=ALICE_PW) as as_alice, pytest.raises(
        redis.exceptions.NoPermissionError
    ):
        as_alice.set("elsewhere", b"x")


def test_wrong_password_is_a_clear_start_up_error(
    server: RedisServer, opened: list[RedisBackend], caplog: pytest.LogCaptureFixture
) -> None:
    settings = RedisSettings(url=server.url, username="alice", password=WRONG_PW, **FAST)
    with pytest.raises(RedisAuthError) as raised:
        connect(settings, "probe")
    message = str(raised.value)
    assert message.startswith(f"authentication failed for user alice at {server.address}")
    assert_no_secret([message, repr(raised.value)])
    # The tier opens without raising, says so at ERROR, and misses at once while refused.
    tier = RedisBackend(settings, context())
    opened.append(tier)
    wait_until(lambda: tier.state is LinkState.DOWN, 5, "down")
    wait_until(lambda: auth_errors(caplog, "alice", server.address), 5, "logged at ERROR")
    result = TierDriver(tier, CHUNK, timeout=2).put(keys(0, 2))
    assert result.failed_keys == tuple(keys(0, 2))
    assert tier.contains(keys(0, 2)) == [False, False]
    attempts = tier.stats()["connect_attempts"]
    wait_until(lambda: tier.stats()["connect_attempts"] > attempts + 1, 5, "retrying")
    assert len(auth_errors(caplog, "alice", server.address)) == 1, "repeats are not ERROR"
    if "auth_failures" in tier.stats():  # counted where the backend's counter set names it
        assert int(tier.stats()["auth_failures"]) >= 2


# -------------------------------------------------------------------------- at run time
def test_credentials_changed_at_run_time(
    server: RedisServer, opened: list[RedisBackend], caplog: pytest.LogCaptureFixture,
    tmp_path: pathlib.Path,
) -> None:
    password_file = tmp_path / "alice.pw"
    password_file.write_text(ALICE_PW)
    tier = open_tier(opened, server.url, username="alice", password_file=str(password_file))
    drive = TierDriver(tier, CHUNK, timeout=5)
    stored = keys(0, 4)
    assert drive.put(stored).ok
    admin = server.client()

    def cut_off(*rules: str) -> None:
        admin.execute_command("ACL", "SETUSER", "alice", *rules)
        admin.execute_command("CLIENT", "KILL", "USER", "alice")  # as after a network blip

    def misses_while_refused() -> None:
        result, _ = drive.get(stored)
        assert result.failed_keys == tuple(stored)  # a miss: the engine recomputes
        assert drive.put(keys(100, 2)).failed_keys == tuple(keys(100, 2))
        wait_until(lambda: tier.state is LinkState.DOWN, 5, "down")
        assert tier.contains(stored) == [False] * 4

    try:
        # 1. The password is rotated on the server: refused, misses, one ERROR line.
        cut_off("resetpass", f">{NEW_PW}")
        misses_while_refused()
        stats = tier.stats()
        assert stats["connection_errors"] >= 1 and stats["get_failures"] >= 4
        wait_until(lambda: auth_errors(caplog, "alice", server.address), 5, "logged")
        # 2. The new password is written to password_file: the tier comes back by itself.
        password_file.write_text(NEW_PW)
        wait_until(lambda: tier.state is LinkState.UP, 5, "reconnected")
        drive.assert_loads(stored)
        assert tier.stats()["reconnects"] == 1
        # 3. A permission revoked on a live connection: error replies, counted, the tier stays up.
        admin.execute_command("ACL", "SETUSER", "alice", "-get")
        errors = tier.stats()["server_errors"]
        result, _ = drive.get(stored)
        assert result.failed_keys == tuple(stored) and tier.state is LinkState.UP
        assert tier.stats()["server_errors"] == errors + 4
        admin.execute_command("ACL", "SETUSER", "alice", "+get")
        drive.assert_loads(stored)
        # 4. The user disabled: refused again, logged again at ERROR, misses.
        logged = len(auth_errors(caplog, "alice", server.address))
        cut_off("off")
        misses_while_refused()
        wait_until(lambda: len(auth_errors(caplog, "alice", server.address)) > logged, 5, "logged")
        admin.execute_command("ACL", "SETUSER", "alice", "on")
        wait_until(lambda: tier.state is LinkState.UP, 5, "back")
        drive.assert_loads(stored)
    finally:
        admin.close()


# ------------------------------------------------------------------------------ secrets
def test_no_secret_in_settings_errors_or_config_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    in_url = RedisSettings(url=f"redis://alice:{ALICE_PW}@127.0.0.1:6379/0")
    assert in_url.password is not None and in_url.password.get_secret_value() == ALICE_PW
    assert in_url.username == "alice" and in_url.url == "redis://127.0.0.1:6379/0"
    monkeypatch.setenv("TC_TEST_REDIS_PW", NEW_PW)
    shown = [repr(in_url), str(in_url), in_url.model_dump_json(),
             repr(RedisSettings(password=ADMIN_PW)),
             repr(RedisSettings(password_env="TC_TEST_REDIS_PW"))]
    for bad in ({"url": f"redis://:{WRONG_PW}@h:1/0", "password": ADMIN_PW},
                {"url": f"redis://:{WRONG_PW}@h:1/0", "ttl_seconds": 0},
                {"password": WRONG_PW, "tls": "maybe"},
                {"url": f"redis://h:1/0?password={WRONG_PW}"}):
        with pytest.raises(ValidationError) as raised:
            RedisSettings(**bad)
        shown.append(str(raised.value))
        tier = TierConfig(name="r", backend="redis", capacity=1 << 20, options=bad)
        with pytest.raises(ConfigError) as config_error:
            registry.create_backend(tier, context(), index=2)
        assert "tiers.2.options" in str(config_error.value)
        shown.append(str(config_error.value))
    assert_no_secret(shown)


def test_a_connection_pool_and_its_connections_show_no_secret(server: RedisServer) -> None:
    client = connect(RedisSettings(url=server.url, password=ADMIN_PW), "probe")
    try:
        assert client.ping()
        pool = client.connection_pool
        shown = [repr(client), repr(pool), repr(pool.connection_kwargs)]
        assert_no_secret(shown)
    finally:
        close_client(client)
