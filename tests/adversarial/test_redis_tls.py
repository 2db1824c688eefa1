"""The Redis tier over TLS, against real redis-server processes listening for TLS only (loopback).

Certificates are made by the test (tests/integration/tls_certs.py: a CA, a
server certificate for localhost and 127.0.0.1, a client certificate, and an
unrelated CA). The servers have no plain-TCP port (``--port 0``), so a tier
that works there spoke TLS.

* standalone, with client certificates demanded (``tls-auth-clients yes``)
  and a password: ``rediss://`` and ``tls: true`` both work; ``server_name``
  is what the certificate is checked against;
* negative controls, each a clear start-up error that names no secret: a
  plain-TCP config against the TLS port; no client certificate; a CA that did
  not sign the server's certificate; a name the certificate does not carry
  (accepted once ``check_hostname`` is off); TLS against a plain-TCP server;
* TLS options without TLS are a config error (a CA file alone would otherwise
  leave the traffic in clear);
* a 3-master Redis Cluster over TLS (``tls-cluster yes``), the tier logged in
  as an ACL user with the least privilege a cluster needs (``auth.CLUSTER_ACL``):
  the tier works; a wrong password, a user missing a permission and a
  plain-TCP config are clear errors.
"""

from __future__ import annotations

import logging
import pathlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import ValidationError
from tiercache.backends.redis.auth import CLUSTER_ACL, RedisAuthError, RedisTLSError
from tiercache.backends.redis.backend import LinkState, RedisBackend, RedisSettings
from tiercache.backends.redis.client import close_client, connect

from tests.integration.redis_servers import Access, RedisClusterNodes, RedisServer, TierDriver
from tests.integration.tls_certs import CertFiles, make_certs
from tiercache.backend import BackendContext
from tiercache.testing.conformance import make_key

NS = b"tls-ns--"
CHUNK = 4 << 10
PASSWORD = "tls-Hq2d-secret"
FAST: dict[str, Any] = {
    "socket_timeout": 0.5, "connect_timeout": 0.5,
    "reconnect_initial_s": 0.05, "reconnect_max_s": 0.2,
}


def keys(first: int, count: int) -> list[bytes]:
    return [make_key(i, NS) for i in range(first, first + count)]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> CertFiles:
    return make_certs(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_server(pki: CertFiles, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    access = Access(password=PASSWORD, tls=pki, tls_auth_clients=True)
    server = RedisServer(tmp_path_factory.mktemp("redis-tls"), access=access).start()
    try:
        yield server
    finally:
        server.stop()


def tls_options(pki: CertFiles, **extra: Any) -> dict[str, Any]:
    return {"password": PASSWORD, "ca_file": str(pki.ca), "cert_file": str(pki.client_cert),
            "key_file": str(pki.client_key), **FAST, **extra}


def refused(settings: RedisSettings, error: type[Exception], words: str) -> str:
    """connect() fails with ``error`` whose message holds ``words`` and no secret."""
    with pytest.raises(error) as raised:
        connect(settings, "probe")
    message = str(raised.value)
    assert words in message, message
    assert PASSWORD not in message and PASSWORD not in repr(raised.value)
    return message


def test_tier_over_tls(tls_server: RedisServer, pki: CertFiles) -> None:
    plain_url = tls_server.url.replace("rediss://", "redis://")
    for settings in (
        RedisSettings(url=tls_server.url, **tls_options(pki)),
        RedisSettings(url=plain_url, tls=True, **tls_options(pki)),  # tls: true == rediss://
        RedisSettings(url=f"rediss://localhost:{tls_server.port}/0", **tls_options(pki)),
        RedisSettings(url=tls_server.url, server_name="localhost", **tls_options(pki)),
    ):
        tier = RedisBackend(settings, BackendContext("tls-test", NS, CHUNK, 64 << 20))
        try:
            drive = TierDriver(tier, CHUNK, timeout=10)
            stored = keys(0, 6)
            assert drive.put(stored).ok
            drive.assert_loads(stored)
            assert tier.contains(stored[:2]) == [True, True]
            assert tier.stats()["connection_errors"] == 0
        finally:
            tier.close()


def test_tls_refusals_are_clear_start_up_errors(
    tls_server: RedisServer, pki: CertFiles, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    plain_url = tls_server.url.replace("rediss://", "redis://")
    # A plain-TCP config against the TLS port.
    refused(RedisSettings(url=plain_url, password=PASSWORD, **FAST), RedisTLSError,
            "if that port speaks TLS, use a rediss:// url or tls: true")
    # TLS, but no client certificate for a server that wants one.
    refused(RedisSettings(url=tls_server.url, password=PASSWORD, ca_file=str(pki.ca), **FAST),
            RedisTLSError, "client certificate")
    # A CA that did not sign the server's certificate.
    refused(RedisSettings(url=tls_server.url, **tls_options(pki, ca_file=str(pki.other_ca))),
            RedisTLSError, "certificate was not accepted")
    # A name the certificate does not carry; accepted (same CA) once check_hostname is off.
    wrong = tls_options(pki, server_name="redis.invalid")
    refused(RedisSettings(url=tls_server.url, **wrong), RedisTLSError,
            "certificate was not accepted")
    close_client(connect(RedisSettings(url=tls_server.url, check_hostname=False, **wrong), "ok"))
    # The TLS handshake fine, the password wrong: an authentication error, over TLS.
    refused(RedisSettings(url=tls_server.url, **tls_options(pki, password="not-it-at-all")),
            RedisAuthError, f"authentication failed for user default at {tls_server.address}")
    # The tier itself: opens, logs the refusal at ERROR, stays down, misses.
    tier = RedisBackend(RedisSettings(url=plain_url, password=PASSWORD, **FAST),
                        BackendContext("tls-test", NS, CHUNK, 64 << 20))
    try:
        assert TierDriver(tier, CHUNK, timeout=5).put(keys(0, 1)).failed_keys == tuple(keys(0, 1))
        assert tier.state is LinkState.DOWN
        deadline = time.monotonic() + 5  # the line follows the state change, on the link's thread
        while not any(r.levelno == logging.ERROR and "rediss://" in r.getMessage()
                      for r in caplog.records):
            assert time.monotonic() < deadline, "the refusal was not logged at ERROR"
            time.sleep(0.01)
    finally:
        tier.close()
    assert not [r for r in caplog.records if PASSWORD in r.getMessage()]


def test_tls_client_against_a_plain_server(tmp_path: pathlib.Path, pki: CertFiles) -> None:
    server = RedisServer(tmp_path / "plain").start()
    try:
        settings = RedisSettings(url=server.url, tls=True, ca_file=str(pki.ca), **FAST)
        refused(settings, RedisTLSError, "if that port speaks plain TCP, use a redis:// url")
        close_client(connect(RedisSettings(url=server.url, **FAST), "control"))  # plain works
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"ca_file": "/etc/hostname"}, "neither tls: true nor a rediss:// url"),
        ({"server_name": "x"}, "neither tls: true nor a rediss:// url"),
        ({"tls": True, "cert_file": "/etc/hostname"}, "cert_file and key_file go together"),
        ({"tls": True, "ca_file": "/nonexistent/ca.pem"}, "ca_file: /nonexistent/ca.pem is not"),
        ({"url": "unix:///tmp/r.sock", "tls": True}, "not unix"),
        ({"password_env": "TC_TEST_SURELY_UNSET_VAR"}, "is not set"),
        ({"password": "a", "password_file": "/etc/hostname"}, "one password source"),
        ({"password": ""}, "password: empty"),
    ],
)
def test_access_options_are_validated(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        RedisSettings(**options)


def test_cluster_over_tls(pki: CertFiles, tmp_path: pathlib.Path) -> None:
    users = (("tier", "on", f">{PASSWORD}", *CLUSTER_ACL),
             ("stingy", "on", f">{PASSWORD}", *CLUSTER_ACL, "-command"))
    access = Access(password="cluster-admin-pw", users=users, tls=pki)
    nodes = RedisClusterNodes(tmp_path / "cluster", access=access)
    nodes.start()
    try:
        seed = f"rediss://127.0.0.1:{nodes.servers[0].port}/0"
        options = {"username": "tier", "password": PASSWORD, "ca_file": str(pki.ca), **FAST}
        settings = RedisSettings(url=seed, cluster=True, nodes=tuple(nodes.seeds), **options)
        tier = RedisBackend(settings, BackendContext("tls-cluster", NS, CHUNK, 64 << 20))
        try:
            drive = TierDriver(tier, CHUNK, timeout=10)
            stored = keys(0, 48)  # spread over the slots of all three masters
            assert drive.put(stored).ok
            drive.assert_loads(stored)
            for server in nodes.servers:
                with server.client() as raw:
                    assert raw.dbsize() > 0, "a master got no chunk: not spread over the cluster"
        finally:
            tier.close()
        wrong = RedisSettings(url=seed, cluster=True, **{**options, "password": "not-it-at-all"})
        refused(wrong, RedisAuthError,
                f"authentication failed for user tier at {nodes.servers[0].address}")
        stingy = RedisSettings(url=seed, cluster=True, **{**options, "username": "stingy"})
        refused(stingy, RedisAuthError, "lacks a permission the tier needs")  # no +command
        plain = RedisSettings(url=seed.replace("rediss", "redis"), cluster=True,
                              username="tier", password=PASSWORD, **FAST)
        refused(plain, RedisTLSError, "rediss://")
    finally:
        nodes.stop()
