"""Tenant isolation on a real cache server: tenant A cannot read, overwrite, delete or see tenant B's chunks.

One ``tiercache serve`` subprocess (tests/server/harness.py) on loopback with
four tokens: tenants ``a`` and ``b`` (the two parties), ``a2`` (a second
token for ``a``'s space: the negative control, which *does* share) and
``ops`` (admin). Everything goes through real sockets with the real client;
the NIXL cases (PUT_REMOTE / GET_REMOTE, agent metadata) run when nixl
imports here, with real agents in this process.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest

from tests.server.harness import ServerProcess
from tiercache.server import protocol as p
from tiercache.server.client import ServerClient
from tiercache.server.nixl_path import nixl_available
from tiercache.server.tenants import SPACE_BYTES
from tiercache.testing.payloads import make_key, make_payload

CHUNK = 16 * 1024
MAX_KEY = 100
TOKENS = {"a": "token-of-tenant-a-0123456789", "b": "token-of-tenant-b-0123456789",
          "a2": "second-token-for-space-a-0123", "ops": "admin-token-0123456789abcdef"}
TENANTS = [
    {"name": "a", "token": TOKENS["a"]},
    {"name": "b", "token": TOKENS["b"]},
    {"name": "a2", "token": TOKENS["a2"], "space": "a"},
    {"name": "ops", "token": TOKENS["ops"], "admin": True},
]


def start(directory: pathlib.Path, **extra: object) -> ServerProcess:
    return ServerProcess(directory, tenants=TENANTS, max_value_bytes=CHUNK, max_key_bytes=MAX_KEY,
                         hello_timeout_s=5.0, tiers=[{"name": "cpu", "backend": "cpu", "capacity": "4MiB"}],
                         **extra).start()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start(tmp_path_factory.mktemp("tenants"))
    yield proc
    proc.kill()
    assert "internal" not in proc.log(), proc.log()


def client(server: ServerProcess, tenant: str, **kw: object) -> ServerClient:
    c = ServerClient(server.address, token=TOKENS[tenant], client_name=f"client-of-{tenant}", **kw)  # type: ignore[arg-type]
    c.connect()
    return c


def chunks(first: int, n: int, version: int) -> dict[bytes, bytes]:
    return {make_key(i): make_payload(make_key(i), CHUNK, version) for i in range(first, first + n)}


def read(c: ServerClient, keys: list[bytes]) -> tuple[list[p.Status], list[bytes]]:
    views = [memoryview(bytearray(CHUNK)) for _ in keys]
    statuses, sizes = c.get(keys, views)
    return statuses, [bytes(v[:n]) for v, n in zip(views, sizes)]


def test_tenant_cannot_read_overwrite_delete_or_probe_anothers_chunks(server: ServerProcess) -> None:
    mine, theirs = chunks(0, 4, version=1), chunks(0, 4, version=2)  # the SAME keys, other bytes
    keys = list(mine)
    with client(server, "a") as a, client(server, "b") as b:
        assert a.put(keys, list(mine.values())) == [p.Status.OK] * 4
        # b: EXISTS and GET see nothing, DELETE removes nothing
        assert b.exists(keys) == [False] * 4
        assert read(b, keys)[0] == [p.Status.MISS] * 4
        assert b.delete(keys) == 0
        # b's PUT of the same keys lands in b's own space, even with overwrite: a's bytes are untouched
        assert b.put(keys, list(theirs.values()), overwrite=True) == [p.Status.OK] * 4
        assert read(a, keys) == ([p.Status.OK] * 4, list(mine.values()))
        assert read(b, keys) == ([p.Status.OK] * 4, list(theirs.values()))  # both coexist
        # b deleting its own copies leaves a's
        assert b.delete(keys) == 4
        assert a.exists(keys) == [True] * 4 and b.exists(keys) == [False] * 4
        assert read(a, keys) == ([p.Status.OK] * 4, list(mine.values()))


def test_two_tokens_of_one_space_do_share(server: ServerProcess) -> None:
    """Negative control: the isolation above is the space, not a broken store. a2 names a's space."""
    data = chunks(100, 3, version=1)
    newer = chunks(100, 3, version=7)
    keys = list(data)
    with client(server, "a") as a, client(server, "a2") as a2, client(server, "b") as b:
        assert a.put(keys, list(data.values())) == [p.Status.OK] * 3
        assert a2.exists(keys) == [True] * 3
        assert read(a2, keys) == ([p.Status.OK] * 3, list(data.values()))
        assert a2.put(keys, list(newer.values())) == [p.Status.PRESENT] * 3  # overwrite is off by default
        assert a2.put(keys, list(newer.values()), overwrite=True) == [p.Status.OK] * 3
        assert read(a, keys) == ([p.Status.OK] * 3, list(newer.values()))
        assert a2.delete(keys[:1]) == 1 and a.exists(keys) == [False, True, True]
        assert b.exists(keys) == [False] * 3


def test_stats_and_health_show_a_tenant_only_itself(server: ServerProcess) -> None:
    with client(server, "a") as a, client(server, "b") as b, client(server, "ops") as ops:
        data = chunks(200, 2, version=1)
        assert b.put(list(data), list(data.values())) == [p.Status.OK] * 2
        read(b, list(data))
        mine = a.stats()
        assert mine.tenant_view == "a"
        assert {c.client for c in mine.clients} == {"client-of-a"}  # not b's, not ops'
        assert mine.used_bytes == 0 and mine.stored == 0 and mine.refused_messages == 0
        assert all(t.used_bytes == t.chunks == t.hit_chunks == t.stored_chunks == t.evictions == 0
                   for t in mine.tiers)
        assert mine.tiers[0].capacity_bytes > 0 and mine.max_value_bytes == CHUNK  # config: visible
        theirs = b.stats()
        assert {c.client for c in theirs.clients} == {"client-of-b"}
        assert theirs.get_keys >= 2 and theirs.put_keys >= 2  # b's own counters
        assert a.health().connections == len(mine.clients)
        # the admin sees every tenant's clients and the store (the control: the rows a did not see exist)
        everything = ops.stats()
        assert everything.tenant_view == ""
        assert {"client-of-a", "client-of-b", "client-of-ops"} <= {c.client for c in everything.clients}
        assert everything.used_bytes > 0 and everything.tiers[0].chunks >= 2
        assert ops.health().connections >= 3


def test_unknown_tokens_are_refused_and_keys_are_bounded(server: ServerProcess) -> None:
    for token in ("", "wrong", TOKENS["a"][:-1], TOKENS["a"] + "x"):
        with pytest.raises(p.RemoteError) as err:
            ServerClient(server.address, token=token).connect()
        assert err.value.code == "unauthorized" and "tenant" not in err.value.message
    with client(server, "a") as a:
        assert a.welcome is not None and a.welcome.max_key_bytes == MAX_KEY - SPACE_BYTES
        longest = b"k" * (MAX_KEY - SPACE_BYTES)
        assert a.put([longest], [b"v" * 64]) == [p.Status.OK]
        assert read(a, [longest])[1] == [b"v" * 64]
        with pytest.raises(p.RemoteError) as err:
            a.exists([longest + b"k"])
        assert err.value.code == "limit_exceeded"


# ------------------------------------------------------------------------------ NIXL
nixl_only = pytest.mark.skipif(not nixl_available(), reason="nixl is not installed")


@pytest.fixture(scope="module")
def nixl_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start(tmp_path_factory.mktemp("tenants-nixl"), nixl="on")
    yield proc
    proc.kill()
    assert "internal" not in proc.log(), proc.log()


class Agent:
    """A real NIXL client agent with one registered arena (what the client tier uses)."""

    def __init__(self) -> None:
        from tiercache.server.nixl_client import NixlClientSide

        self.side = NixlClientSide(1 << 20, 1)
        self.arena, self.addr = self.side.arena(0)

    def connect(self, server: ServerProcess, tenant: str, metadata: bytes | None = None) -> ServerClient:
        return client(server, tenant, nixl_metadata=metadata if metadata is not None else self.side.metadata()[1],
                      nixl_agent=self.side.agent_name, nixl_progress=self.side.progress, timeout_s=30.0)

    def put(self, c: ServerClient, data: dict[bytes, bytes], overwrite: bool = False) -> list[p.Status]:
        for i, value in enumerate(data.values()):
            self.arena[i * CHUNK : (i + 1) * CHUNK] = value
        return c.put_remote(list(data), [CHUNK] * len(data), [self.addr + i * CHUNK for i in range(len(data))],
                            overwrite)

    def get(self, c: ServerClient, keys: list[bytes]) -> tuple[list[p.Status], list[bytes]]:
        self.arena[: len(keys) * CHUNK] = bytes(len(keys) * CHUNK)
        statuses, sizes = c.get_remote(keys, [CHUNK] * len(keys), [self.addr + i * CHUNK for i in range(len(keys))])
        return statuses, [bytes(self.arena[i * CHUNK : i * CHUNK + n]) for i, n in enumerate(sizes)]

    def close(self) -> None:
        self.side.close()


@nixl_only
def test_nixl_put_remote_and_get_remote_are_scoped(nixl_server: ServerProcess) -> None:
    agent_a, agent_b, agent_a2 = Agent(), Agent(), Agent()
    mine, theirs = chunks(300, 3, version=1), chunks(300, 3, version=2)
    keys = list(mine)
    try:
        with agent_a.connect(nixl_server, "a") as a, agent_b.connect(nixl_server, "b") as b, \
                agent_a2.connect(nixl_server, "a2") as a2:
            assert a.welcome and b.welcome and a2.welcome and a.welcome.nixl and b.welcome.nixl
            assert agent_a.put(a, mine) == [p.Status.OK] * 3
            assert agent_b.get(b, keys)[0] == [p.Status.MISS] * 3  # GET_REMOTE: not b's
            assert agent_b.put(b, theirs, overwrite=True) == [p.Status.OK] * 3  # PUT_REMOTE: b's own space
            assert agent_a.get(a, keys) == ([p.Status.OK] * 3, list(mine.values()))
            assert agent_b.get(b, keys) == ([p.Status.OK] * 3, list(theirs.values()))
            assert b.delete(keys) == 3 and a.exists(keys) == [True] * 3
            # negative control: a2 shares a's space, over NIXL too
            assert agent_a2.get(a2, keys) == ([p.Status.OK] * 3, list(mine.values()))
    finally:
        for agent in (agent_a, agent_b, agent_a2):
            agent.close()


@nixl_only
def test_nixl_agent_of_another_tenant_cannot_be_taken_over(nixl_server: ServerProcess) -> None:
    """b presenting a's agent metadata would make the server WRITE a's GET_REMOTE values to b."""
    agent_a, agent_b = Agent(), Agent()
    data = chunks(400, 2, version=3)
    try:
        with agent_a.connect(nixl_server, "a") as a:
            assert agent_a.put(a, data) == [p.Status.OK] * 2
            stolen = agent_a.side.metadata()[1]
            # HELLO with a's metadata from tenant b: no NIXL for that connection
            with agent_b.connect(nixl_server, "b", metadata=stolen) as b:
                assert b.welcome is not None and not b.welcome.nixl
            # AGENT_META with a's metadata on b's own NIXL connection: refused, connection closed
            with agent_b.connect(nixl_server, "b") as b:
                assert b.welcome is not None and b.welcome.nixl
                with pytest.raises(p.RemoteError) as err:
                    b.agent_meta(stolen)
                assert err.value.code == "unauthorized"
            # a's agent still serves a
            assert agent_a.get(a, list(data)) == ([p.Status.OK] * 2, list(data.values()))
            # negative control: a second connection of tenant a may use a's agent (an engine's I/O threads do)
            with agent_a.connect(nixl_server, "a", metadata=stolen) as again:
                assert again.welcome is not None and again.welcome.nixl
                again.agent_meta(stolen)
                assert agent_a.get(again, list(data)) == ([p.Status.OK] * 2, list(data.values()))
    finally:
        agent_a.close()
        agent_b.close()


def test_inspect_needs_an_admin_token_for_the_whole_server(server: ServerProcess) -> None:
    import subprocess
    import sys

    from tests.server.harness import ROOT

    def inspect(token: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "tiercache.server.inspect_cli", "--server", server.address,
                               "--token", token], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)

    with client(server, "b"):
        tenant = inspect(TOKENS["a"])
        assert tenant.returncode == 0, tenant.stderr
        assert "tenant view (a)" in tenant.stdout and "client-of-b" not in tenant.stdout
        admin = inspect(TOKENS["ops"])
        assert admin.returncode == 0 and "tenant view" not in admin.stdout and "client-of-b" in admin.stdout
    refused = inspect("not-a-token")
    assert refused.returncode == 1 and "unauthorized" in refused.stderr and "not-a-token" not in refused.stderr
