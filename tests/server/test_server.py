"""The cache server as a user runs it: a ``tiercache serve`` subprocess on a free loopback port.

Auth (constant-time token check), the loopback default, every request type,
a client vanishing mid-put, SIGTERM draining an in-flight put and exiting 0,
a warm restart from the disk tier, Prometheus /metrics, the inspect and bench
commands, and the client tier riding out a dead server.
"""

from __future__ import annotations

import hmac
import json
import pathlib
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest
from tiercache.backends.server.backend import ServerBackend, ServerSettings

from tests.server.harness import ROOT, ServerProcess, free_port
from tiercache.backend import BackendContext
from tiercache.config.schema import ConfigError
from tiercache.server import auth
from tiercache.server import protocol as p
from tiercache.server.client import ServerClient
from tiercache.server.config import ServerConfig, load_server_config
from tiercache.server.slab import HEADER_ALLOWANCE, slot_bytes_for
from tiercache.testing.conformance import make_key, make_payload, wait_for_jobs

KiB = 1024
CHUNK = 64 * KiB


def cpu_tier(capacity: str = "8MiB") -> list[dict[str, object]]:
    return [{"name": "cpu", "backend": "cpu", "capacity": capacity}]


@pytest.fixture
def server(tmp_path: pathlib.Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path / "srv", max_value_bytes=CHUNK, tiers=cpu_tier()).start()
    yield proc
    proc.kill()


def values(n: int, size: int = CHUNK, version: int = 0) -> dict[bytes, bytes]:
    keys = [make_key(i) for i in range(n)]
    return {k: make_payload(k, size, version) for k in keys}


def read_back(client: ServerClient, keys: list[bytes], size: int = CHUNK) -> tuple[list[p.Status], list[bytes]]:
    views = [memoryview(bytearray(size)) for _ in keys]
    statuses, sizes = client.get(keys, views)
    return statuses, [bytes(v[:n]) for v, n in zip(views, sizes)]


# ------------------------------------------------------------------------------ auth and binding
def test_binds_loopback_by_default(server: ServerProcess) -> None:
    assert ServerConfig(auth="none").host == "127.0.0.1"  # auth: token (default) needs a token
    assert "host" not in server.config
    listening = set()
    for line in pathlib.Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == "0A":  # LISTEN
            addr, port = local.split(":")
            listening.add((addr, int(port, 16)))
    assert ("0100007F", server.port) in listening  # 127.0.0.1, little-endian hex
    assert ("00000000", server.port) not in listening  # not 0.0.0.0


def test_auth_token_required_and_compared_in_constant_time(tmp_path: pathlib.Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    proc = ServerProcess(tmp_path / "srv", auth_token="s3cret-token", max_value_bytes=CHUNK,
                         tiers=cpu_tier()).start()
    try:
        for token in (None, "", "wrong", "s3cret-toke", "s3cret-token2"):
            with pytest.raises(p.RemoteError) as refused:
                ServerClient(proc.address, token=token).connect()
            assert refused.value.code == "unauthorized"
        with ServerClient(proc.address, token="s3cret-token") as client:
            assert client.health().status == "ok"
            assert client.stats().refused_messages == 5
    finally:
        proc.kill()
    # Tokens name tenants now (tiercache/server/auth.py): every configured token's digest is
    # compared, in constant time, whichever matched; auth: none is the open table.
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    from tiercache.server.tenants import Tenant
    table = auth.TokenTable([("abc", Tenant("a", b"A" * 8)), ("xyz", Tenant("b", b"B" * 8))])
    assert table.authenticate("abc").name == "a"
    with pytest.raises(p.Unauthorized):
        table.authenticate("abd")
    assert auth.TokenTable((), open_access=True).authenticate("anything").space == b""  # open
    digest = auth.token_digest
    assert calls == [(digest("abc"), digest("abc")), (digest("xyz"), digest("abc")),
                     (digest("abc"), digest("abd")), (digest("xyz"), digest("abd"))]


# ------------------------------------------------------------------------------ round trips
def test_put_get_exists_delete_stats_health(server: ServerProcess) -> None:
    chunks = values(6)
    keys = list(chunks)
    with ServerClient(server.address, client_name="rt") as c:
        welcome = c.welcome
        assert welcome is not None and welcome.max_value_bytes == CHUNK and not welcome.nixl
        assert c.put(keys, list(chunks.values())) == [p.Status.OK] * 6
        missing = make_key(999)
        assert c.exists([*keys, missing]) == [True] * 6 + [False]
        statuses, got = read_back(c, [missing, *keys, keys[0]])
        assert statuses == [p.Status.MISS] + [p.Status.OK] * 7
        assert got[1:] == [*chunks.values(), chunks[keys[0]]]
        # sizes up to max_value_bytes (+ a frame header); an empty or oversized value is refused, alone
        small, too_big, empty = b"s" * 10, b"x" * (CHUNK + HEADER_ALLOWANCE + 1), b""
        odd = [make_key(100), make_key(101), make_key(102)]
        assert c.put(odd, [small, too_big, empty]) == [p.Status.OK, p.Status.BAD_SIZE, p.Status.BAD_SIZE]
        statuses, got = read_back(c, odd)
        assert statuses == [p.Status.OK, p.Status.MISS, p.Status.MISS] and got[0] == small
        # a view too small for the value: refused, nothing written
        statuses, sizes = c.get([keys[0]], [memoryview(bytearray(100))])
        assert statuses == [p.Status.BAD_SIZE] and sizes == [0]
        # overwrite=True replaces; without it (the default now) what is held is kept
        newer = values(2, version=1)
        assert c.put(list(newer), list(newer.values()), overwrite=True) == [p.Status.OK] * 2
        assert c.put(list(newer), list(values(2, version=2).values())) == [p.Status.PRESENT] * 2
        assert read_back(c, list(newer))[1] == list(newer.values())
        # the same key twice in one put: the first is taken, the second is busy
        dup = make_key(200)
        assert c.put([dup, dup], [b"a" * 8, b"b" * 8]) == [p.Status.OK, p.Status.BUSY]
        assert c.delete([keys[0], keys[1], missing]) == 2
        assert c.exists(keys[:3]) == [False, False, True]
        health = c.health()
        assert health.status == "ok" and health.connections == 1 and health.uptime_s > 0
        stats = c.stats()
        assert stats.tiers[0].name == "cpu" and stats.tiers[0].chunks == 4 + 1 + 1
        assert stats.hits >= 9 and stats.misses >= 3 and stats.put_keys >= 14
        (me,) = stats.clients
        assert me.client == "rt" and me.requests >= 10 and me.bytes_in > 6 * CHUNK


def test_full_server_evicts_coldest_or_refuses(tmp_path: pathlib.Path) -> None:
    tiers = cpu_tier(f"{4 * slot_bytes_for(CHUNK)}")
    evicting = ServerProcess(tmp_path / "evict", max_value_bytes=CHUNK, tiers=tiers).start()
    refusing = ServerProcess(tmp_path / "refuse", max_value_bytes=CHUNK, tiers=tiers, when_full="refuse").start()
    try:
        chunks = values(6)
        keys = list(chunks)
        with ServerClient(evicting.address) as c:
            assert c.put(keys[:4], list(chunks.values())[:4]) == [p.Status.OK] * 4
            # A batch is ranked like a prefix: its first key the most recent, its last the coldest.
            read_back(c, keys[1:2])  # key 1 becomes the most recent
            assert c.put(keys[4:], list(chunks.values())[4:]) == [p.Status.OK] * 2
            assert c.exists(keys) == [True, True, False, False, True, True]
            assert c.stats().tiers[0].evictions == 2
        with ServerClient(refusing.address) as c:
            assert c.put(keys, list(chunks.values())) == [p.Status.OK] * 4 + [p.Status.FULL] * 2
            assert c.delete(keys[:1]) == 1
            assert c.put(keys[4:], list(chunks.values())[4:]) == [p.Status.OK, p.Status.FULL]
    finally:
        evicting.kill()
        refusing.kill()


def test_connection_limit(tmp_path: pathlib.Path) -> None:
    proc = ServerProcess(tmp_path / "srv", max_connections=2, max_value_bytes=CHUNK, tiers=cpu_tier()).start()
    try:
        with ServerClient(proc.address) as a, ServerClient(proc.address) as b:
            with pytest.raises((p.RemoteError, OSError)) as refused:
                ServerClient(proc.address).connect()
            if isinstance(refused.value, p.RemoteError):
                assert refused.value.code == "too_many_connections"
            assert a.health().connections == 2 and b.health().status == "ok"
    finally:
        proc.kill()


# ------------------------------------------------------------------------------ disconnects
def test_disconnect_mid_put_leaves_no_half_chunk(server: ServerProcess) -> None:
    chunks = values(3)
    keys = list(chunks)
    body = p.Put(keys, [CHUNK] * 3)
    payload = b"".join(chunks.values())
    with ServerClient(server.address) as watcher:
        used_before = watcher.stats().used_bytes
        raw = socket.create_connection(("127.0.0.1", server.port))
        raw.sendall(p.frame(p.MsgType.HELLO, 1, p.Hello(client="vanishing")))
        raw.sendall(p.frame(p.MsgType.PUT, 2, body, len(payload)) + payload[: CHUNK + CHUNK // 2])
        deadline = time.monotonic() + 10
        while watcher.stats().used_bytes == used_before and time.monotonic() < deadline:
            time.sleep(0.01)  # the server has reserved slots for the put (STORING)
        assert watcher.exists(keys) == [False] * 3  # nothing visible until every byte arrived
        assert read_back(watcher, keys)[0] == [p.Status.MISS] * 3
        raw.close()  # gone, one and a half values in
        deadline = time.monotonic() + 10
        while watcher.stats().used_bytes != used_before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watcher.stats().used_bytes == used_before  # the reserved slots went back
        assert watcher.exists(keys) == [False] * 3
        assert watcher.put(keys, list(chunks.values())) == [p.Status.OK] * 3  # and work again
        assert read_back(watcher, keys)[1] == list(chunks.values())


# ------------------------------------------------------------------------------ drain and restart
def disk_server(tmp_path: pathlib.Path, port: int) -> ServerProcess:
    return ServerProcess(
        tmp_path / "srv", port=port, max_value_bytes=CHUNK, drain_timeout_s=30,
        tiers=[*cpu_tier("2MiB"),
               {"name": "disk", "backend": "disk", "capacity": "64MiB",
                "options": {"root": str(tmp_path / "disk"), "fsync": "batch"}}],
    )


def test_sigterm_drains_in_flight_put_then_restart_is_warm(tmp_path: pathlib.Path) -> None:
    port = free_port()
    proc = disk_server(tmp_path, port).start()
    early = values(40)  # more than the 2 MiB host tier holds: the disk tier has the rest
    late = {make_key(1000 + i): make_payload(make_key(1000 + i), CHUNK) for i in range(8)}
    try:
        with ServerClient(proc.address) as c:
            put_all(c, early)
            deadline = time.monotonic() + 30
            while c.stats().tiers[1].chunks < 40 and time.monotonic() < deadline:
                time.sleep(0.05)  # written through to disk (host copies pinned until then)
            assert c.stats().tiers[1].chunks == 40
        raw = socket.create_connection(("127.0.0.1", port), timeout=30)
        raw.sendall(p.frame(p.MsgType.HELLO, 1, p.Hello(client="in-flight")))
        payload = b"".join(late.values())
        raw.sendall(p.frame(p.MsgType.PUT, 2, p.Put(list(late), [CHUNK] * 8), len(payload)) + payload[:CHUNK])
        time.sleep(0.3)
        assert proc.proc is not None
        proc.proc.send_signal(15)  # SIGTERM with a put in flight
        time.sleep(0.3)
        with pytest.raises(OSError):  # no new connections while draining
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        raw.sendall(payload[CHUNK:])  # the in-flight put finishes and is answered
        frames = list(p.FrameDecoder(p.Limits(max_payload_bytes=1 << 30), replies=True).feed(_recv_all(raw)))
        raw.close()
        assert [f.header.type for f in frames] == [p.reply_type(p.MsgType.HELLO), p.reply_type(p.MsgType.PUT)]
        assert frames[1].body == p.PutReply([0] * 8)
        assert proc.terminate() == 0
        assert "drained (all copies written)" in proc.log()
        proc = disk_server(tmp_path, port).start()  # same config, same port: a restart
        with ServerClient(proc.address) as c:
            stats = c.stats()
            assert stats.tiers[0].chunks == 0 and stats.tiers[1].chunks == 48  # host cold, disk warm
            everything = {**early, **late}
            keys = list(everything)
            for i in range(0, len(keys), 16):
                statuses, got = read_back(c, keys[i : i + 16])
                assert statuses == [p.Status.OK] * len(got)
                assert got == [everything[k] for k in keys[i : i + 16]]
            stats = c.stats()
            assert stats.tiers[1].hit_chunks == 48 and stats.hits == 48
        proc.kill()  # and again, now with several clients reading the same cold chunks at once
        proc = disk_server(tmp_path, port).start()
        wanted = list(early)[:16]
        outcomes: list[tuple[list[p.Status], list[bytes]]] = []

        def reader() -> None:
            with ServerClient(proc.address) as c:
                outcomes.append(read_back(c, wanted))

        threads = [threading.Thread(target=reader) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(outcomes) == 4
        for statuses, got in outcomes:
            assert statuses == [p.Status.OK] * 16 and got == [early[k] for k in wanted]
        assert proc.terminate() == 0
    finally:
        proc.kill()


def put_all(client: ServerClient, chunks: dict[bytes, bytes], batch: int = 10) -> None:
    """Store every chunk, retrying those refused while the host tier waits for the disk (FULL)."""
    todo = list(chunks)
    deadline = time.monotonic() + 30
    while todo and time.monotonic() < deadline:
        part = todo[:batch]
        statuses = client.put(part, [chunks[k] for k in part])
        assert set(statuses) <= {p.Status.OK, p.Status.FULL}
        todo = [k for k, s in zip(part, statuses) if s is not p.Status.OK] + todo[batch:]
        if p.Status.FULL in statuses:
            time.sleep(0.05)
    assert not todo


def _recv_all(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(1 << 16):
        out += chunk
    return out


# ------------------------------------------------------------------------------ metrics and CLIs
def test_prometheus_metrics(tmp_path: pathlib.Path) -> None:
    metrics_port = free_port()
    proc = ServerProcess(tmp_path / "srv", max_value_bytes=CHUNK, tiers=cpu_tier(),
                         metrics={"port": metrics_port}).start()
    try:
        with ServerClient(proc.address) as c:
            chunks = values(3)
            c.put(list(chunks), list(chunks.values()))
            read_back(c, list(chunks))
        deadline = time.monotonic() + 15
        while True:  # gauges refresh every second
            text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
            if 'tiercache_server_tier_chunks{tier="cpu"} 3.0' in text or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert 'tiercache_server_requests_total{type="put"} 1.0' in text
        assert 'tiercache_server_keys_total{op="get",status="ok"} 3.0' in text
        assert 'tiercache_server_tier_chunks{tier="cpu"} 3.0' in text
        assert "tiercache_server_request_seconds_bucket" in text
    finally:
        proc.kill()


def test_a_get_is_counted_before_its_reply_is_sent(tmp_path: pathlib.Path) -> None:
    """A client may act on a GET's values (and read /metrics) before the server's sending coroutine
    runs again: the keys are counted when answered. A reader that does not read holds the reply
    (16 MiB) in the send: the count is already there (before: only after the last byte went out)."""
    metrics_port = free_port()
    proc = ServerProcess(tmp_path / "srv", max_value_bytes="1MiB", tiers=cpu_tier("32MiB"),
                         metrics={"port": metrics_port}).start()
    try:
        with ServerClient(proc.address) as c:
            chunks = values(16, size=1 << 20)
            c.put(list(chunks), list(chunks.values()))
            c._stream.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # type: ignore[union-attr]
            c._begin(p.MsgType.GET, p.Get(list(chunks), [1 << 20] * 16))  # sent, the reply never read
            want = 'tiercache_server_keys_total{op="get",status="ok"} 16.0'
            deadline, text = time.monotonic() + 10, ""
            while want not in text and time.monotonic() < deadline:
                text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
                time.sleep(0.1)
            assert want in text
    finally:
        proc.kill()


def run_module(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, check=False)


def test_inspect_and_bench_commands(server: ServerProcess) -> None:
    bench = run_module("tiercache.server.bench_cli", "server", "--server", server.address, "--clients", "4",
                       "--seconds", "1.5", "--chunk-bytes", "16KiB", "--json", str(server.directory / "b.json"))
    assert bench.returncode == 0, bench.stderr
    assert "corrupt chunks: 0" in bench.stdout and "p99" in bench.stdout
    report = json.loads((server.directory / "b.json").read_text())
    assert report["clients"] == 4 and report["requests"] > 0 and report["corrupt"] == 0
    out = run_module("tiercache.server.inspect_cli", "--server", server.address)
    assert out.returncode == 0, out.stderr
    for text in ("host memory:", "hit rate", "tiers:", "cpu", "clients: 1 connected", "tiercache-inspect"):
        assert text in out.stdout
    as_json = json.loads(run_module("tiercache.server.inspect_cli", "--server", server.address, "--json").stdout)
    assert as_json["put_keys"] == report["put_keys"]
    down = run_module("tiercache.server.inspect_cli", "--server", f"127.0.0.1:{free_port()}")
    assert down.returncode == 1 and "cannot inspect" in down.stderr


def test_bad_config_is_refused_naming_the_key(tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("prot: 1\nwhen_full: sometimes\n")
    out = run_module("tiercache.server.serve_cli", "--config", str(bad))
    assert out.returncode == 1
    assert "prot: unknown key" in out.stderr and "when_full: Input should be 'evict' or 'refuse'" in out.stderr
    with pytest.raises(ConfigError, match="max_value_bytes: .* larger than max_message_bytes"):
        load_server_config(None, max_value_bytes="1GiB", max_message_bytes="64MiB")
    with pytest.raises(ConfigError, match="tiers.0.backend"):
        load_server_config(None, tiers=[{"name": "d", "backend": "disk", "capacity": 1}])
    assert load_server_config(None, nixl=False, auth="none").nixl == "off"  # YAML's bare off


# ------------------------------------------------------------------------------ the client tier
def test_client_tier_survives_a_dead_server(tmp_path: pathlib.Path) -> None:
    port = free_port()
    settings = ServerSettings(address=f"127.0.0.1:{port}", backoff_min_s=0.05, backoff_max_s=0.2,
                              connect_timeout_s=1.0, timeout_s=5.0)
    context = BackendContext("remote", b"kit-ns-1", CHUNK, 1 << 30)
    backend = ServerBackend(settings, context)
    chunks = values(4)
    keys = list(chunks)
    try:
        backend.submit_put(1, keys, [memoryview(v) for v in chunks.values()])  # nobody listens
        assert wait_for_jobs(backend, [1])[1].failed_keys == tuple(keys)
        assert backend.contains(keys) == [False] * 4
        backend.delete(keys)  # no exception either
        stats = backend.stats()
        assert stats["put_failures"] == 4 and stats["connect_failures"] >= 1
        proc = ServerProcess(tmp_path / "srv", port=port, max_value_bytes=CHUNK, tiers=cpu_tier()).start()
        try:
            deadline, job = time.monotonic() + 10, 1
            while True:  # within the backoff the tier reconnects by itself
                job += 1
                backend.submit_put(job, keys, [memoryview(v) for v in chunks.values()])
                if wait_for_jobs(backend, [job])[job].ok or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert backend.contains(keys) == [True] * 4
            bufs = [bytearray(CHUNK) for _ in keys]
            backend.submit_get(99, keys, [memoryview(b) for b in bufs])
            assert wait_for_jobs(backend, [99])[99].ok and [bytes(b) for b in bufs] == list(chunks.values())
            proc.kill()  # dies under the client
            backend.submit_get(100, keys, [memoryview(bytearray(CHUNK)) for _ in keys])
            result = wait_for_jobs(backend, [100])[100]
            assert result.failed_keys == tuple(keys)
            stats = backend.stats()
            # noticed either mid-request, or (a connection the server closed is checked before
            # each request) as a closed connection whose reconnect then fails
            assert stats["request_errors"] >= 1 or (stats["server_closed"] >= 1 and stats["connect_failures"] >= 2)
        finally:
            proc.kill()
    finally:
        backend.close()


def test_shipped_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    from tiercache.config.schema import TierConfig, load_config
    from tiercache.tiers import registry as plugins

    monkeypatch.setenv("TIERCACHE_SERVER_AUTH_TOKEN", "shipped-config-test-token")  # auth: token needs one
    server = load_server_config(ROOT / "configs" / "server.yaml")
    assert server.host == "127.0.0.1" and [t.backend for t in server.tiers] == ["cpu", "disk"]
    engine = load_config(ROOT / "configs" / "cpu-server.yaml")
    tier = engine.tiers[1]
    assert tier.backend == "server"
    # Built the way the engine builds it (the registry names "server" once tiercache registers it).
    monkeypatch.setitem(plugins.BUILTIN_BACKENDS, "server", "tiercache.backends.server.backend:ServerBackend")
    context = BackendContext("server", b"kit-ns-1", CHUNK, tier.capacity)
    backend = plugins.create_backend(tier, context, index=1)
    assert isinstance(backend, ServerBackend)
    assert backend.settings.address == "127.0.0.1:7470" and backend.settings.overwrite is False
    backend.close()
    bad = TierConfig(name="s", backend="server", capacity=1 << 30, options={"address": "no-port"})
    with pytest.raises(ConfigError, match="tiers.1.options.address: .*HOST:PORT"):
        plugins.create_backend(bad, context, index=1)
    typo = TierConfig(name="s", backend="server", capacity=1 << 30,
                      options={"address": "127.0.0.1:1", "conections": 4})
    with pytest.raises(ConfigError, match="tiers.1.options.conections: unknown key"):
        plugins.create_backend(typo, context, index=1)
