"""Load: 16 concurrent clients putting and getting for a bounded time against one server.

Every chunk read back must be exactly the bytes put under its key (a miss is
allowed: the host tier is smaller than what the clients write, so it evicts
all along); the server's resident memory stays inside its host budget plus a
fixed allowance for the interpreter, and its used bytes inside the budget.
p50/p99 latency and throughput are printed and attached to the test report
(``record_property``), as seen by the clients (16 threads of one process: their
tail includes waiting for the GIL) and by the server (its request histogram,
as the upper bound of the bucket holding the percentile);
``bench/results/server_load.json`` keeps the last run.
"""

from __future__ import annotations

import json
import pathlib
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.harness import ROOT, ServerProcess, free_port
from tiercache.server.client import ServerClient
from tiercache.server.loadgen import LoadGenerator

CLIENTS = 16
SECONDS = 10.0
CHUNK = 64 * 1024
HOST_BUDGET = 48 << 20
INTERPRETER_ALLOWANCE = 160 << 20  # python + numpy + msgspec + pydantic + prometheus, measured ~75 MiB


def server_percentiles(port: int) -> dict[str, float]:
    """p50/p99 of put and get as the server timed them: the bucket bound holding each, in ms."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    buckets: dict[str, list[tuple[float, float]]] = {"put": [], "get": []}
    for family in text_string_to_metric_families(text):
        if family.name != "tiercache_server_request_seconds":
            continue
        for sample in family.samples:
            op = sample.labels.get("type")
            if sample.name.endswith("_bucket") and op in buckets:
                buckets[op].append((float(sample.labels["le"]), sample.value))
    out: dict[str, float] = {}
    for op, rows in buckets.items():
        rows.sort()
        total = rows[-1][1]
        for q in (0.5, 0.99):
            bound = next(le for le, count in rows if count >= q * total)
            out[f"server_{op}_p{int(q * 100)}_le_ms"] = bound * 1e3
    return out


def test_sixteen_clients_no_lost_or_corrupt_chunk(tmp_path: pathlib.Path,
                                                  record_property: pytest.RecordProperty) -> None:
    metrics_port = free_port()
    proc = ServerProcess(
        tmp_path / "srv", auth_token="load-token", max_value_bytes=CHUNK,
        tiers=[{"name": "cpu", "backend": "cpu", "capacity": HOST_BUDGET}], metrics={"port": metrics_port},
    ).start()
    try:
        idle_rss = proc.rss_bytes()
        gen = LoadGenerator(proc.address, "load-token", clients=CLIENTS, chunk_bytes=CHUNK, batch=4,
                            get_ratio=0.5, keyspace=256)
        report = gen.run(SECONDS)
        peak_rss = proc.hwm_bytes()
        with ServerClient(proc.address, token="load-token") as c:
            stats = c.stats()
        server_side = server_percentiles(metrics_port)
    finally:
        proc.kill()
    summary = report.as_dict() | {"server_idle_rss_mib": round(idle_rss / 2**20, 1),
                                  "server_peak_rss_mib": round(peak_rss / 2**20, 1),
                                  "host_budget_mib": HOST_BUDGET >> 20, **server_side}
    for name, value in summary.items():
        record_property(name, value)
    print("\nserver load:", json.dumps(summary))
    results = ROOT / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "server_load.json").write_text(json.dumps(summary, indent=2) + "\n")

    assert report.corrupt == 0, f"{report.corrupt} chunks came back with other bytes"
    assert report.errors == 0
    assert report.requests > CLIENTS * 5 and report.hits > 0 and report.put_ok > 0
    assert report.put_ok == report.put_keys  # evict mode: a put never fails for room
    assert report.hits + report.misses == report.get_keys
    assert stats.put_keys == report.put_keys and stats.hits == report.hits  # the server agrees
    assert all(c.client.startswith("tiercache") or c.client == "" for c in stats.clients)
    assert stats.used_bytes <= stats.capacity_bytes <= HOST_BUDGET
    assert peak_rss <= HOST_BUDGET + INTERPRETER_ALLOWANCE, (
        f"server peaked at {peak_rss >> 20} MiB for a {HOST_BUDGET >> 20} MiB budget"
    )
