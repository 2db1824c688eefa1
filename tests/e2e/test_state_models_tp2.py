"""A state-layer hybrid (LFM2) at tensor parallelism 2 through tiercache, over a Redis tier the ranks share.

Each TP rank holds half of the model's KV heads *and* half of each conv layer's
channels, so a rank's recurrent state is its own: tiercache stores a state-layer
model's chunks as rank shards (tiercache/shards.py; no head shards: a state is
not cut by KV head), and engines of other TP sizes do not share them.

Engines (float32, 32-token blocks and chunks, prefill split at every block: the
oracle of tests/e2e/test_state_models.py), one after another; a TP=2 engine's two
workers share core 0 (as in tests/e2e/test_tp_shared_tiers.py):

* ``baseline``: TP=2 without tiercache;
* ``tiercache``: TP=2, a host tier of 16 chunks before a Redis tier (a shared
  tier: both ranks' shards in one store, found by the scheduler's shared lookup,
  state keys included): the repeated prompts' hits come from Redis;
* ``control``: the negative control: the same with rank separation off
  (``TIERCACHE_TEST_SHARDS_IGNORE_RANK=1``: every rank stores under the plain
  chunk key, the bug this guards against): both ranks then load one rank's
  shard, its attention heads and its half of the states, and the tokens change;
* ``producer`` and ``consumer``: P/D at TP=2 (mode via_host, page hashes checked;
  connector/pd/state_handoff.py), the same split: the producer prefills round 1's
  prompts and hands each off up to its last block boundary (the state key last),
  each consumer rank reads its own shard from the producer rank of its number, and
  the consumer's tokens equal the baseline's round 1 with only the tokens after that
  boundary computed (the TP=1 module tests/e2e/test_pd_state_models.py has the
  controls of a wrong state).

Rounds: (0) warm-up; (1) three distinct prompts; (2) the same after
``reset_prefix_cache()``: the host tier (16 chunks) no longer holds them (every
chunk is stored twice, with and without its state), so they come from Redis,
where the ranks' shards meet.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from tests.integration.redis_servers import RedisServer
from tiercache.shards import IGNORE_RANK_ENV
from tiercache.testing.engine_runner import EngineRun, random_prompts, run_engine
from tiercache.testing.random_llama import make_model_dir

from .conftest import cached, engine_spec, free_port, metric_delta
from .test_pd import PD_TEST_BLOCKS

CHUNK = 32
ENGINE_TIMEOUT_S = 400
HIT_ROUND = 2
# a rank's chunk slot: a position per group, each spanning 2 attention layers' 16 KiB pages (one KV head)
# and 2 conv layers' 1 KiB states (half the channels)
SLOT_BYTES = 2 * (2 * 16 * 1024 + 2 * 1024)
HOST_CHUNKS = 16
BIND = {"VLLM_CPU_OMP_THREADS_BIND": "0|0"}


def workload() -> list[dict[str, Any]]:
    prompts = [random_prompts(1, 300 + 50 * i, seed=41 + i)[0] for i in range(3)]
    return [
        {"prompts": random_prompts(1, 64, seed=98), "max_tokens": 4, "warmup": True, "sequential": True},
        {"prompts": prompts, "max_tokens": 16, "sequential": True},
        {"prompts": prompts, "max_tokens": 16, "reset_prefix_cache_before": True, "sequential": True},
    ]


def spec(model: pathlib.Path, name: str, redis_url: str) -> dict[str, Any]:
    lower = None if name == "baseline" else [
        {"name": "redis", "backend": "redis", "capacity": "1GiB",
         "options": {"url": redis_url, "socket_timeout": 2.0, "connect_timeout": 2.0, "reconnect_max_s": 0.5}}]
    env = {**BIND, **({IGNORE_RANK_ENV: "1"} if name == "control" else {})}
    return engine_spec(model, CHUNK, lower, workload(), kv_extra={"host_capacity": HOST_CHUNKS * SLOT_BYTES},
                       env=env, max_num_batched_tokens=CHUNK, llm_kwargs={"tensor_parallel_size": 2})


@pytest.fixture(scope="module")
def runs(models_root: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    model = make_model_dir("lfm2", models_root)
    tmp = tmp_path_factory.mktemp("state_tp2")
    redis = RedisServer(tmp / "redis").start()
    results = {}
    try:
        for name in ("baseline", "tiercache", "control"):
            redis.client().flushall()  # the control must not find the right shards
            results[name] = run_engine(spec(model, name, redis.url), timeout_s=ENGINE_TIMEOUT_S, workdir=tmp / name)
            results[name]["log"] = (tmp / name / "engine.log").read_text(errors="replace")
    finally:
        redis.stop()
    results["pd"] = run_pd_pair(model, tmp)
    return results


def run_pd_pair(model: pathlib.Path, tmp: pathlib.Path) -> dict[str, Any]:
    """A TP=2 producer handing round 1's prompts off to a TP=2 consumer (mode via_host)."""
    prompts = workload()[1]["prompts"]
    params = tmp / "pd_params.json"
    pd = {"port": free_port(), "handoff_timeout_s": 600.0}
    tp2 = {"max_num_batched_tokens": CHUNK, "llm_kwargs": {"tensor_parallel_size": 2},
           "num_gpu_blocks_override": PD_TEST_BLOCKS,  # NIXL registers (prefaults) the whole KV cache
           "in_process": False}  # as test_pd's P/D engines: vLLM's usual processes
    producer = EngineRun(engine_spec(model, CHUNK, [], [
        {"prompts": prompts, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}, "sequential": True},
        {"prompts": prompts[:1], "max_tokens": 1, "barrier": "end"}],  # killed while waiting here
        kv_extra={"kv_role": "kv_producer", "pd": pd}, env=BIND, **tp2), tmp / "producer")
    consumer = EngineRun(engine_spec(model, CHUNK, [], [
        {"prompts": prompts, "max_tokens": 16, "kv_transfer_params_file": str(params), "sequential": True,
         "barrier": "params"}],
        kv_extra={"kv_role": "kv_consumer", "load_mode": "async", "pd": {"read_timeout_s": 10.0}},
        env={"VLLM_CPU_OMP_THREADS_BIND": "1|1"}, **tp2), tmp / "consumer")
    try:
        producer.wait_for("end", timeout_s=ENGINE_TIMEOUT_S)
        handed = producer.partial("end")["rounds"][0]
        params.write_text(json.dumps([r["kv_transfer_params"] for r in handed["requests"]]))
        consumer.wait_for("params", timeout_s=ENGINE_TIMEOUT_S)
        consumer.release("params")
        return {"producer_r0": handed, "consumer": consumer.result(timeout_s=ENGINE_TIMEOUT_S)}
    finally:
        producer.kill()
        consumer.kill()


def outputs(result: dict[str, Any], rnd: int) -> list[list[int]]:
    return [r["output_token_ids"] for r in result["rounds"][rnd]["requests"]]



def test_tiercache_serves_the_state_model_at_tp2(runs: dict[str, dict[str, Any]]) -> None:
    for name in ("tiercache", "control"):
        assert "tiercache inactive" not in runs[name]["log"], name


@pytest.mark.parametrize("rnd", [1, HIT_ROUND])
def test_greedy_output_identical_to_the_engine_without_tiercache(runs: dict[str, dict[str, Any]], rnd: int) -> None:
    assert outputs(runs["tiercache"], rnd) == outputs(runs["baseline"], rnd)


def test_every_prompt_resumes_from_the_shared_tier(runs: dict[str, dict[str, Any]]) -> None:
    result = runs["tiercache"]
    lengths = [r["prompt_len"] for r in result["rounds"][HIT_ROUND]["requests"]]
    assert cached(result, HIT_ROUND) == [(n - 1) // CHUNK * CHUNK for n in lengths]
    from_redis = metric_delta(result, HIT_ROUND, "tiercache_hit_tokens_total", 'tier="redis"')
    total = metric_delta(result, HIT_ROUND, "tiercache_hit_tokens_total")
    assert total == sum(cached(result, HIT_ROUND)) and from_redis >= 300 - CHUNK, (total, from_redis)


def test_negative_control_ranks_loading_one_shard_change_the_output(runs: dict[str, dict[str, Any]]) -> None:
    control = runs["control"]
    assert cached(control, HIT_ROUND) == cached(runs["tiercache"], HIT_ROUND)  # the same hits...
    assert outputs(control, 1) == outputs(runs["baseline"], 1)
    changed = sum(a != b for a, b in zip(outputs(control, HIT_ROUND), outputs(runs["baseline"], HIT_ROUND),
                                         strict=True))
    assert changed >= 2, changed  # ...of the wrong rank's bytes


def test_pd_at_tp2_hands_off_to_the_last_block_boundary_token_exact(runs: dict[str, dict[str, Any]]) -> None:
    pd = runs["pd"]
    prompts = workload()[1]["prompts"]
    for req in pd["producer_r0"]["requests"]:
        ours = req["kv_transfer_params"]["tiercache"]
        assert ours["ends_with_state"] and ours["tail_tokens"] == 0 and ours["fingerprint"]["tp_size"] == 2
        assert len(ours["chunk_keys"]) == (req["prompt_len"] - 1) // CHUNK
    consumer = pd["consumer"]
    assert outputs(consumer, 0) == outputs(runs["baseline"], 1)
    handed = sum((len(p) - 1) // CHUNK * CHUNK for p in prompts)
    assert metric_delta(consumer, 0, "tiercache_hit_tokens_total", 'tier="peer"') == handed
    local = sum(v for k, v in consumer["rounds"][0]["metrics"].items()
                if "prompt_tokens_by_source" in k and "local_compute" in k)
    assert local == sum(len(p) for p in prompts) - handed  # only the tokens after each hand-off
