"""Tensor parallelism over shared tiers: store shards named by KV head, on real vLLM engines.

Each TP rank holds some of the model's KV heads. Lower tiers hold a chunk as
one store shard per head (tiercache/shards.py), so two ranks never load each
other's bytes, and engines of different TP sizes share the heads they hold.
Engine processes, one after another (tiny random-weight Llama, 2 KV heads,
float32; a TP=2 engine's two workers share core 0: with one on each of this
machine's two cores, vLLM's spinning workers and engine core starved
redis-server and the scheduler's lookup thread, and lookups and stores timed out):

* ``base1`` / ``base2``: TP=1 and TP=2 without tiercache, prompts P then Q (and R at TP=2);
* ``a_tp2``: TP=2, Redis and the cache server behind the host tier: computes
  P; every head's shard goes through to both;
* ``c_tp1``: TP=1, Redis, a new process: P hits the shards the TP=2 engine
  wrote; then computes Q;
* the test makes Redis evict part of the keys (maxmemory, allkeys-lru: P's
  shards are the least recently used);
* ``b_tp2``: TP=2, Redis, a new process: P (some shards evicted: misses or
  failed loads that recompute) and Q (written by the TP=1 engine);
* ``s_tp2``: TP=2, cache server only, a new process: P hits what ``a_tp2``
  wrote there; then R (prompts of three chunks and two blocks), and R again
  after resetting the engine's cache and the host tier: R's partial chunks
  (connector/partial_chunks.py) come back from the server, each rank its head;
* ``control``: the negative control. TP=2, Redis, with rank separation off
  (``TIERCACHE_TEST_SHARDS_IGNORE_RANK=1``, every rank stores under the plain
  chunk key: the bug this guards against). P, then P again from Redis (host
  tier reset): one rank loads the other's heads and the tokens change.

Every engine's tokens equal the same-TP engine's without tiercache, with
tokens served by the shared tier > 0.
"""

from __future__ import annotations

import pathlib
import time
from typing import Any

import pytest

from tests.integration.redis_servers import RedisServer
from tests.server.harness import ServerProcess
from tiercache.shards import IGNORE_RANK_ENV
from tiercache.testing.engine_runner import random_prompts, run_engine

from .conftest import engine_spec, free_port

CHUNK = 128
P = random_prompts(3, 400, seed=61)
Q = random_prompts(3, 400, seed=62)
R = random_prompts(2, 3 * 128 + 2 * 32 + 12, seed=63)  # three chunks, two blocks and 12 tokens
BIND = {1: {"VLLM_CPU_OMP_THREADS_BIND": "0"}, 2: {"VLLM_CPU_OMP_THREADS_BIND": "0|0"}}
EVICT_BYTES = 3 << 20  # about a dozen of P's 256 KiB shards


def plain(prompts: list[list[int]], **extra: Any) -> dict[str, Any]:
    return {"prompts": prompts, "max_tokens": 10, "sequential": True, **extra}


def redis_tier(url: str) -> dict[str, Any]:
    return {"name": "redis", "backend": "redis", "capacity": "1GiB",
            "options": {"url": url, "socket_timeout": 1.0, "connect_timeout": 1.0, "reconnect_max_s": 0.5}}


def server_tier(address: str) -> dict[str, Any]:
    return {"name": "server", "backend": "server", "capacity": "1GiB",
            "options": {"address": address, "data_path": "tcp", "timeout_s": 2, "backoff_max_s": 0.5}}


def spec(model: pathlib.Path, tp: int, tiers: list[dict[str, Any]] | None, rounds: list[dict[str, Any]],
         env: dict[str, str] | None = None) -> dict[str, Any]:
    return engine_spec(model, CHUNK, tiers, rounds, llm_kwargs={"tensor_parallel_size": tp},
                       env={**BIND[tp], **(env or {})})


def hits(result: dict[str, Any], rnd: int, tier: str) -> float:
    samples = result["rounds"][rnd]["tiercache_metrics"]
    before = result["rounds"][rnd - 1]["tiercache_metrics"] if rnd else {}
    name = "tiercache_hit_tokens_total"
    now = sum(v for k, v in samples.items() if k.startswith(name) and f'tier="{tier}"' in k)
    was = sum(v for k, v in before.items() if k.startswith(name) and f'tier="{tier}"' in k)
    return now - was


def tokens(result: dict[str, Any], rnd: int = 0) -> list[list[int]]:
    return [r["output_token_ids"] for r in result["rounds"][rnd]["requests"]]


def evict_oldest(server: RedisServer, nbytes: int, candidates: set[bytes]) -> tuple[int, int]:
    """Make Redis evict about ``nbytes`` of ``candidates``, least recently used first; (keys before, after).

    Only the candidates get an expiry, and under ``volatile-lru`` only keys with one are evicted: with
    ``allkeys-lru`` Redis's sampled LRU sometimes took every first shard of Q's prompts too (Q is
    as recent as P after c_tp1 read P), and b_tp2 then hit nothing of Q (a flake seen once)."""
    client = server.client()
    before = client.dbsize()
    for key in candidates:
        client.expire(key, 3600)
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory-policy", "volatile-lru")
    client.config_set("maxmemory-samples", "10")
    client.config_set("maxmemory", str(used - nbytes))
    client.set("tiercache-test:filler", b"x")  # eviction runs on a write
    time.sleep(0.2)
    after = client.dbsize()
    client.config_set("maxmemory", "0")
    return before, after - 1


@pytest.fixture(scope="module")
def runs(tiny_model: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("tp-shared")
    redis = RedisServer(tmp / "redis").start()
    server = ServerProcess(tmp / "srv", port=free_port(), max_value_bytes=4 << 20,
                           tiers=[{"name": "cpu", "backend": "cpu", "capacity": "256MiB"}]).start()
    out: dict[str, Any] = {}
    try:
        def run(name: str, *args: Any, **kwargs: Any) -> None:
            out[name] = run_engine(spec(tiny_model, *args, **kwargs), timeout_s=500, workdir=tmp / name)

        run("base1", 1, None, [plain(P), plain(Q)])
        run("base2", 2, None, [plain(P), plain(Q), plain(R, max_tokens=3)])
        run("a_tp2", 2, [redis_tier(redis.url), server_tier(server.address)], [plain(P)])
        p_keys = set(redis.client().keys("*"))  # P's shards (c_tp1 adds Q's)
        run("c_tp1", 1, [redis_tier(redis.url)], [plain(P), plain(Q)])
        out["evicted"] = evict_oldest(redis, EVICT_BYTES, p_keys)
        run("b_tp2", 2, [redis_tier(redis.url)], [plain(P), plain(Q)])
        run("s_tp2", 2, [server_tier(server.address)],
            [plain(P), plain(R, max_tokens=3),  # (three tokens: no decode step fills another block)
             plain(R, max_tokens=3, reset_prefix_cache_before=True, reset_connector=True)])
        redis.client().flushall()
        run("control", 2, [redis_tier(redis.url)],
            [plain(P), plain(P, reset_prefix_cache_before=True, reset_connector=True)],
            env={IGNORE_RANK_ENV: "1"})
    finally:
        server.kill()
        redis.stop()
    return out


def test_tp2_engines_load_each_heads_own_shards_from_redis(runs: dict[str, Any]) -> None:
    assert tokens(runs["a_tp2"]) == tokens(runs["base2"], 0)
    assert tokens(runs["b_tp2"], 0) == tokens(runs["base2"], 0)  # P after eviction
    assert tokens(runs["b_tp2"], 1) == tokens(runs["base2"], 1)  # Q, written at TP=1


def test_tp1_engine_loads_what_a_tp2_engine_wrote_and_the_reverse(runs: dict[str, Any]) -> None:
    c = runs["c_tp1"]
    assert tokens(c, 0) == tokens(runs["base1"], 0)
    assert tokens(c, 1) == tokens(runs["base1"], 1)
    assert hits(c, 0, "redis") >= len(P) * 3 * CHUNK  # every chunk of P, written by TP=2
    assert hits(runs["b_tp2"], 1, "redis") > 0  # Q, written by TP=1


def test_redis_evicting_some_shards_changes_no_token(runs: dict[str, Any]) -> None:
    before, after = runs["evicted"]
    assert after < before, f"Redis evicted nothing ({before} keys)"
    b = runs["b_tp2"]
    assert tokens(b, 0) == tokens(runs["base2"], 0)
    assert hits(b, 0, "redis") < len(P) * 3 * CHUNK  # some of P is gone


def test_tp2_engines_share_through_the_cache_server(runs: dict[str, Any]) -> None:
    s = runs["s_tp2"]
    assert tokens(s) == tokens(runs["base2"], 0)
    assert hits(s, 0, "server") >= len(P) * 3 * CHUNK


def test_tp2_partial_chunks_come_back_from_the_cache_server_by_head(runs: dict[str, Any]) -> None:
    s = runs["s_tp2"]
    assert tokens(s, 1) == tokens(s, 2) == tokens(runs["base2"], 2)
    blocks = (3 * CHUNK + 2 * 32) // 32  # every full block of R's prompts: three chunks and a partial one
    # the engine's cache and the host tier were reset: every cached token came through the server
    assert [r["num_cached_tokens"] for r in s["rounds"][2]["requests"]] == [blocks * 32] * len(R)
    assert hits(s, 2, "server") > 0  # (a last round's counters may not all have reached the scrape)


def test_negative_control_without_rank_separation_changes_the_tokens(runs: dict[str, Any]) -> None:
    control = runs["control"]
    assert tokens(control, 0) == tokens(runs["base2"], 0)  # computed, nothing loaded
    assert hits(control, 1, "redis") > 0
    assert tokens(control, 1) != tokens(runs["base2"], 0), "ranks loaded each other's heads unnoticed"
