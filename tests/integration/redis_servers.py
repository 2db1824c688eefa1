"""Real redis-server processes for the Redis tier's tests and benchmark (no mocks).

:class:`RedisServer` runs one ``redis-server`` on a loopback port below 32768
(no persistence, its own directory and log) and can stop, kill (SIGKILL),
restart it on the same port, and pause it (SIGSTOP: a server that accepts
connections but never answers). :class:`RedisClusterNodes` runs three of them
with ``--cluster-enabled yes``, joins them with ``redis-cli --cluster create``
(three masters, no replicas) and waits for ``cluster_state:ok``.

Access (:class:`Access`, optional for both): ``password`` is the default
user's ``requirepass`` (and the cluster's ``masterauth``), ``users`` adds ACL
users (``--user NAME RULES...`` on the command line), ``tls`` (certificates of
tests/integration/tls_certs.py) makes the server listen for TLS only
(``--port 0 --tls-port PORT``; the cluster bus too), asking clients for a
certificate when ``tls_auth_clients``. The harness's own clients (start-up
probe, :meth:`RedisServer.client`, redis-cli) log in as the default user.

Ports are chosen at random in 12000-22767 and checked free on 127.0.0.1, the
cluster bus port (port + 10000) too, so every port stays below the kernel's
ephemeral range; a server that loses a race for its port is started again on
another. Every process started here is stopped by whoever started it (the
fixtures below do it at teardown).

:class:`TierDriver` runs jobs against one tier from the test's thread and
waits for them (the owner's side of the backend contract).

The fixtures ``redis_server`` (one server per test session) and
``redis_cluster`` (one cluster per test module) are imported by the test
modules that use them. Without redis-server or redis-cli on PATH the tests
that need them skip, naming what is missing (scripts/setup.sh installs it).

Threads: none; everything runs on the test's thread.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence

import pytest
import redis

from tests.integration.tls_certs import CertFiles
from tiercache.backend import Backend, JobResult
from tiercache.testing.conformance import SENTINEL, make_payload, wait_for_jobs

LOOPBACK = "127.0.0.1"
PORT_RANGE = (12000, 22767)  # port + 10000 (the cluster bus) stays below 32768
BUS_OFFSET = 10000
START_TIMEOUT_S = 15.0


def redis_binaries() -> tuple[str, str] | None:
    """Paths of redis-server and redis-cli, or None if either is missing."""
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    return (server, cli) if server and cli else None


def require_redis() -> tuple[str, str]:
    """redis-server and redis-cli, or skip the test saying what to install."""
    found = redis_binaries()
    if found is None:
        pytest.skip("redis-server/redis-cli not on PATH (scripts/setup.sh installs redis-server)")
    return found


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def pick_port(rng: random.Random | None = None) -> int:
    """A free loopback port whose cluster bus port (port + 10000) is free too."""
    rng = rng or random.Random()
    for _ in range(200):
        port = rng.randint(*PORT_RANGE)
        if _bindable(port) and _bindable(port + BUS_OFFSET):
            return port
    raise RuntimeError(f"no free port pair in {PORT_RANGE}")


@dataclasses.dataclass(frozen=True)
class Access:
    """Who may talk to a server, and how (see the module docstring)."""

    password: str | None = None  # requirepass: the default user's password
    users: tuple[tuple[str, ...], ...] = ()  # ACL users: (name, rule, rule, ...)
    tls: CertFiles | None = None  # TLS only, with these certificates
    tls_auth_clients: bool = False  # TLS: clients must show a certificate of the CA

    def server_args(self, cluster: bool = False) -> list[str]:
        args: list[str] = []
        if self.password is not None:
            args += ["--requirepass", self.password]
            if cluster:
                args += ["--masterauth", self.password]
        for user in self.users:
            args += ["--user", *user]
        if self.tls is not None:
            args += [
                "--tls-cert-file", str(self.tls.server_cert),
                "--tls-key-file", str(self.tls.server_key),
                "--tls-ca-cert-file", str(self.tls.ca),
                "--tls-auth-clients", "yes" if self.tls_auth_clients else "no",
            ]
            if cluster:
                args += ["--tls-cluster", "yes", "--tls-replication", "yes"]
        return args

    def client_kwargs(self) -> dict[str, object]:
        """redis-py keywords for the harness's admin client (the default user)."""
        kwargs: dict[str, object] = {}
        if self.password is not None:
            kwargs["password"] = self.password
        if self.tls is not None:
            kwargs.update(ssl=True, ssl_ca_certs=str(self.tls.ca))
            if self.tls_auth_clients:
                kwargs.update(ssl_certfile=str(self.tls.client_cert),
                              ssl_keyfile=str(self.tls.client_key))
        return kwargs

    def cli_args(self) -> list[str]:
        """redis-cli options for the same (the password goes through REDISCLI_AUTH)."""
        if self.tls is None:
            return []
        args = ["--tls", "--cacert", str(self.tls.ca)]
        if self.tls_auth_clients:
            args += ["--cert", str(self.tls.client_cert), "--key", str(self.tls.client_key)]
        return args


class RedisServer:
    """One redis-server process on a loopback port; see the module docstring."""

    def __init__(self, directory: pathlib.Path, args: Sequence[str] = (),
                 access: Access | None = None, cluster: bool = False) -> None:
        self.server_bin, _ = require_redis()
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.access = access or Access()
        self.args = [*args, *self.access.server_args(cluster)]
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        scheme = "redis" if self.access.tls is None else "rediss"
        return f"{scheme}://{LOOPBACK}:{self.port}/0"

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def client(self, **kwargs: object) -> redis.Redis:
        """A plain redis-py client of this server (behind the tier's back), as its admin."""
        options = {"socket_timeout": 5, **self.access.client_kwargs(), **kwargs}
        return redis.Redis(host=LOOPBACK, port=self.port, **options)

    def start(self) -> RedisServer:
        """Start on a fresh port (another one if the chosen port is taken meanwhile)."""
        for _ in range(5):
            self.port = pick_port()
            if self._launch():
                return self
        raise RuntimeError(f"redis-server would not start; see {self.log}")

    def restart(self) -> None:
        """Start again on the same port (after :meth:`stop` or :meth:`kill`)."""
        assert not self.running, "restart() of a running server"
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._launch():
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server would not restart on {self.port}; see {self.log}")
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM and wait (a paused server is resumed first). Idempotent."""
        if self.running:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: the server dies mid-whatever, as in a crash."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: connections are accepted by the kernel but never answered."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    @property
    def log(self) -> pathlib.Path:
        return self.directory / f"redis-{self.port}.log"

    def _command(self) -> list[str]:
        ports = (["--port", str(self.port)] if self.access.tls is None
                 else ["--port", "0", "--tls-port", str(self.port)])
        return [
            self.server_bin, *ports, "--bind", LOOPBACK,
            "--save", "", "--appendonly", "no", "--daemonize", "no",
            "--dir", str(self.directory), "--logfile", str(self.log), *self.args,
        ]

    def _launch(self) -> bool:
        """Start the process and wait until it answers PING; False if it exited (port taken)."""
        self.proc = subprocess.Popen(self._command(), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        probe = self.client(socket_timeout=1, socket_connect_timeout=1)
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    self.proc = None
                    return False
                try:
                    if probe.ping():
                        return True
                except redis.RedisError:
                    time.sleep(0.02)
        finally:
            probe.close()
        self.stop()
        raise RuntimeError(f"redis-server on {self.port} did not answer within {START_TIMEOUT_S}s")


class RedisClusterNodes:
    """Three redis-server masters joined into one Redis Cluster (no replicas)."""

    def __init__(self, directory: pathlib.Path, masters: int = 3,
                 access: Access | None = None) -> None:
        _, self.cli_bin = require_redis()
        self.access = access or Access()
        self.servers = [
            RedisServer(directory / f"node{i}", args=self._cluster_args(directory / f"node{i}"),
                        access=self.access, cluster=True)
            for i in range(masters)
        ]

    @staticmethod
    def _cluster_args(directory: pathlib.Path) -> list[str]:
        return [
            "--cluster-enabled", "yes",
            "--cluster-config-file", str(directory / "nodes.conf"),
            "--cluster-node-timeout", "2000",
        ]

    @property
    def seeds(self) -> list[str]:
        return [server.address for server in self.servers]

    def start(self) -> RedisClusterNodes:
        for server in self.servers:
            server.start()
        self.cli("--cluster", "create", *self.seeds, "--cluster-replicas", "0", "--cluster-yes")
        self.wait_ok()
        return self

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def cli(self, *args: str, timeout: float = 60.0) -> str:
        """Run redis-cli with ``args``; its output; RuntimeError with the output if it fails."""
        env = dict(os.environ)
        if self.access.password is not None:
            env["REDISCLI_AUTH"] = self.access.password
        proc = subprocess.run([self.cli_bin, *self.access.cli_args(), *args], capture_output=True,
                              text=True, timeout=timeout, check=False, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"redis-cli {' '.join(args)}: {proc.stdout}\n{proc.stderr}")
        return proc.stdout

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every node reports cluster_state:ok, all slots assigned, every master known."""
        deadline = time.monotonic() + timeout
        while True:
            infos = [self._cluster_info(server) for server in self.servers]
            if all(
                info.get("cluster_state") == "ok"
                and info.get("cluster_slots_assigned") == "16384"
                and info.get("cluster_known_nodes") == str(len(self.servers))
                for info in infos
            ):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster not ok after {timeout}s: {infos}")
            time.sleep(0.1)

    def node_id(self, server: RedisServer) -> str:
        with server.client() as client:
            return client.execute_command("CLUSTER", "MYID").decode()

    def owner_of(self, slot: int) -> RedisServer:
        """The master serving ``slot`` now (as the first node sees it)."""
        with self.servers[0].client() as client:
            for start, end, master, *_ in client.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    return next(s for s in self.servers if s.port == int(master[1]))
        raise LookupError(f"slot {slot} is not served")

    @staticmethod
    def _cluster_info(server: RedisServer) -> dict[str, str]:
        try:
            with server.client() as client:
                text = client.execute_command("CLUSTER", "INFO").decode()
        except redis.RedisError:
            return {}
        return dict(line.split(":", 1) for line in text.split() if ":" in line)


# --------------------------------------------------------------------------- tier driver
class TierDriver:
    """Puts and gets chunks of ``chunk_bytes`` through a tier and waits for each job."""

    def __init__(self, tier: Backend, chunk_bytes: int, timeout: float = 30.0) -> None:
        self.tier = tier
        self.chunk_bytes = chunk_bytes
        self.timeout = timeout
        self.job = 0

    def next_job(self) -> int:
        self.job += 1
        return self.job

    def put(self, keys: Sequence[bytes], version: int = 0) -> JobResult:
        """Store ``make_payload(key, chunk_bytes, version)`` under each key, in one job."""
        job = self.next_job()
        views = [memoryview(make_payload(k, self.chunk_bytes, version)) for k in keys]
        self.tier.submit_put(job, list(keys), views)
        return wait_for_jobs(self.tier, [job], self.timeout)[job]

    def get(self, keys: Sequence[bytes]) -> tuple[JobResult, dict[bytes, bytes]]:
        """Load ``keys`` in one job into sentinel-filled buffers: the result and every buffer."""
        job = self.next_job()
        buffers = [bytearray([SENTINEL]) * self.chunk_bytes for _ in keys]
        self.tier.submit_get(job, list(keys), [memoryview(b) for b in buffers])
        result = wait_for_jobs(self.tier, [job], self.timeout)[job]
        return result, {k: bytes(b) for k, b in zip(keys, buffers)}

    def assert_loads(self, keys: Sequence[bytes], version: int = 0) -> None:
        """Every key loads, byte exact."""
        result, got = self.get(keys)
        assert result.failed_keys == (), f"{len(result.failed_keys)} of {len(keys)} keys failed"
        for key in keys:
            assert got[key] == make_payload(key, self.chunk_bytes, version), key.hex()


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server for the session (tests flush it as they need)."""
    require_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterNodes]:
    """A 3-master Redis Cluster for one test module."""
    require_redis()
    nodes = RedisClusterNodes(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield nodes.start()
    finally:
        nodes.stop()

