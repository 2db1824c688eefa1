"""A hybrid model (full + sliding-window layers) at TP=2 over shared tiers, on real vLLM engines.

The ``swa`` random-weight Llama (2 KV heads, layers alternating full and
sliding attention, window 256; two KV-cache groups) at TP=2: each rank holds
one KV head of both groups. Lower tiers hold a chunk as one store shard per
head (tiercache/shards.py) whose bytes are both groups' blocks of that head.
Engine processes, one after another (prompts of 400 tokens, longer than the
window; the workers of a TP=2 engine share core 0, as in test_tp_shared_tiers):

* ``base2``: TP=2 without tiercache;
* ``write_tp2``: TP=2, Redis and the cache server behind the host tier (write-through):
  computes P, every head's shard of both groups goes to both;
* ``read_tp2``: TP=2, the cache server only, a new process: P hits the shards
  the first engine wrote (each rank its head, both groups);
* ``control``: the negative control: TP=2, Redis flushed, rank separation off
  (``TIERCACHE_TEST_SHARDS_IGNORE_RANK=1``: both ranks store under one key, so
  one rank loads the other's head). P, then P again from Redis after a reset:
  the tokens change.

Every engine's tokens equal the TP=2 engine's without tiercache, with tokens
served by the shared tier > 0. (Reading another TP size's shards is the same
code for one group or several: test_tp_shared_tiers covers it on the tiny model.)
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from tests.integration.redis_servers import RedisServer
from tests.server.harness import ServerProcess
from tiercache.shards import IGNORE_RANK_ENV
from tiercache.testing.engine_runner import run_engine
from tiercache.testing.random_llama import make_model_dir

from .conftest import free_port
from .test_tp_shared_tiers import CHUNK, P, hits, plain, redis_tier, server_tier, spec, tokens

FULL_CHUNKS = len(P) * (400 // CHUNK)  # every full chunk of P


@pytest.fixture(scope="module")
def runs(models_root: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = make_model_dir("swa", models_root)
    tmp = tmp_path_factory.mktemp("tp-hybrid")
    redis = RedisServer(tmp / "redis").start()
    server = ServerProcess(tmp / "srv", port=free_port(), max_value_bytes=4 << 20,
                           tiers=[{"name": "cpu", "backend": "cpu", "capacity": "256MiB"}]).start()
    out: dict[str, Any] = {}
    try:
        def run(name: str, *args: Any, **kwargs: Any) -> None:
            out[name] = run_engine(spec(model, *args, **kwargs), timeout_s=500, workdir=tmp / name)

        run("base2", 2, None, [plain(P)])
        run("write_tp2", 2, [redis_tier(redis.url), server_tier(server.address)], [plain(P)])
        run("read_tp2", 2, [server_tier(server.address)], [plain(P)])
        redis.client().flushall()
        run("control", 2, [redis_tier(redis.url)],
            [plain(P), plain(P, reset_prefix_cache_before=True, reset_connector=True)],
            env={IGNORE_RANK_ENV: "1"})
    finally:
        server.kill()
        redis.stop()
    return out


def test_tp2_hybrid_engine_writes_and_reads_its_heads_shards(runs: dict[str, Any]) -> None:
    assert tokens(runs["write_tp2"]) == tokens(runs["base2"])
    read_tp2 = runs["read_tp2"]
    assert tokens(read_tp2) == tokens(runs["base2"])
    assert hits(read_tp2, 0, "server") >= FULL_CHUNKS * CHUNK


def test_negative_control_one_rank_loading_the_others_head_changes_the_tokens(runs: dict[str, Any]) -> None:
    control = runs["control"]
    assert tokens(control, 0) == tokens(runs["base2"])  # computed, nothing loaded
    assert hits(control, 1, "redis") > 0
    assert tokens(control, 1) != tokens(runs["base2"]), "ranks loaded each other's heads unnoticed"
