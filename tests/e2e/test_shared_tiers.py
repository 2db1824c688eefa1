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
  engine serves every request with identical output, nothing crashes;
* ``midrun``: one engine process through Redis's death and return. Round 0
  hits the writer's chunks; the test SIGKILLs redis-server inside round 1 (the
  engine's host tier was just reset, so it is loading from Redis); before round
  2 the test restarts redis-server on the same port (empty: no persistence);
  round 2 computes new prompts and writes them to the new Redis, round 3 (host
  tier reset again) hits them there. Tokens equal the baseline's throughout.
"""

from __future__ import annotations

import pathlib
import time
from typing import Any

import pytest

from tests.integration.redis_servers import RedisServer, redis_server  # noqa: F401  (fixture)
from tiercache.testing.engine_runner import EngineRun, random_prompts, run_engine

from .conftest import free_port, tiercache_kv_config

CHUNK = 128
PROMPTS = random_prompts(3, 400, seed=31)
NEW_PROMPTS = random_prompts(3, 400, seed=32)
KILL_AFTER_S = 0.4  # into round 1: inside the first prompts' loads from Redis


def plain(prompts: list[list[int]], **extra: Any) -> dict[str, Any]:
    return {"prompts": prompts, "max_tokens": 10, "sequential": True, **extra}


def after_reset(prompts: list[list[int]], barrier: str | None = None) -> dict[str, Any]:
    """A round that forgets the engine's own caches (host tier included) first."""
    return plain(prompts, barrier=barrier, reset_prefix_cache_before=True, reset_connector=True)


def spec(model: pathlib.Path, redis_url: str | None, dtype: str = "float32",
         rounds: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    port = free_port() if redis_url else None
    kv = None
    if redis_url:
        kv = tiercache_kv_config(
            CHUNK,
            [{"name": "redis", "backend": "redis", "capacity": "1GiB",
              "options": {"url": redis_url, "socket_timeout": 0.5, "connect_timeout": 0.5,
                          "reconnect_max_s": 0.5}}],
            metrics_port=port,
        )
    return {
        "model_dir": str(model),
        "dtype": dtype,
        "block_size": 32,
        "max_model_len": 1024,
        "kv_transfer_config": kv,
        "tiercache_metrics_url": f"http://127.0.0.1:{port}/metrics" if port else None,
        "rounds": rounds or [plain(PROMPTS)],
    }


def redis_hits(result: dict[str, Any], rnd: int) -> float:
    samples = result["rounds"][rnd]["tiercache_metrics"]
    return sum(v for k, v in samples.items() if k.startswith("tiercache_hit_tokens_total") and 'tier="redis"' in k)


def tokens(result: dict[str, Any], rnd: int = 0) -> list[list[int]]:
    return [r["output_token_ids"] for r in result["rounds"][rnd]["requests"]]


def run_through_outage(model: pathlib.Path, workdir: pathlib.Path, server: RedisServer) -> dict[str, Any]:
    """The ``midrun`` engine: kill redis-server inside round 1, restart it before round 2."""
    rounds = [plain(PROMPTS), after_reset(PROMPTS + NEW_PROMPTS, "kill"),
              after_reset(NEW_PROMPTS, "restart"), after_reset(NEW_PROMPTS)]
    run = EngineRun(spec(model, server.url, rounds=rounds), workdir)
    try:
        run.wait_for("kill", timeout_s=400)
        run.release("kill")
        time.sleep(KILL_AFTER_S)
        server.kill()
        run.wait_for("restart", timeout_s=400)
        server.restart()
        time.sleep(1.0)  # longer than the tier's longest reconnect wait
        run.release("restart")
        return run.result(timeout_s=400)
    finally:
        run.kill()
        if not server.running:
            server.restart()  # the fixture is shared by the whole session


@pytest.fixture(scope="module")
def runs(tiny_model: pathlib.Path, tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> dict[str, Any]:  # noqa: F811
    tmp = tmp_path_factory.mktemp("shared")
    redis_server.client().flushall()
    url = redis_server.url
    out: dict[str, Any] = {"baseline": run_engine(spec(tiny_model, None, rounds=[plain(PROMPTS), plain(NEW_PROMPTS)]),
                                                  timeout_s=400, workdir=tmp / "baseline")}
    out["writer"] = run_engine(spec(tiny_model, url), timeout_s=400, workdir=tmp / "writer")
    out["reader"] = run_engine(spec(tiny_model, url), timeout_s=400, workdir=tmp / "reader")
    out["other_dtype"] = run_engine(spec(tiny_model, url, dtype="bfloat16"), timeout_s=400, workdir=tmp / "other")
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    out["redis_down"] = run_engine(spec(tiny_model, dead), timeout_s=400, workdir=tmp / "down")
    out["midrun"] = run_through_outage(tiny_model, tmp / "midrun", redis_server)
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


def test_engine_keeps_serving_while_redis_dies_and_returns(runs: dict[str, Any]) -> None:
    midrun, baseline = runs["midrun"], runs["baseline"]
    assert tokens(midrun, 0) == tokens(baseline, 0)
    assert tokens(midrun, 1) == tokens(baseline, 0) + tokens(baseline, 1)  # Redis killed inside
    assert tokens(midrun, 2) == tokens(baseline, 1)
    assert tokens(midrun, 3) == tokens(baseline, 1)


def test_engine_picks_the_restarted_redis_up_again(runs: dict[str, Any]) -> None:
    midrun = runs["midrun"]
    assert redis_hits(midrun, 0) >= len(PROMPTS) * 3 * CHUNK  # the writer's chunks
    in_round_3 = redis_hits(midrun, 3) - redis_hits(midrun, 2)
    assert in_round_3 >= len(NEW_PROMPTS) * 3 * CHUNK  # written to the restarted Redis in round 2
