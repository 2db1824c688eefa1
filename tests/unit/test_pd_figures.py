"""bench/pd_figures.py: the per-hand-off ratios pair each request with the raw READ made right after it.

Synthetic rounds in the shape the engine runner writes (metric snapshots after
each round, cumulative): two requests, each followed by a raw READ. The first
request ran at half the raw speed, the second at the raw speed; a slow patch
that hits only the second raw READ must move only the second ratio.
"""

from __future__ import annotations

from typing import Any

import pytest

from bench.pd_figures import median_range, paired_ratios

MIB = 1 << 20
RAW = {"phase": "raw", "kwargs": {"chunk_bytes": MIB, "chunks": 32}}  # 32 MiB per raw READ


def snapshot(kind: str, whole: tuple[float, float], data: tuple[float, float]) -> dict[str, Any]:
    """Cumulative (bytes, seconds) of the whole hand-offs and of the data READs alone."""
    if kind == "nixl":
        return {"metrics": {"vllm:nixl_bytes_transferred": whole[0], "vllm:nixl_xfer_time_seconds": {"sum": whole[1]}}}
    path = 'path="peer_host_to_device"'
    return {"tiercache_metrics": {
        f'tiercache_transfer_bytes_total{{engine="0",{path}}}': whole[0],
        f'tiercache_transfer_seconds_sum{{engine="0",{path}}}': whole[1],
        'tiercache_transfer_bytes_total{engine="0",path="peer_data_read"}': data[0],
        'tiercache_transfer_seconds_sum{engine="0",path="peer_data_read"}': data[1]}}


def pair(kind: str, raw_secs: tuple[float, float]) -> dict[str, Any]:
    mb32 = 32 * MIB
    specs = [{"phase": "warmup"}, {"phase": "decode"}, RAW, {"phase": "decode"}, RAW, {"phase": "recompute"}]
    first = snapshot(kind, (mb32, 0.004), (mb32, 0.003))  # 32 MiB in 4 ms (data READ 3 ms)
    second = snapshot(kind, (2 * mb32, 0.006), (2 * mb32, 0.0045))  # the next 32 MiB in 2 ms (1.5 ms)
    rounds = [snapshot(kind, (0, 0), (0, 0)), first, {**first, "results": [[raw_secs[0]]]},
              second, {**second, "results": [[raw_secs[1]]]}, second]
    return {"consumer_rounds": specs, "consumer": {"rounds": rounds}}


def test_each_request_is_divided_by_the_raw_read_right_after_it() -> None:
    ratios = paired_ratios("tiercache", pair("tiercache", (0.002, 0.002)))
    assert ratios["whole"] == pytest.approx([0.5, 1.0])
    assert ratios["data"] == pytest.approx([2 / 3, 2 / 1.5])


def test_a_slow_raw_read_moves_its_own_pair_only() -> None:
    ratios = paired_ratios("tiercache", pair("tiercache", (0.002, 0.004)))
    assert ratios["whole"] == pytest.approx([0.5, 2.0])
    assert median_range(ratios["whole"]) == "1.25 (0.50-2.00)"


def test_nixl_connector_has_one_figure_for_both() -> None:
    ratios = paired_ratios("nixl", pair("nixl", (0.002, 0.002)))
    assert ratios["whole"] == ratios["data"] == pytest.approx([0.5, 1.0])


def test_no_raw_rounds_no_ratios() -> None:
    p = pair("tiercache", (0.002, 0.002))
    p["consumer_rounds"] = [s if s.get("phase") != "raw" else {"phase": "other"} for s in p["consumer_rounds"]]
    assert paired_ratios("tiercache", p) == {"whole": [], "data": []}
    assert median_range([]) == "-"
