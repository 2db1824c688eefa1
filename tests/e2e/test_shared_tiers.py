"""Several engines sharing KV through a shared tier (Redis), on real vLLM engines.

Engine processes, one after another, all with a Redis tier behind a host tier
(tiny random-weight Llama):

* ``writer`` (float32): computes the prompts; every chunk goes through to Redis;
* ``reader`` (float32, a new process: its host tier is empty): its first pass
  must hit those chunks in Redis (asynchronous lookups, staged loads) with greedy
  tokens identical to an engine without tiercache;
* ``other_dtype`` (bfloat16): a different namespace, so it must never see the
  float32 engines' chunks (no Redis hits at all);
* ``redis_down``: its Redis address has no server at all (a dead store): the
  engine serves every request with identical output, nothing crashes.

Reconnecting after Redis comes back is tested on the backend
(tests/integration/test_redis_backend.py), where the server can be killed and
restarted between two calls.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from tests.integration.redis_servers import RedisServer, redis_server  # noqa: F401  (fixture)
from tiercache.testing.engine_runner import random_prompts, run_engine

from .conftest import free_port

CHUNK = 128
PROMPTS = random_prompts(3, 400, seed=31)


def spec(model: pathlib.Path, redis_url: str | None, dtype: str = "float32", rounds: list | None = None) -> dict[str, Any]:
    port = free_port() if redis_url else None
    kv = None
    if redis_url:
        kv = {
            "kv_connector": "TierCacheConnector",
            "kv_connector_module_path": "tiercache.connector.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "chunk_tokens": CHUNK,
                "tiers": [
                    {"name": "cpu", "backend": "cpu", "capacity": "64MiB"},
                    {"name": "redis", "backend": "redis", "capacity": "1GiB",
                     "options": {"url": redis_url, "socket_timeout": 0.5, "connect_timeout": 0.5}},
                ],
                "metrics": {"port": port},
            },
        }
    return {
        "model_dir": str(model),
        "dtype": dtype,
        "block_size": 32,
        "max_model_len": 1024,
        "kv_transfer_config": kv,
        "tiercache_metrics_url": f"http://127.0.0.1:{port}/metrics" if port else None,
        "rounds": rounds or [{"prompts": PROMPTS, "max_tokens": 10, "sequential": True}],
    }


def redis_hits(result: dict[str, Any], rnd: int) -> float:
    samples = result["rounds"][rnd]["tiercache_metrics"]
    return sum(v for k, v in samples.items() if k.startswith("tiercache_hit_tokens_total") and 'tier="redis"' in k)


def tokens(result: dict[str, Any], rnd: int = 0) -> list[list[int]]:
    return [r["output_token_ids"] for r in result["rounds"][rnd]["requests"]]


@pytest.fixture(scope="module")
def runs(tiny_model: pathlib.Path, tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> dict[str, Any]:  # noqa: F811
    tmp = tmp_path_factory.mktemp("shared")
    redis_server.client().flushall()
    url = redis_server.url
    out: dict[str, Any] = {"baseline": run_engine(spec(tiny_model, None), timeout_s=400, workdir=tmp / "baseline")}
    out["writer"] = run_engine(spec(tiny_model, url), timeout_s=400, workdir=tmp / "writer")
    out["reader"] = run_engine(spec(tiny_model, url), timeout_s=400, workdir=tmp / "reader")
    out["other_dtype"] = run_engine(spec(tiny_model, url, dtype="bfloat16"), timeout_s=400, workdir=tmp / "other")
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    out["redis_down"] = run_engine(spec(tiny_model, dead), timeout_s=400, workdir=tmp / "down")
    return out


def test_writer_and_reader_match_the_baseline(runs: dict[str, Any]) -> None:
    assert tokens(runs["writer"]) == tokens(runs["baseline"])
    assert tokens(runs["reader"]) == tokens(runs["baseline"])


def test_reader_hits_what_the_writer_computed(runs: dict[str, Any]) -> None:
    assert redis_hits(runs["writer"], 0) == 0
    assert redis_hits(runs["reader"], 0) >= len(PROMPTS) * 3 * CHUNK
    assert all(r["num_cached_tokens"] >= 3 * CHUNK for r in runs["reader"]["rounds"][0]["requests"])


def test_other_dtype_never_sees_the_chunks(runs: dict[str, Any]) -> None:
    assert redis_hits(runs["other_dtype"], 0) == 0
    assert all(r["num_cached_tokens"] == 0 for r in runs["other_dtype"]["rounds"][0]["requests"])


def test_dead_redis_changes_nothing(runs: dict[str, Any]) -> None:
    assert tokens(runs["redis_down"]) == tokens(runs["baseline"])
    assert redis_hits(runs["redis_down"], 0) == 0
