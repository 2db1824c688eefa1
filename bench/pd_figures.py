"""bench/pd.py's figures, from the engines' round results: TTFTs, transfer throughputs, raw READs.

Each engine pair's result (``run_pair``) holds the consumer's round specs
(``consumer_rounds``: phase ``decode``, ``raw`` or ``recompute``, prompt
length) and the runner's output for each round: its requests, the worker-call
results (raw READ seconds, one list per worker), and snapshots of vLLM's and
tiercache's metrics taken after the round. Pure functions of those; no engines.
"""

from __future__ import annotations

import statistics
from typing import Any


def ttfts(pair: dict[str, Any], phase: str, n: int) -> list[float]:
    out: list[float] = []
    for spec, rnd in zip(pair["consumer_rounds"], pair["consumer"]["rounds"]):
        if spec.get("phase") == phase and spec.get("length") == n:
            out += [r["ttft_s"] for r in rnd["requests"] if r["ttft_s"] is not None]
    return out


def first_tokens_match(pair: dict[str, Any], n: int) -> bool:
    want = [r["output_token_ids"][:1] for r in pair["producer"][n]["requests"]]
    got = [r["output_token_ids"][:1]
           for spec, rnd in zip(pair["consumer_rounds"], pair["consumer"]["rounds"])
           if spec.get("phase") == "decode" and spec.get("length") == n for r in rnd["requests"]]
    return got == want


def in_engine_raw(pair: dict[str, Any]) -> dict[str, Any] | None:
    """The raw READs the consumer's worker made between its requests: GB/s over all, and each READ's ms."""
    moved, secs, each_ms = 0, 0.0, []
    for spec, rnd in zip(pair["consumer_rounds"], pair["consumer"]["rounds"]):
        if spec.get("phase") == "raw":
            size = spec["kwargs"]["chunk_bytes"] * spec["kwargs"]["chunks"]
            for times in rnd["results"]:  # one list per worker
                moved += size * len(times)
                secs += sum(times)
                each_ms += [t * 1e3 for t in times]
    if not secs:
        return None
    return {"gbps": moved / secs / 1e9, "read_ms": each_ms}


def metric_sum(samples: dict[str, Any], name: str, *label_parts: str) -> float:
    total = 0.0
    for key, value in samples.items():
        if key.split("{")[0] == name and all(p in key for p in label_parts):
            total += float(value["sum"] if isinstance(value, dict) else value)
    return total


def transfer_gbps(kind: str, pair: dict[str, Any]) -> dict[str, float | None]:
    """The consumer's KV transfer figures, from the connector's own metrics.

    ``gbps``: bytes / time of the NIXL transfers (tiercache: descriptors built to
    tags checked, ``tiercache_transfer_*{path="peer_*_to_device"}``; NixlConnector:
    ``vllm:nixl_xfer_time_seconds``, NIXL's telemetry from post to completion),
    ``bytes``; ``data_gbps``: the data READs alone (tiercache:
    ``path="peer_data_read"``, the READ's handle made, posted, completed and
    released; NixlConnector: the same as ``gbps``); tiercache also ``job_gbps``,
    its ``host_to_device`` load jobs (the whole job, a first handshake included).
    """
    last = pair["consumer"]["rounds"][-1]
    if kind == "nixl":
        samples = last.get("metrics") or {}
        moved = metric_sum(samples, "vllm:nixl_bytes_transferred")
        secs = metric_sum(samples, "vllm:nixl_xfer_time_seconds")
        value = moved / secs / 1e9 if secs > 0 else None
        return {"gbps": value, "bytes": moved, "data_gbps": value, "job_gbps": None}  # NIXL's own telemetry
    samples = last.get("tiercache_metrics") or {}

    def gbps(path: str) -> float | None:
        secs = metric_sum(samples, "tiercache_transfer_seconds_sum", f'path="{path}"')
        return metric_sum(samples, "tiercache_transfer_bytes_total", f'path="{path}"') / secs / 1e9 if secs else None

    path = "peer_device_to_device" if kind == "tiercache-direct" else "peer_host_to_device"
    return {"gbps": gbps(path), "bytes": metric_sum(samples, "tiercache_transfer_bytes_total", f'path="{path}"'),
            "data_gbps": gbps("peer_data_read"), "job_gbps": gbps("host_to_device")}


def _handoff_seconds(kind: str, before: dict[str, Any], after: dict[str, Any]) -> tuple[float, float, float, float]:
    """(bytes, seconds) of the whole hand-offs and of the data READs alone, between two rounds' snapshots."""
    if kind == "nixl":  # NIXL's telemetry: post to completion, the only figure NixlConnector has
        def delta(name: str) -> float:
            return metric_sum(after.get("metrics") or {}, name) - metric_sum(before.get("metrics") or {}, name)
        moved, secs = delta("vllm:nixl_bytes_transferred"), delta("vllm:nixl_xfer_time_seconds")
        return moved, secs, moved, secs

    def tc(name: str, path: str) -> float:
        label = f'path="{path}"'
        return (metric_sum(after.get("tiercache_metrics") or {}, name, label)
                - metric_sum(before.get("tiercache_metrics") or {}, name, label))

    path = "peer_device_to_device" if kind == "tiercache-direct" else "peer_host_to_device"
    return (tc("tiercache_transfer_bytes_total", path), tc("tiercache_transfer_seconds_sum", path),
            tc("tiercache_transfer_bytes_total", "peer_data_read"), tc("tiercache_transfer_seconds_sum", "peer_data_read"))


def paired_ratios(kind: str, pair: dict[str, Any]) -> dict[str, list[float]]:
    """Hand-off by hand-off: the connector's throughput over the raw READ its worker made right after.

    One consumer round is one request; the next round is the raw READ of the
    same size in the same worker. Each pair's ratio compares two READs taken a
    few milliseconds apart, so a slow patch of the run (which a sum over the
    run charges to whichever side it fell on) moves one ratio, not the figure:
    their median is the robust one. ``whole``: descriptors built to tags
    checked; ``data``: the data READs alone (NixlConnector: both its telemetry).
    """
    rounds = list(zip(pair["consumer_rounds"], pair["consumer"]["rounds"]))
    out: dict[str, list[float]] = {"whole": [], "data": []}
    for i in range(1, len(rounds) - 1):
        (spec, rnd), (raw_spec, raw_rnd) = rounds[i], rounds[i + 1]
        if spec.get("phase") != "decode" or raw_spec.get("phase") != "raw":
            continue
        raw_times = [t for times in raw_rnd["results"] for t in times]
        if not raw_times or sum(raw_times) <= 0:
            continue
        raw_gbps = raw_spec["kwargs"]["chunk_bytes"] * raw_spec["kwargs"]["chunks"] * len(raw_times) / sum(raw_times)
        moved, secs, data_moved, data_secs = _handoff_seconds(kind, rounds[i - 1][1], rnd)
        if secs > 0 and data_secs > 0:
            out["whole"].append(moved / secs / raw_gbps)
            out["data"].append(data_moved / data_secs / raw_gbps)
    return out


def median_range(values: list[float]) -> str:
    """``median (min-max)`` of ratios, for the tables."""
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"
