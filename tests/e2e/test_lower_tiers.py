"""Disk and LMDB tiers behind a host tier too small for the working set, on a real vLLM engine.

Engines (tiny random-weight Llama, float32, same settings for all):

* ``baseline``: no connector;
* ``disk``: host tier of 4 chunks in front of a disk tier (write-through);
  round 2 runs after ``reset_prefix_cache()`` and must hit chunks that only
  the disk tier still holds, with greedy tokens identical to the baseline;
* ``disk_restart``: a new engine process on the same disk directory, after two
  chunk files were corrupted on disk: its very first pass hits from disk (warm
  restart through ``recover()``), the corrupted chunks fail their checksum and
  are recomputed, and the output is still identical;
* ``lmdb``: the same as ``disk`` with an LMDB tier.

Round 3 sends the six prompts at once, after a reset, with two new ones: each
hit must stage 4 chunks into the 8-chunk host tier, so lookups wait a step for
staging room (``tiercache_lookup_waits_total{reason="no_staging_room"}``)
instead of recomputing what did not fit, and the new prompts' stores find every
host slot being written: refused, they are offered again next step
(``tiercache_store_refused_chunks_total``), so round 4 finds them whole.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from tiercache.testing.engine_runner import random_prompts, run_engine

from .conftest import cached, engine_spec, metric_delta

CHUNK = 128
HOST_CHUNKS = 8  # one request's 4 chunks fit as staging, with slack for copies in flight; 24 do not
PROMPTS = random_prompts(6, 520, seed=21)  # 4 full chunks each: 24 chunks, 6x the host tier
NEW = random_prompts(2, 520, seed=22)  # cold in round 3, stored while the host tier is full of staging


def rounds() -> list[dict[str, Any]]:
    return [
        {"prompts": random_prompts(1, 64, seed=98), "max_tokens": 2, "warmup": True},
        {"prompts": PROMPTS, "max_tokens": 12, "sequential": True},
        # One request at a time: each stages its own 4 chunks through the small host tier.
        {"prompts": PROMPTS, "max_tokens": 12, "reset_prefix_cache_before": True, "sequential": True},
        # All at once: 24 chunks to stage and 8 to store through 8 host slots.
        {"prompts": PROMPTS + NEW, "max_tokens": 12, "reset_prefix_cache_before": True},
        {"prompts": NEW, "max_tokens": 12, "reset_prefix_cache_before": True, "sequential": True},
    ]


def lower_tier(kind: str, path: pathlib.Path) -> dict[str, Any]:
    options = {"root": str(path)} if kind == "disk" else {"path": str(path)}
    return {"name": kind, "backend": kind, "capacity": "256MiB", "options": options}


def spec(model: pathlib.Path, kind: str | None, path: pathlib.Path | None) -> dict[str, Any]:
    tiers = [lower_tier(kind, path)] if kind else None  # type: ignore[arg-type]
    return engine_spec(model, CHUNK, tiers, rounds(), kv_extra={"host_capacity": HOST_CHUNKS * CHUNK * 4096})


@pytest.fixture(scope="module")
def runs(tiny_model: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("lower-tiers")
    disk, lmdb = tmp / "disk-tier", tmp / "lmdb-tier"
    out = {"baseline": run_engine(spec(tiny_model, None, None), timeout_s=400, workdir=tmp / "baseline")}
    out["disk"] = run_engine(spec(tiny_model, "disk", disk), timeout_s=400, workdir=tmp / "disk")
    corrupt_two_chunk_files(disk)
    out["disk_restart"] = run_engine(spec(tiny_model, "disk", disk), timeout_s=400, workdir=tmp / "restart")
    out["lmdb"] = run_engine(spec(tiny_model, "lmdb", lmdb), timeout_s=400, workdir=tmp / "lmdb")
    return out


def corrupt_two_chunk_files(root: pathlib.Path) -> None:
    files = sorted(root.rglob("*.chunk"))
    assert len(files) >= 8, files
    for path in files[:2]:
        data = bytearray(path.read_bytes())
        middle = len(data) // 2
        data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
        path.write_bytes(bytes(data))


def tokens(result: dict[str, Any]) -> list[list[list[int]]]:
    return [[r["output_token_ids"] for r in rnd["requests"]] for rnd in result["rounds"]]


def tier_hits(result: dict[str, Any], rnd: int, tier: str) -> float:
    def at(i: int) -> float:
        samples = result["rounds"][i]["tiercache_metrics"]
        return sum(v for k, v in samples.items() if k.startswith("tiercache_hit_tokens_total") and f'tier="{tier}"' in k)

    return at(rnd) - (at(rnd - 1) if rnd else 0.0)


@pytest.mark.parametrize("kind", ["disk", "disk_restart", "lmdb"])
def test_output_identical(runs: dict[str, dict[str, Any]], kind: str) -> None:
    assert tokens(runs[kind]) == tokens(runs["baseline"])


@pytest.mark.parametrize("kind", ["disk", "lmdb"])
def test_lower_tier_serves_what_the_host_tier_evicted(runs: dict[str, dict[str, Any]], kind: str) -> None:
    assert tier_hits(runs[kind], 2, kind) > 0, runs[kind]["rounds"][2]["tiercache_metrics"]
    # After the reset every prompt is served from tiercache (host + lower tier): 4 chunks each.
    assert cached(runs[kind], 2) == [4 * CHUNK] * len(PROMPTS)


def test_restart_hits_from_disk_on_the_first_pass(runs: dict[str, dict[str, Any]]) -> None:
    first_pass = runs["disk_restart"]["rounds"][1]
    assert tier_hits(runs["disk_restart"], 1, "disk") > 0, first_pass["tiercache_metrics"]
    assert sum(r["num_cached_tokens"] for r in first_pass["requests"]) >= 4 * CHUNK * 4


def test_corrupted_chunk_files_are_detected_and_recomputed(runs: dict[str, dict[str, Any]]) -> None:
    samples = runs["disk_restart"]["rounds"][1]["tiercache_metrics"]
    failed = sum(v for k, v in samples.items() if k.startswith("tiercache_failed_chunks_total"))
    assert failed >= 1, samples  # checksum mismatches became failed loads, then recomputes


@pytest.mark.parametrize("kind", ["disk", "lmdb"])
def test_prompts_at_once_wait_for_staging_room_and_refused_stores_are_retried(
        runs: dict[str, dict[str, Any]], kind: str) -> None:
    """Round 3: every hit is whole (a lookup waits a step rather than staging part of its hit and
    recomputing the rest) and the new prompts' refused stores land a step later: round 4 hits them whole."""
    result = runs[kind]
    samples = result["rounds"][3]["tiercache_metrics"]
    assert metric_delta(result, 3, "tiercache_lookup_waits_total", 'reason="no_staging_room"') > 0, samples
    assert metric_delta(result, 3, "tiercache_store_refused_chunks_total", 'tier="cpu"') > 0, samples  # the host tier
    # every hit loaded whole (vLLM counts a staging_no_slot recompute as cached: the tier's figures tell)
    assert metric_delta(result, 3, "tiercache_hit_tokens_total") == len(PROMPTS) * 4 * CHUNK, samples
    assert metric_delta(result, 3, "tiercache_faults_total", 'reason="staging_no_slot"') == 0, samples
    assert cached(result, 3)[: len(PROMPTS)] == [4 * CHUNK] * len(PROMPTS), samples
    assert cached(result, 4) == [4 * CHUNK] * len(NEW), result["rounds"][4]["tiercache_metrics"]
