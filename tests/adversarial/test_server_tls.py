"""TLS on the cache server's control channel, against a throwaway PKI made with the ``openssl`` command.

The certificates (a CA, a server certificate for 127.0.0.1/localhost, a client
certificate, an unrelated CA) come from tests/integration/tls_certs.py, made
in the test's own directory. Real ``tiercache serve`` subprocesses on loopback,
the real client. What must hold: a client trusting the CA works end to end
(byte-exact, the client tier included); a plaintext client, a client trusting
another CA, a client expecting another name, and (with ``client_ca_file``) a
client without a certificate are each refused cleanly, and the server keeps
serving; a connection that never finishes its handshake is closed by the
HELLO timeout.
"""

from __future__ import annotations

import pathlib
import socket
import ssl
import time
from collections.abc import Iterator

import pytest
from tiercache.backends.server.backend import ServerBackend, ServerSettings

from tests.integration.tls_certs import CertFiles, make_certs
from tests.server.harness import ServerProcess
from tiercache.backend import BackendContext
from tiercache.server import protocol as p
from tiercache.server.client import ServerClient
from tiercache.server.nixl_path import nixl_available
from tiercache.server.tls import ClientTlsConfig, client_context
from tiercache.testing.conformance_harness import wait_for_jobs
from tiercache.testing.payloads import make_key, make_payload

CHUNK = 256 * 1024
TOKEN = "tls-test-token-0123456789"
HELLO_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertFiles:
    return make_certs(tmp_path_factory.mktemp("pki"))


def tls_server(directory: pathlib.Path, certs: CertFiles, client_ca: bool = False,
               hello_timeout_s: float = HELLO_TIMEOUT_S, **extra: object) -> ServerProcess:
    tls = {"cert_file": str(certs.server_cert), "key_file": str(certs.server_key)}
    if client_ca:
        tls["client_ca_file"] = str(certs.ca)
    return ServerProcess(directory, auth_token=TOKEN, tls=tls, max_value_bytes=CHUNK,
                         hello_timeout_s=hello_timeout_s,
                         tiers=[{"name": "cpu", "backend": "cpu", "capacity": "8MiB"}], **extra).start()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, certs: CertFiles) -> Iterator[ServerProcess]:
    proc = tls_server(tmp_path_factory.mktemp("tls-server"), certs)
    yield proc
    proc.kill()
    assert "internal" not in proc.log() and "Traceback" not in proc.log(), proc.log()


def context(ca: pathlib.Path, cert: pathlib.Path | None = None, key: pathlib.Path | None = None) -> ssl.SSLContext:
    return client_context(ClientTlsConfig(ca_file=ca, cert_file=cert, key_file=key))


def values(n: int, size: int, version: int = 0, first: int = 0) -> dict[bytes, bytes]:
    return {make_key(i): make_payload(make_key(i), size, version) for i in range(first, first + n)}


def round_trip(c: ServerClient, data: dict[bytes, bytes], size: int) -> None:
    keys = list(data)
    assert c.put(keys, list(data.values()), overwrite=True) == [p.Status.OK] * len(keys)
    views = [memoryview(bytearray(size)) for _ in keys]
    statuses, sizes = c.get(keys, views)
    assert statuses == [p.Status.OK] * len(keys) and sizes == [size] * len(keys)
    assert [bytes(v) for v in views] == list(data.values())


def test_client_trusting_the_ca_works_byte_exact(server: ServerProcess, certs: CertFiles) -> None:
    with ServerClient(server.address, token=TOKEN, tls=context(certs.ca), client_name="tls-ok") as c:
        round_trip(c, values(8, 100), 100)  # small values: joined records
        round_trip(c, values(12, CHUNK, version=1), CHUNK)  # many records per value, scattered reads
        assert c.exists([make_key(0), make_key(999)]) == [True, False]
        assert c.delete([make_key(0)]) == 1
        stats = c.stats()
        assert {cl.client for cl in stats.clients} == {"tls-ok"} and stats.clients[0].bytes_in > 12 * CHUNK
    # the name the certificate carries (localhost) works too, as server_name
    with ServerClient(server.address, token=TOKEN, tls=context(certs.ca), server_name="localhost") as c:
        assert c.health().status == "ok"


def test_client_tier_over_tls(server: ServerProcess, certs: CertFiles) -> None:
    settings = ServerSettings(address=server.address, token=TOKEN, data_path="tcp", tls={"ca_file": str(certs.ca)})
    backend = ServerBackend(settings, BackendContext("remote", make_key(0)[:8], CHUNK, 1 << 30))
    data = values(6, CHUNK, version=2, first=1000)  # keys of its own: overwrite is off
    try:
        backend.submit_put(1, list(data), [memoryview(v) for v in data.values()])
        assert wait_for_jobs(backend, [1])[1].ok
        bufs = [bytearray(CHUNK) for _ in data]
        backend.submit_get(2, list(data), [memoryview(b) for b in bufs])
        assert wait_for_jobs(backend, [2])[2].ok and [bytes(b) for b in bufs] == list(data.values())
        assert backend.contains(list(data)) == [True] * 6
    finally:
        backend.close()


def test_plaintext_client_is_refused_cleanly(server: ServerProcess, certs: CertFiles) -> None:
    with pytest.raises(p.RemoteError) as err:
        ServerClient(server.address, token=TOKEN).connect()
    assert err.value.code == "tls_required"
    with ServerClient(server.address, token=TOKEN, tls=context(certs.ca)) as c:  # control: still serving
        assert c.health().status == "ok"


def test_client_trusting_another_ca_or_name_fails_the_handshake(server: ServerProcess, certs: CertFiles) -> None:
    with pytest.raises(ssl.SSLCertVerificationError, match="certificate verify failed"):
        ServerClient(server.address, token=TOKEN, tls=context(certs.other_ca)).connect()
    with pytest.raises(ssl.SSLCertVerificationError, match="Hostname mismatch|doesn't match|IP address mismatch"):
        ServerClient(server.address, token=TOKEN, tls=context(certs.ca), server_name="cache.invalid").connect()
    with ServerClient(server.address, token=TOKEN, tls=context(certs.ca)) as c:  # control
        assert c.health().status == "ok"


def test_inspect_over_tls(server: ServerProcess, certs: CertFiles) -> None:
    import subprocess
    import sys

    from tests.server.harness import ROOT

    args = [sys.executable, "-m", "tiercache.server.inspect_cli", "--server", server.address, "--token", TOKEN]
    out = subprocess.run([*args, "--tls-ca", str(certs.ca)], capture_output=True, text=True, cwd=ROOT,
                         timeout=120, check=False)
    assert out.returncode == 0 and "host memory:" in out.stdout, out.stderr
    plain = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert plain.returncode == 1 and "tls_required" in plain.stderr


def test_tls_does_not_replace_the_token(server: ServerProcess, certs: CertFiles) -> None:
    with pytest.raises(p.RemoteError) as err:
        ServerClient(server.address, token="wrong", tls=context(certs.ca)).connect()
    assert err.value.code == "unauthorized"


def test_a_stalled_handshake_is_closed_by_the_hello_timeout(server: ServerProcess) -> None:
    for first in (b"", b"\x16\x03\x01"):  # nothing at all; a TLS record header that never completes
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(first)
            started = time.monotonic()
            try:
                while sock.recv(4096):
                    pass
            except ConnectionResetError:
                pass
            assert time.monotonic() - started < HELLO_TIMEOUT_S + 20  # closed by the server, not our timeout


def test_mutual_tls_requires_a_client_certificate(tmp_path: pathlib.Path, certs: CertFiles) -> None:
    proc = tls_server(tmp_path / "mtls", certs, client_ca=True)
    try:
        # TLS 1.3: the refusal arrives after the client's side of the handshake, at its first read:
        # the server's alert, or (when the close overtakes it) an EOF or reset; never a Welcome
        with pytest.raises((ssl.SSLError, ConnectionResetError, BrokenPipeError)):
            ServerClient(proc.address, token=TOKEN, tls=context(certs.ca)).connect()
        with ServerClient(proc.address, token=TOKEN,  # control: with the CA's client certificate
                          tls=context(certs.ca, certs.client_cert, certs.client_key)) as c:
            round_trip(c, values(3, 1000), 1000)
    finally:
        proc.kill()
    assert "TLS handshake with" in proc.log() and "Traceback" not in proc.log(), proc.log()


@pytest.mark.skipif(not nixl_available(), reason="nixl is not installed")
def test_nixl_data_path_with_a_tls_control_channel(tmp_path: pathlib.Path, certs: CertFiles) -> None:
    """With NIXL the control messages are TLS; the values move over NIXL (documented: not encrypted)."""
    from tiercache.server.nixl_client import NixlClientSide

    # a HELLO with NIXL metadata has the server vet it in a process of its own before loading it: the
    # module's 2 s HELLO deadline (for the slow-HELLO test) timed that out once on a loaded machine
    proc = tls_server(tmp_path / "tls-nixl", certs, hello_timeout_s=30.0, nixl="on")
    side = NixlClientSide(1 << 20, 1)
    arena, addr = side.arena(0)
    try:
        with ServerClient(proc.address, token=TOKEN, tls=context(certs.ca), timeout_s=30.0,
                          nixl_metadata=side.metadata()[1], nixl_agent=side.agent_name,
                          nixl_progress=side.progress) as c:
            assert c.welcome is not None and c.welcome.nixl
            data = make_payload(make_key(7), 4096)
            arena[:4096] = data
            assert c.put_remote([make_key(7)], [4096], [addr]) == [p.Status.OK]
            arena[:4096] = bytes(4096)
            assert c.get_remote([make_key(7)], [4096], [addr + 8192]) == ([p.Status.OK], [4096])
            assert bytes(arena[8192 : 8192 + 4096]) == data
    finally:
        side.close()
        proc.kill()
