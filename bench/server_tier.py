"""Cache server data paths next to their ceilings: TCP vs a raw socket stream, NIXL vs raw NIXL.

What is measured, per chunk size, moving requests of ``--request-mib`` of
chunks (e.g. 64 chunks of 256 KiB) over one connection, for ``--seconds``
per cell and ``--repeat`` repetitions (the runners take turns, so load from
other processes hits all alike; the tables show medians and the median of
the per-repetition ratios):

TCP (``tiercache serve`` in a subprocess, ``nixl: off``):

* ``raw``: the ceiling. A plain Python server in a subprocess (blocking
  socket, ``recv_into`` one preallocated buffer, ``sendmsg`` it back) and a
  client sending the same chunk buffers with ``sendmsg`` and receiving into
  the same views with ``recv_into``; a 16-byte request header and a 1-byte
  put ack. The same bytes through the same kernel path, no protocol.
* ``client``: :class:`tiercache.server.client.ServerClient` put/get: frame
  header, msgpack body of keys and sizes, the server's manager (slot
  reservation, eviction order, pins), values received into and sent from its
  host slots.
* ``tier``: the engine's path, :class:`tiercache.backends.server.backend.ServerBackend`
  (``connections: 1``) through submit_put/submit_get and poll: adds the I/O
  thread hand-off and job bookkeeping. Its requests are pipelined as the
  tier's defaults say (``pipeline_depth`` requests of ``pipeline_request_bytes``
  in flight; ``--pipeline-depth`` / ``--pipeline-request-kib`` change them).
* ``tier 1-by-1``: the same tier with ``pipeline_depth: 1`` (the whole request,
  then its reply): what pipelining gains, measured in the same run.

NIXL (when ``from nixl._api import nixl_agent`` works here, UCX, DRAM<->DRAM):

* ``raw``: a subprocess with a NIXL agent and a registered buffer READs (put)
  or WRITEs (get) the client's registered buffer, one chunk per descriptor,
  transfers back to back with no control traffic: the ceiling. Both agents
  run as tiercache's do: no NIXL progress thread (it spins a core), the
  initiator's polling drives the transfer, the passive side progresses its
  agent while it waits.
* ``tier``: ServerBackend with ``data_path: nixl``: each request is a
  PUT_REMOTE/GET_REMOTE on the control connection, one NIXL transfer by the
  server into/out of its slots, and the reply. Every chunk travels as a frame
  (header + chunk, checksummed): the header in the PUT_REMOTE body / GET_REMOTE
  reply body, the chunk moved by NIXL straight from/into the bench's buffers,
  registered with ``register_buffer`` as an engine registers its host slab
  (zero copy: the row's ``tier_staged_bytes``, the tier's
  ``nixl_staged_bytes``, stays 0).

Every get is verified byte exact once per cell (untimed). Run:
``python -m bench server_tier`` (``--help``); JSON goes to
``bench/results/server_tier.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

if __package__ in (None, ""):  # run as a script (python bench/<name>.py): import `bench`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiercache.backends.server.backend import ServerBackend, ServerSettings

from bench import common
from tiercache.backend import BackendContext
from tiercache.server.client import ServerClient
from tiercache.server.nixl_path import nixl_available
from tiercache.server.protocol import Status
from tiercache.server.slab import HEADER_ALLOWANCE
from tiercache.testing.conformance import wait_for_jobs

ROOT = Path(__file__).resolve().parents[1]
RAW_HEADER = struct.Struct("<QQ")  # op (1 put, 2 get), bytes
Runner = Callable[[], int]  # one request; returns bytes moved


# ------------------------------------------------------------------------------ subprocess servers
def raw_tcp_server(port: int, nbytes: int) -> None:
    """The ceiling's server: a put is received whole into one buffer and acked, a get sent back."""
    listener = socket.create_server(("127.0.0.1", port))
    buf = bytearray(nbytes)
    view = memoryview(buf)
    print("ready", flush=True)
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    header = bytearray(RAW_HEADER.size)
    while True:
        got = 0
        while got < len(header):
            n = conn.recv_into(memoryview(header)[got:])
            if n == 0:
                return
            got += n
        op, size = RAW_HEADER.unpack(header)
        if op == 1:
            got = 0
            while got < size:
                got += conn.recv_into(view[got:size])
            conn.sendall(b"k")
        else:
            conn.sendall(view[:size])


def raw_nixl_server(port: int, nbytes: int) -> None:
    """The NIXL ceiling: READ/WRITE the client's registered buffer back to back, timed here."""
    from nixl._api import nixl_agent, nixl_agent_config

    # Like the tiercache server's agent: no progress thread, the initiator's polling drives it.
    agent = nixl_agent(f"bench-raw-{os.getpid()}", nixl_agent_config(backends=["UCX"], enable_prog_thread=False))
    local = np.zeros(nbytes, np.uint8)
    agent.register_memory([(local.ctypes.data, nbytes, 0, "")], "DRAM")
    listener = socket.create_server(("127.0.0.1", port))
    print("ready", flush=True)
    conn, _ = listener.accept()
    stream = conn.makefile("rwb")
    while line := stream.readline():
        job = json.loads(line)
        if job["op"] == "meta":
            peer = agent.add_remote_agent(bytes.fromhex(job["metadata"]))
            stream.write(b"{}\n")
            stream.flush()
            continue
        chunk, count, addr = job["chunk"], job["count"], job["addr"]
        mine = agent.get_xfer_descs([(local.ctypes.data + i * chunk, chunk, 0) for i in range(count)], "DRAM")
        theirs = agent.get_xfer_descs([(addr + i * chunk, chunk, 0) for i in range(count)], "DRAM")
        handle = agent.initialize_xfer(job["op"], mine, theirs, peer)
        gbps = common.repeat_nixl_transfer(agent, handle, chunk * count, job["seconds"])
        agent.release_xfer_handle(handle)
        stream.write(json.dumps({"gbps": gbps}).encode() + b"\n")
        stream.flush()


def spawn(*args: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-m", "bench.server_tier", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    while line := proc.stdout.readline():
        if line.startswith("ready"):
            return proc
    raise RuntimeError(f"{args[0]} did not start")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_tiercache(tmp: Path, chunk: int, request_bytes: int, nixl: bool) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    config = {
        "port": port, "nixl": "on" if nixl else "off", "max_value_bytes": chunk, "auth": "none",
        # the tier's values are frames: each chunk plus its header (at most HEADER_ALLOWANCE)
        "max_message_bytes": max(request_bytes, chunk) * (chunk + HEADER_ALLOWANCE) // chunk,
        "max_keys_per_message": 4096,
        "tiers": [{"name": "cpu", "backend": "cpu", "capacity": 3 * request_bytes + (64 << 20)}],
    }
    path = tmp / f"server-{chunk}-{int(nixl)}.yaml"
    path.write_text(yaml.safe_dump(config))
    with open(tmp / f"server-{chunk}-{int(nixl)}.log", "wb") as log:  # the child keeps its own fd
        proc = subprocess.Popen([sys.executable, "-m", "tiercache.server.serve_cli", "--config", str(path)],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"tiercache server did not start: see {path.with_suffix('.log')}")


# ------------------------------------------------------------------------------ the data
class Workload:
    """``count`` chunks of ``chunk`` bytes: keys, source bytes, and destination views."""

    def __init__(self, chunk: int, count: int) -> None:
        self.chunk, self.count = chunk, count
        self.keys = [b"bench-ns" + i.to_bytes(8, "big") + bytes(4) for i in range(count)]
        self.src = np.frombuffer(os.urandom(chunk * count), np.uint8).copy()
        self.dst = np.zeros(chunk * count, np.uint8)
        self.src_views = [memoryview(self.src[i * chunk : (i + 1) * chunk]) for i in range(count)]
        self.dst_views = [memoryview(self.dst[i * chunk : (i + 1) * chunk]) for i in range(count)]

    def verify(self) -> None:
        if not np.array_equal(self.src, self.dst):
            raise AssertionError(f"chunks of {self.chunk} bytes came back different")
        self.dst[:] = 0


def raw_runners(w: Workload, port: int) -> tuple[Runner, Runner, Callable[[], None]]:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    total = w.chunk * w.count
    ack = bytearray(1)

    def put() -> int:
        bufs = [RAW_HEADER.pack(1, total), *w.src_views]
        while bufs:
            sent = sock.sendmsg(bufs[:512])
            while bufs and sent >= len(bufs[0]):
                sent -= len(bufs[0])
                bufs.pop(0)
            if bufs and sent:
                bufs[0] = memoryview(bufs[0])[sent:]
        sock.recv_into(ack)
        return total

    def get() -> int:
        sock.sendall(RAW_HEADER.pack(2, total))
        for view in w.dst_views:
            got = 0
            while got < len(view):
                got += sock.recv_into(view[got:])
        return total

    return put, get, sock.close


def client_runners(w: Workload, address: str) -> tuple[Runner, Runner, Callable[[], None]]:
    client = ServerClient(address, client_name="bench", timeout_s=60)
    client.connect()

    def put() -> int:
        statuses = client.put(w.keys, w.src_views, overwrite=True)  # each round replaces the last
        assert statuses == [Status.OK] * w.count, set(statuses)
        return w.chunk * w.count

    def get() -> int:
        statuses, _ = client.get(w.keys, w.dst_views)
        assert statuses == [Status.OK] * w.count, set(statuses)
        return w.chunk * w.count

    return put, get, client.close


def tier_runners(w: Workload, address: str, nixl: bool,
                 **pipeline: int) -> tuple[Runner, Runner, Callable[[], dict[str, int]]]:
    settings = ServerSettings(address=address, connections=1, data_path="nixl" if nixl else "tcp",
                              timeout_s=60, max_batch_keys=4096, max_batch_bytes=w.chunk * w.count,
                              # the chunks move in place (registered below): the arena stays unused
                              nixl_staging_bytes=1 << 20,
                              overwrite=True,  # replaces the client path's values
                              **pipeline)  # type: ignore[arg-type]
    backend = ServerBackend(settings, BackendContext("bench", b"bench-ns", w.chunk, 1 << 40))
    if nixl:
        backend.register_buffer(memoryview(w.src))
        backend.register_buffer(memoryview(w.dst))
    job = [0]

    def run(submit: Callable[..., None], views: list[memoryview]) -> int:
        job[0] += 1
        submit(job[0], w.keys, views)
        result = wait_for_jobs(backend, [job[0]], timeout=60, poll_budget=1.0)[job[0]]
        assert result.ok, f"{len(result.failed_keys)} keys failed"
        return result.bytes

    def put() -> int:
        return run(backend.submit_put, w.src_views)

    def get() -> int:
        return run(backend.submit_get, w.dst_views)

    def close() -> dict[str, int]:
        """Close the tier; its last counters."""
        stats = backend.stats()
        backend.close()
        return stats

    return put, get, close


def measure(runner: Runner, seconds: float) -> float:
    """GB/s of ``runner`` called back to back for ``seconds`` (after one warm-up call)."""
    runner()
    moved, started = 0, time.perf_counter()
    while True:
        moved += runner()
        elapsed = time.perf_counter() - started
        if elapsed >= seconds:
            return moved / elapsed / 1e9


# ------------------------------------------------------------------------------ the runs
def start_cell(
    chunk: int, request_bytes: int, raw_server: str
) -> tuple[Workload, int, subprocess.Popen[str]]:
    """One chunk size's workload (requests of ``request_bytes``, at least one chunk) and its
    ceiling's server subprocess (``--raw-tcp-server`` or ``--raw-nixl-server``) and port."""
    count = max(1, request_bytes // chunk)
    raw_port = free_port()
    return Workload(chunk, count), raw_port, spawn(raw_server, str(raw_port), str(chunk * count))


def bench_tcp(chunks: list[int], request_bytes: int, seconds: float, reps: int, tmp: Path,
              pipeline: dict[str, int]) -> list[dict[str, Any]]:
    """``pipeline``: the pipelined tier's settings (``pipeline_depth``, ``pipeline_request_bytes``; empty: defaults)."""
    rows = []
    for chunk in chunks:
        w, raw_port, raw_proc = start_cell(chunk, request_bytes, "--raw-tcp-server")
        count = w.count
        server, address = start_tiercache(tmp, chunk, chunk * count, nixl=False)
        paths = {"raw": raw_runners(w, raw_port), "client": client_runners(w, address),
                 "tier": tier_runners(w, address, nixl=False, **pipeline),
                 "tier_serial": tier_runners(w, address, nixl=False, pipeline_depth=1)}
        try:
            for name, (put, get, _) in paths.items():  # correctness, untimed
                put()
                get()
                w.verify()
            samples: dict[str, list[float]] = {f"{n}_{op}": [] for n in paths for op in ("put", "get")}
            for rep in range(reps):
                order = list(paths)[rep % len(paths) :] + list(paths)[: rep % len(paths)]
                for name in order:
                    put, get, _ = paths[name]
                    samples[f"{name}_put"].append(measure(put, seconds))
                    samples[f"{name}_get"].append(measure(get, seconds))
        finally:
            for _, _, close in paths.values():
                close()
            raw_proc.kill()
            server.terminate()
            server.wait(30)
        rows.append(median_row(chunk, count, samples, ("client", "tier", "tier_serial")))
    return rows


def bench_nixl(chunks: list[int], request_bytes: int, seconds: float, reps: int, tmp: Path) -> list[dict[str, Any]]:
    from tiercache.server.nixl_client import NixlClientSide

    rows = []
    for chunk in chunks:
        w, raw_port, raw_proc = start_cell(chunk, request_bytes, "--raw-nixl-server")
        count = w.count
        side = NixlClientSide(1 << 20, 1)
        side.register(memoryview(w.src))
        side.register(memoryview(w.dst))
        raw = socket.create_connection(("127.0.0.1", raw_port))
        raw.sendall(json.dumps({"op": "meta", "metadata": side.metadata()[1].hex()}).encode() + b"\n")
        _line_while_progressing(raw, side)

        server, address = start_tiercache(tmp, chunk, chunk * count, nixl=True)
        put, get, close = tier_runners(w, address, nixl=True)
        samples: dict[str, list[float]] = {k: [] for k in ("raw_put", "raw_get", "tier_put", "tier_get")}
        stats: dict[str, int] = {}
        try:
            put()
            get()
            w.verify()
            for rep in range(reps):
                cells = [
                    ("raw_put", lambda: raw_cell(raw, side, "READ", w.src, chunk, count, seconds)),
                    ("raw_get", lambda: raw_cell(raw, side, "WRITE", w.dst, chunk, count, seconds)),
                    ("tier_put", lambda: measure(put, seconds)),
                    ("tier_get", lambda: measure(get, seconds)),
                ]
                if rep % 2:
                    cells = cells[2:] + cells[:2]
                for name, cell in cells:
                    samples[name].append(cell())
        finally:
            stats = close()
            raw.close()
            raw_proc.kill()
            side.close()
            server.terminate()
            server.wait(30)
        rows.append(median_row(chunk, count, samples, ("tier",)))
        rows[-1]["tier_staged_bytes"] = stats.get("nixl_staged_bytes", -1)  # chunks copied via the arena
    return rows


def median_row(
    chunk: int, count: int, samples: dict[str, list[float]], paths: Sequence[str]
) -> dict[str, Any]:
    """One chunk size's figures: the median GB/s of every sample list, and each path's
    ``<path>_<op>_vs_raw``, the median of its per-repetition ratios to ``raw_<op>``."""
    row: dict[str, Any] = {"chunk_bytes": chunk, "chunks_per_request": count}
    for key, values in samples.items():
        row[f"{key}_gbps"] = statistics.median(values)
    for who in paths:
        for op in ("put", "get"):
            ratios = [a / b for a, b in zip(samples[f"{who}_{op}"], samples[f"raw_{op}"])]
            row[f"{who}_{op}_vs_raw"] = statistics.median(ratios)
    return row


def raw_cell(raw: socket.socket, side: Any, op: str, buf: np.ndarray, chunk: int, count: int,
             seconds: float) -> float:
    """Have the raw NIXL server time ``op`` transfers of ``buf`` for ``seconds``; its GB/s.

    Meanwhile this side drives its agent, as the client tier does while it waits for a reply.
    """
    job = {"op": op, "chunk": chunk, "count": count, "addr": int(buf.ctypes.data), "seconds": seconds}
    raw.sendall(json.dumps(job).encode() + b"\n")
    return float(json.loads(_line_while_progressing(raw, side))["gbps"])


def _line_while_progressing(raw: socket.socket, side: Any) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        side.progress()
        if select.select([raw], [], [], 0)[0]:
            chunk = raw.recv(4096)
            if not chunk:
                raise ConnectionError("raw NIXL server went away")
            data += chunk
    return data


def kib(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def main(argv: list[str] | None = None) -> int:
    parser = common.BenchParser(
        "server_tier", __doc__,
        ceiling="TCP: a plain socket stream of the same bytes to a raw server subprocess (sendmsg/"
        "recv_into, no protocol); NIXL: raw NIXL UCX READs/WRITEs of the same bytes between two "
        "agents, no control traffic",
        examples=("--chunks 256KiB,4MiB --request-mib 16 --seconds 0.5 --no-nixl",),
        out="server_tier", progress=False, sizes=True,
        quick={"chunks": "256KiB", "request_mib": 4, "seconds": 0.05, "repeat": 1},
    )
    add = parser.add_argument
    parser.add_sizes("64KiB,256KiB,1MiB,4MiB", "chunk sizes", flag="--chunks")
    add("--request-mib", type=int, default=16, help="MiB per request: chunks x size (default 16)")
    add("--seconds", type=float, default=0.25, help="seconds per measured cell (default 0.25)")
    parser.add_repeat(3, "repetitions; tables show medians (--reps: the same)")
    add("--reps", dest="repeat", type=int, default=argparse.SUPPRESS,
        help=argparse.SUPPRESS)  # its name before --repeat
    add("--no-nixl", action="store_true", help="skip the NIXL part")
    add("--pipeline-depth", type=int, default=None,
        help="TCP tier: requests in flight per connection (default: the tier's, 2)")
    add("--pipeline-request-kib", type=int, default=None,
        help="TCP tier: value KiB per pipelined request (default: the tier's, 4096)")
    add("--raw-tcp-server", nargs=2, type=int, help=argparse.SUPPRESS)
    add("--raw-nixl-server", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.raw_tcp_server:
        raw_tcp_server(*args.raw_tcp_server)
        return 0
    if args.raw_nixl_server:
        raw_nixl_server(*args.raw_nixl_server)
        return 0
    chunks = args.chunks
    request = args.request_mib << 20
    machine = common.machine_info(["msgspec", "nixl"])
    print(common.describe_machine(machine))
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        pipeline = {k: v for k, v in (("pipeline_depth", args.pipeline_depth),
                                      ("pipeline_request_bytes", (args.pipeline_request_kib or 0) << 10)) if v}
        results["tcp"] = bench_tcp(chunks, request, args.seconds, args.repeat, Path(tmp), pipeline)
        results["tcp_pipeline"] = pipeline or "the tier's defaults"
        common.print_table(
            ["chunk", "chunks/req", "raw put", "client put", "tier put", "tier/raw", "1-by-1/raw", "raw get",
             "client get", "tier get", "tier/raw", "1-by-1/raw"],
            [[kib(r["chunk_bytes"]), r["chunks_per_request"], f"{r['raw_put_gbps']:.2f}",
              f"{r['client_put_gbps']:.2f}", f"{r['tier_put_gbps']:.2f}", f"{100 * r['tier_put_vs_raw']:.0f}%",
              f"{100 * r['tier_serial_put_vs_raw']:.0f}%",
              f"{r['raw_get_gbps']:.2f}", f"{r['client_get_gbps']:.2f}", f"{r['tier_get_gbps']:.2f}",
              f"{100 * r['tier_get_vs_raw']:.0f}%", f"{100 * r['tier_serial_get_vs_raw']:.0f}%"]
             for r in results["tcp"]],
            title="TCP, one connection, GB/s (median); tier/raw = median of per-repetition ratios; "
            "tier pipelined, 1-by-1: one request at a time",
        )
        if not args.no_nixl and nixl_available():
            results["nixl"] = bench_nixl(chunks, request, args.seconds, args.repeat, Path(tmp))
            common.print_table(
                ["chunk", "chunks/req", "raw READ", "tier put", "put/raw", "raw WRITE", "tier get", "get/raw",
                 "staged"],
                [[kib(r["chunk_bytes"]), r["chunks_per_request"], f"{r['raw_put_gbps']:.2f}",
                  f"{r['tier_put_gbps']:.2f}", f"{100 * r['tier_put_vs_raw']:.0f}%", f"{r['raw_get_gbps']:.2f}",
                  f"{r['tier_get_gbps']:.2f}", f"{100 * r['tier_get_vs_raw']:.0f}%", r["tier_staged_bytes"]]
                 for r in results["nixl"]],
                title="NIXL (UCX, DRAM<->DRAM), GB/s (median)",
            )
        else:
            results["nixl"] = None
            print("NIXL: skipped (not installed or --no-nixl)")
    common.save_results(args, results, machine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
