"""Engines sharing KV through tiercache's own cache server, on real vLLM engines.

A cache server (``tiercache serve``, a subprocess, host memory written through
to a disk tier) is shared by engine processes run one after another:

* ``writer`` computes the prompts; every chunk goes through to the server;
* ``reader``, a new process with an empty host tier, hits those chunks on the
  server (asynchronous lookup, staged load over TCP) with greedy tokens
  identical to an engine without tiercache;
* ``midrun`` lives through the server's death and return: round 0 hits on the
  server; before round 1 the test releases the engine and SIGKILLs the server
  while the engine is loading from it (its host tier was just reset, so every
  prompt asks the server); before round 2 the test starts the server again on
  the same port (warm from its disk tier) and the engine, still the same
  process, picks it up again: its round 2 hits on the server. Tokens equal the
  baseline's in every round.
"""

from __future__ import annotations

import pathlib
import time
from typing import Any

import pytest

from tests.server.harness import ServerProcess
from tiercache.testing.engine_runner import EngineRun, random_prompts, run_engine

from .conftest import engine_spec, free_port

CHUNK = 128
PROMPTS = random_prompts(3, 400, seed=41)
NEW_PROMPTS = random_prompts(3, 400, seed=42)
KILL_AFTER_S = 0.4  # into round 1: inside the first prompts' loads from the server


def spec(model: pathlib.Path, server: str | None, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    tiers = None if server is None else [
        {"name": "server", "backend": "server", "capacity": "1GiB",
         "options": {"address": server, "data_path": "tcp", "timeout_s": 2, "backoff_max_s": 0.5}}]
    return engine_spec(model, CHUNK, tiers, rounds)


def plain(prompts: list[list[int]]) -> dict[str, Any]:
    return {"prompts": prompts, "max_tokens": 10, "sequential": True}


def after_reset(prompts: list[list[int]], barrier: str) -> dict[str, Any]:
    """A round that forgets the engine's own caches (host tier included) after a barrier."""
    return {**plain(prompts), "barrier": barrier, "reset_prefix_cache_before": True,
            "reset_connector": True}


def server_hits(result: dict[str, Any], rnd: int = 0) -> float:
    samples = result["rounds"][rnd]["tiercache_metrics"]
    return sum(v for k, v in samples.items()
               if k.startswith("tiercache_hit_tokens_total") and 'tier="server"' in k)


def tokens(result: dict[str, Any], rnd: int = 0) -> list[list[int]]:
    return [r["output_token_ids"] for r in result["rounds"][rnd]["requests"]]


def server_process(tmp: pathlib.Path, port: int) -> ServerProcess:
    return ServerProcess(
        tmp / "srv", port=port, max_value_bytes=4 << 20,
        tiers=[{"name": "cpu", "backend": "cpu", "capacity": "256MiB"},
               {"name": "disk", "backend": "disk", "capacity": "256MiB",
                "options": {"root": str(tmp / "srv-disk"), "fsync": "batch"}}],
    )


def run_through_outage(model: pathlib.Path, tmp: pathlib.Path, server: ServerProcess) -> tuple[dict[str, Any], ServerProcess]:
    """The ``midrun`` engine: kill the server inside round 1, restart it before round 2."""
    rounds = [plain(PROMPTS), after_reset(PROMPTS + NEW_PROMPTS, "kill"), after_reset(PROMPTS, "restart")]
    run = EngineRun(spec(model, server.address, rounds), tmp / "midrun")
    try:
        run.wait_for("kill", timeout_s=400)
        run.release("kill")
        time.sleep(KILL_AFTER_S)
        server.kill()
        run.wait_for("restart", timeout_s=400)
        server = server_process(tmp, server.port).start()
        time.sleep(1.0)  # longer than the client's longest backoff: the next try connects
        run.release("restart")
        return run.result(timeout_s=400), server
    finally:
        run.kill()


@pytest.fixture(scope="module")
def runs(tiny_model: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("server-tier")
    server = server_process(tmp, free_port()).start()
    try:
        out: dict[str, Any] = {"baseline": run_engine(
            spec(tiny_model, None, [plain(PROMPTS), plain(NEW_PROMPTS)]), timeout_s=400, workdir=tmp / "base")}
        out["writer"] = run_engine(spec(tiny_model, server.address, [plain(PROMPTS)]),
                                   timeout_s=400, workdir=tmp / "writer")
        out["reader"] = run_engine(spec(tiny_model, server.address, [plain(PROMPTS)]),
                                   timeout_s=400, workdir=tmp / "reader")
        out["midrun"], server = run_through_outage(tiny_model, tmp, server)
        out["server_log"] = server.log()
    finally:
        server.kill()
    return out


def test_engines_share_through_the_server_token_exact(runs: dict[str, Any]) -> None:
    for name in ("writer", "reader"):
        assert tokens(runs[name]) == tokens(runs["baseline"]), name


def test_reader_hits_on_the_server(runs: dict[str, Any]) -> None:
    assert server_hits(runs["writer"]) == 0
    assert server_hits(runs["reader"]) >= len(PROMPTS) * 3 * CHUNK


def test_engine_keeps_serving_while_the_server_dies_and_returns(runs: dict[str, Any]) -> None:
    midrun, baseline = runs["midrun"], runs["baseline"]
    assert tokens(midrun, 0) == tokens(baseline, 0)
    assert tokens(midrun, 1) == tokens(baseline, 0) + tokens(baseline, 1)  # server killed inside
    assert tokens(midrun, 2) == tokens(baseline, 0)


def test_engine_picks_the_restarted_server_up_again(runs: dict[str, Any]) -> None:
    midrun = runs["midrun"]
    assert server_hits(midrun, 0) >= len(PROMPTS) * 3 * CHUNK  # the writer's chunks
    in_round_2 = server_hits(midrun, 2) - server_hits(midrun, 1)
    assert in_round_2 >= len(PROMPTS) * 3 * CHUNK, runs["server_log"][-2000:]
