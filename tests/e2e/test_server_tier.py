"""Two engines sharing KV through tiercache's own cache server, on real vLLM engines.

A cache server (``tiercache serve``, a subprocess) holds host memory; engine A
computes prompts and writes every chunk through to it; engine B, a new process
with an empty host tier, hits those chunks on the server (asynchronous lookup,
staged load over TCP) with greedy tokens identical to an engine without
tiercache. Then the server is killed and a third engine still serves the same
prompts identically (misses, no crash).
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from tests.server.harness import ServerProcess
from tiercache.testing.engine_runner import random_prompts, run_engine

from .conftest import free_port

CHUNK = 128
PROMPTS = random_prompts(3, 400, seed=41)


def spec(model: pathlib.Path, server: str | None) -> dict[str, Any]:
    port = free_port() if server else None
    kv = None
    if server:
        kv = {
            "kv_connector": "TierCacheConnector",
            "kv_connector_module_path": "tiercache.connector.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "chunk_tokens": CHUNK,
                "tiers": [
                    {"name": "cpu", "backend": "cpu", "capacity": "64MiB"},
                    {"name": "server", "backend": "server", "capacity": "1GiB",
                     "options": {"address": server, "data_path": "tcp", "timeout_s": 2}},
                ],
                "metrics": {"port": port},
            },
        }
    return {
        "model_dir": str(model),
        "dtype": "float32",
        "block_size": 32,
        "max_model_len": 1024,
        "kv_transfer_config": kv,
        "tiercache_metrics_url": f"http://127.0.0.1:{port}/metrics" if port else None,
        "rounds": [{"prompts": PROMPTS, "max_tokens": 10, "sequential": True}],
    }


def server_hits(result: dict[str, Any]) -> float:
    samples = result["rounds"][0]["tiercache_metrics"]
    return sum(v for k, v in samples.items() if k.startswith("tiercache_hit_tokens_total") and 'tier="server"' in k)


def tokens(result: dict[str, Any]) -> list[list[int]]:
    return [r["output_token_ids"] for r in result["rounds"][0]["requests"]]


@pytest.fixture(scope="module")
def runs(tiny_model: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("server-tier")
    server = ServerProcess(
        tmp / "srv",
        max_value_bytes=4 << 20,
        tiers=[{"name": "cpu", "backend": "cpu", "capacity": "256MiB"}],
    ).start()
    try:
        out: dict[str, Any] = {"baseline": run_engine(spec(tiny_model, None), timeout_s=400, workdir=tmp / "base")}
        out["writer"] = run_engine(spec(tiny_model, server.address), timeout_s=400, workdir=tmp / "writer")
        out["reader"] = run_engine(spec(tiny_model, server.address), timeout_s=400, workdir=tmp / "reader")
        address = server.address
    finally:
        server.kill()
    out["server_dead"] = run_engine(spec(tiny_model, address), timeout_s=400, workdir=tmp / "dead")
    return out


def test_engines_share_through_the_server_token_exact(runs: dict[str, Any]) -> None:
    for name in ("writer", "reader", "server_dead"):
        assert tokens(runs[name]) == tokens(runs["baseline"]), name


def test_reader_hits_on_the_server(runs: dict[str, Any]) -> None:
    assert server_hits(runs["writer"]) == 0
    assert server_hits(runs["reader"]) >= len(PROMPTS) * 3 * CHUNK
    assert server_hits(runs["server_dead"]) == 0
