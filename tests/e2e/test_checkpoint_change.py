"""A checkpoint replaced at the same path shares no chunk with the one before it (issue 16, item 2).

Two random-weight checkpoints of the tiny Llama (same config, seeds 1 and 2, so
the same file names and sizes) are written in turn to one directory; every
engine loads that same path string and shares one persistent disk tier:

* ``a``: checkpoint 1, fills the disk tier;
* ``b``: checkpoint 2 (written over checkpoint 1), same prompts: no tiercache
  hit at all, and its greedy tokens equal ``b_plain`` (checkpoint 2 without
  tiercache) — before the namespace covered the checkpoint's content, B loaded
  A's KV (same path, same namespace);
* ``c``: checkpoint 1 written back (positive control): it hits A's chunks on
  the disk tier and its tokens equal A's.

Hits are read from tiercache's own Prometheus counters (one snapshot per round)
and from vLLM's cached-token counts.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from tiercache.testing.engine_runner import random_prompts, run_engine
from tiercache.testing.random_llama import make_model_dir

from .conftest import engine_spec

CHUNK = 128
PROMPTS = random_prompts(3, 2 * CHUNK + 40, seed=16)  # two full chunks each


def spec(model: pathlib.Path, disk: pathlib.Path | None) -> dict[str, Any]:
    tiers = None if disk is None else [
        {"name": "disk", "backend": "disk", "capacity": "64MiB", "options": {"root": str(disk)}}]
    return engine_spec(model, CHUNK, tiers, [
        {"prompts": PROMPTS, "max_tokens": 8},
        # more steps, so the write-through copies of the last chunks reach the disk tier
        {"prompts": random_prompts(1, 64, seed=99), "max_tokens": 4},
    ])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("checkpoint-change")
    models, disk = tmp / "models", tmp / "disk-tier"

    def checkpoint(seed: int) -> pathlib.Path:
        return make_model_dir("tiny", models, seed=seed)  # always models/tiny

    path = checkpoint(1)
    out = {"a": run_engine(spec(path, disk), timeout_s=400, workdir=tmp / "a")}
    assert checkpoint(2) == path  # the same path string, other weights
    out["b"] = run_engine(spec(path, disk), timeout_s=400, workdir=tmp / "b")
    out["b_plain"] = run_engine(spec(path, None), timeout_s=400, workdir=tmp / "b-plain")
    assert checkpoint(1) == path
    out["c"] = run_engine(spec(path, disk), timeout_s=400, workdir=tmp / "c")
    return out


def tokens(result: dict[str, Any]) -> list[list[int]]:
    return [r["output_token_ids"] for r in result["rounds"][0]["requests"]]


def hit_tokens(result: dict[str, Any]) -> float:
    samples = result["rounds"][0]["tiercache_metrics"]
    assert "error" not in samples, samples  # a failed scrape must not read as zero hits
    return sum(v for k, v in samples.items() if k.startswith("tiercache_hit_tokens_total"))


def cached_tokens(result: dict[str, Any]) -> int:
    return sum(r["num_cached_tokens"] for r in result["rounds"][0]["requests"])


def test_the_checkpoints_really_differ(runs: dict[str, dict[str, Any]]) -> None:
    assert tokens(runs["b_plain"]) != tokens(runs["a"])  # else a wrong hit would be invisible


def test_a_replaced_checkpoint_shares_no_chunk(runs: dict[str, dict[str, Any]]) -> None:
    assert hit_tokens(runs["b"]) == 0, runs["b"]["rounds"][0]["tiercache_metrics"]
    assert cached_tokens(runs["b"]) == 0
    assert tokens(runs["b"]) == tokens(runs["b_plain"])


def test_the_same_checkpoint_written_back_hits(runs: dict[str, dict[str, Any]]) -> None:
    assert hit_tokens(runs["c"]) > 0, runs["c"]["rounds"][0]["tiercache_metrics"]
    assert cached_tokens(runs["c"]) >= len(PROMPTS) * CHUNK
    assert tokens(runs["c"]) == tokens(runs["a"])
