"""Stalled tiers on real vLLM engines: the load deadline bounds every step, the output never changes.

A *stopped* store (SIGSTOP: its socket accepts, nothing answers) is worse than
a dead one: nothing fails, everything waits. Engines (tiny random-weight
Llama, float32, each in a subprocess) with ``deadlines.load_s`` = LOAD_S and
lower-tier timeouts far longer than that, so only the deadline can end a wait:

* ``redis``: round 0 fills Redis; round 1 (host tier reset) loads from it, so
  the engine knows what Redis holds; the test SIGSTOPs redis-server; round 2
  (host tier reset) loads from the stopped Redis: recomputed; the test sends
  SIGCONT; round 3 serves as before.
* ``server``: the same with tiercache's cache server (``tiercache serve``).
* ``plugin_sync`` / ``plugin_async``: a lower tier whose gets are never
  reported (tiercache/testing/faulty_backends.py), in each ``load_mode``; a
  small host tier makes round 1 load from it.

Every round's greedy tokens equal an engine's without tiercache; no request
waits for its first token longer than the deadline plus SLACK, and no
request's decode steps take that long together (deletes and stores never wait
on the stopped tier); the engine lives to its last round, and after the stall
the shared tier still holds every chunk (a timed-out load forgets, it does not
delete). Negative controls:
a load really waited on the stalled tier (the slowest first token took at
least most of the deadline, and the timeouts of the tiers themselves are
longer than the bound) and the deadline fired
(``tiercache_faults_total{reason="load_deadline"}`` > 0).
"""

from __future__ import annotations

import os
import pathlib
import signal
from collections.abc import Callable
from typing import Any

import pytest

from tests.integration.redis_servers import RedisServer, require_redis
from tests.server.harness import ServerProcess
from tiercache.testing.engine_runner import EngineRun, random_prompts, run_engine
from tiercache.testing.faulty_backends import NEVER_REPORTS

from .conftest import free_port, tiercache_kv_config

CHUNK = 128
PROMPTS = random_prompts(3, 400, seed=61)
LOAD_S = 1.0
SLACK = 2.0  # a forward pass, scheduling and a busy 2-core machine on top of the deadline
TIER_TIMEOUT_S = 8.0  # the tiers' own socket timeouts: longer than LOAD_S + SLACK


def rnd(barrier: str | None = None, reset_connector: bool = True) -> dict[str, Any]:
    """A round of PROMPTS, one at a time, after forgetting vLLM's cache (and the host tier)."""
    return {"prompts": PROMPTS, "max_tokens": 10, "sequential": True, "barrier": barrier,
            "reset_prefix_cache_before": True, "reset_connector": reset_connector}


def spec(model: pathlib.Path, tier: dict[str, Any] | None, rounds: list[dict[str, Any]],
         host_capacity: str = "64MiB", load_mode: str = "sync") -> dict[str, Any]:
    port = free_port() if tier else None
    kv = None
    if tier:
        kv = tiercache_kv_config(CHUNK, [tier], metrics_port=port, host_capacity=host_capacity,
                                 load_mode=load_mode, deadlines={"load_s": LOAD_S, "store_s": 2 * LOAD_S})
    return {"model_dir": str(model), "dtype": "float32", "block_size": 32, "max_model_len": 1024,
            "kv_transfer_config": kv, "tiercache_metrics_url": f"http://127.0.0.1:{port}/metrics" if port else None,
            "rounds": rounds}


def through_a_stall(model: pathlib.Path, workdir: pathlib.Path, tier: dict[str, Any],
                    stop: Callable[[], None], resume: Callable[[], None]) -> dict[str, Any]:
    """Fill the tier, load from it, then load from it while it is stopped, then after it resumed."""
    rounds = [rnd(reset_connector=False), rnd(), rnd("stop"), rnd("resume")]
    run = EngineRun(spec(model, tier, rounds), workdir)
    try:
        run.wait_for("stop", timeout_s=400)
        stop()
        run.release("stop")
        run.wait_for("resume", timeout_s=120)
        resume()
        run.release("resume")
        return run.result(timeout_s=400)
    finally:
        resume()
        run.kill()


def signal_process(pid: int, sig: signal.Signals) -> Callable[[], None]:
    def send() -> None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return send


@pytest.fixture(scope="module")
def runs(tiny_model: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    require_redis()
    tmp = tmp_path_factory.mktemp("stalled")
    out: dict[str, Any] = {"baseline": run_engine(spec(tiny_model, None, [rnd(reset_connector=False)]),
                                                  timeout_s=400, workdir=tmp / "baseline")}
    redis = RedisServer(tmp / "redis").start()
    try:
        tier = {"name": "redis", "backend": "redis", "capacity": "1GiB",
                "options": {"url": redis.url, "socket_timeout": TIER_TIMEOUT_S, "connect_timeout": TIER_TIMEOUT_S,
                            "reconnect_max_s": 0.5}}
        out["redis"] = through_a_stall(tiny_model, tmp / "redis-engine", tier, redis.pause, redis.resume)
    finally:
        redis.stop()
    server = ServerProcess(tmp / "srv", port=free_port(), max_value_bytes=4 << 20,
                           tiers=[{"name": "cpu", "backend": "cpu", "capacity": "256MiB"}]).start()
    try:
        assert server.proc is not None
        tier = {"name": "server", "backend": "server", "capacity": "1GiB",
                "options": {"address": server.address, "data_path": "tcp", "timeout_s": TIER_TIMEOUT_S,
                            "backoff_max_s": 0.5}}
        out["server"] = through_a_stall(tiny_model, tmp / "server-engine", tier,
                                        signal_process(server.proc.pid, signal.SIGSTOP),
                                        signal_process(server.proc.pid, signal.SIGCONT))
    finally:
        server.kill()
    never = {"name": "stuck", "backend": NEVER_REPORTS, "capacity": "1GiB"}
    for mode in ("sync", "async"):
        # 4 host slots of 128-token chunks: round 1's first prompt loads from the stuck tier
        rounds = [rnd(reset_connector=False), rnd(reset_connector=False), rnd(reset_connector=False)]
        out[f"plugin_{mode}"] = run_engine(spec(tiny_model, never, rounds, host_capacity="2MiB", load_mode=mode),
                                           timeout_s=400, workdir=tmp / f"plugin-{mode}")
    return out


STALLED = {"redis": 2, "server": 2, "plugin_sync": 1, "plugin_async": 1}  # the round that meets the stall


def tokens(result: dict[str, Any], index: int) -> list[list[int]]:
    return [r["output_token_ids"] for r in result["rounds"][index]["requests"]]


def faults(result: dict[str, Any], index: int, reason: str) -> float:
    samples = result["rounds"][index]["tiercache_metrics"]
    return sum(v for k, v in samples.items() if k.startswith("tiercache_faults_total") and f'reason="{reason}"' in k)


def hits(result: dict[str, Any], index: int, tier: str) -> float:
    samples = result["rounds"][index]["tiercache_metrics"]
    return sum(v for k, v in samples.items() if k.startswith("tiercache_hit_tokens_total") and f'tier="{tier}"' in k)


@pytest.mark.parametrize("name", list(STALLED))
def test_every_round_matches_the_engine_without_tiercache(runs: dict[str, Any], name: str) -> None:
    result, baseline = runs[name], tokens(runs["baseline"], 0)
    assert len(result["rounds"]) in (3, 4)  # the engine served every round: no crash
    for index in range(len(result["rounds"])):
        assert tokens(result, index) == baseline, f"{name} round {index}"


@pytest.mark.parametrize("name", list(STALLED))
def test_no_request_waits_longer_than_the_deadline(runs: dict[str, Any], name: str) -> None:
    for index, rnd_result in enumerate(runs[name]["rounds"]):
        for req in rnd_result["requests"]:
            assert req["ttft_s"] < LOAD_S + SLACK, f"{name} round {index}: first token after {req['ttft_s']:.2f}s"
            assert req["decode_s"] < LOAD_S + SLACK, f"{name} round {index}: decode took {req['decode_s']:.2f}s"


@pytest.mark.parametrize("name", list(STALLED))
def test_the_deadline_is_what_ended_the_wait(runs: dict[str, Any], name: str) -> None:
    result, stalled = runs[name], STALLED[name]
    assert faults(result, stalled - 1, "load_deadline") == 0  # nothing stalled before
    assert faults(result, stalled, "load_deadline") > 0
    slowest = max(r["ttft_s"] for r in result["rounds"][stalled]["requests"])
    assert slowest >= 0.8 * LOAD_S, f"no load waited on the stalled tier (slowest first token {slowest:.2f}s)"


@pytest.mark.parametrize("name", ["redis", "server"])
def test_the_shared_tier_served_before_the_stall_and_kept_its_chunks(runs: dict[str, Any], name: str) -> None:
    # round 1 loads from the shared tier (the last prompt's chunks may still be in the host tier,
    # pinned until their write-through copy was reported when the engine went idle)
    assert hits(runs[name], 1, name) >= 2 * 3 * CHUNK
    # after the stall every prompt hits again: a load that failed because the tier was stopped
    # forgets the tier's chunks, it never deletes what other engines share
    assert all(r["num_cached_tokens"] >= 3 * CHUNK for r in runs[name]["rounds"][3]["requests"])
