"""tiercache's metrics as an operator sees them: a real Prometheus scraping vLLM's /metrics and the cache server.

One OpenAI API server (``python -m vllm.entrypoints.openai.api_server``, the
random-weight test model) runs tiercache with a host tier in front of a cache
server (``tiercache serve``, its own ``metrics.port``), and no tiercache port
of its own: its metrics reach vLLM's ``/metrics`` through vLLM's connector
stats hook. Debian's ``prometheus`` scrapes both on loopback every second. A
prompt is sent cold; vLLM's prefix cache and tiercache's host tier are reset
(vLLM's dev endpoint), so the repeat hits on the server; vLLM's cache alone
is reset, so the next repeat hits the host tier. Prometheus then shows
tiercache's series with vLLM's labels and the configured ``cache_instance``,
nonzero hits on both tiers, a hit rate in (0, 1), the server's gets, and it
accepts every query of dashboards/tiercache.json.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.server.harness import ServerProcess
from tiercache.testing.dashboard_check import dashboard_queries, for_prometheus
from tiercache.testing.engine_runner import random_prompts
from tiercache.testing.prometheus import PrometheusServer, prometheus_binary, values

from .conftest import free_port

REPO = pathlib.Path(__file__).resolve().parents[2]
PROMPT = random_prompts(1, 200, seed=73)[0]  # 6 whole 32-token chunks and a tail
INSTANCE = "scrape-test"
START_TIMEOUT_S = 300


def kv_config(server: str) -> dict[str, Any]:
    tiers = [{"name": "cpu", "backend": "cpu", "capacity": "64MiB"},
             {"name": "server", "backend": "server", "capacity": "1GiB",
              "options": {"address": server, "data_path": "tcp", "timeout_s": 5}}]
    return {"kv_connector": "TierCacheConnector", "kv_connector_module_path": "tiercache.connector.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"chunk_tokens": 32, "tiers": tiers, "metrics": {"instance": INSTANCE}}}


def start_vllm(model: pathlib.Path, port: int, kv: dict[str, Any], log: pathlib.Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", "tiny", "--skip-tokenizer-init", "--dtype", "float32", "--block-size", "32",
           "--max-model-len", "1024", "--enforce-eager", "--host", "127.0.0.1", "--port", str(port),
           "--kv-transfer-config", json.dumps(kv)]
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def post(url: str, body: dict[str, Any] | None = None) -> Any:
    req = urllib.request.Request(url, json.dumps(body or {}).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read() or b"null")


def wait_healthy(base: str, proc: subprocess.Popen[bytes], log: pathlib.Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"vLLM exited {proc.returncode}:\n{log.read_text(errors='replace')[-4000:]}"
        try:
            with urllib.request.urlopen(base + "/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"vLLM not healthy after {START_TIMEOUT_S}s:\n{log.read_text(errors='replace')[-4000:]}")


def complete(base: str) -> list[int]:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    return list(post(base + "/v1/completions", body)["choices"][0]["token_ids"])


def server_keys(metrics_port: int, op: str = "put") -> float:
    """Keys the cache server has stored (``put``) or served (``get``), from its own /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tiercache_server_keys_total{") and f'op="{op}"' in line and 'status="ok"' in line)


def wait_until_stored(metrics_port: int, timeout_s: float = 60.0) -> None:
    """Until the cold request's chunks are on the server (stores finish after the reply): >= one
    key per whole chunk, and no more arriving for a second."""
    deadline, last = time.monotonic() + timeout_s, -1.0
    while True:
        now = server_keys(metrics_port)
        if now >= len(PROMPT) // 32 and now == last:
            return
        assert time.monotonic() < deadline, f"the server holds {now} keys after {timeout_s}s"
        last = now
        time.sleep(1.0)


def reset(base: str, external: bool) -> None:
    """vLLM's prefix cache (and with ``external`` tiercache's host tier), retried while blocks are pinned."""
    deadline = time.monotonic() + 30
    while not post(f"{base}/reset_prefix_cache?reset_external={'true' if external else 'false'}")["success"]:
        assert time.monotonic() < deadline, "reset_prefix_cache kept failing"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def stack(tiny_model: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if prometheus_binary() is None:
        pytest.skip("prometheus not on PATH (scripts/setup.sh installs Debian's prometheus package)")
    tmp = tmp_path_factory.mktemp("prom_scrape")
    server_metrics, vllm_port = free_port(), free_port()
    server = ServerProcess(tmp / "server", nixl="off", max_value_bytes="256KiB", metrics={"port": server_metrics},
                           tiers=[{"name": "cpu", "backend": "cpu", "capacity": "256MiB"}]).start()
    vllm = start_vllm(tiny_model, vllm_port, kv_config(server.address), tmp / "vllm.log")
    prom = PrometheusServer(tmp / "prometheus", free_port(),
                            {"vllm": f"127.0.0.1:{vllm_port}", "tiercache_server": f"127.0.0.1:{server_metrics}"})
    try:
        prom.start()
        base = f"http://127.0.0.1:{vllm_port}"
        wait_healthy(base, vllm, tmp / "vllm.log")
        cold = complete(base)
        wait_until_stored(server_metrics)  # else the reset below could run before the stores land
        reset(base, external=True)  # the host tier forgets: the repeat asks the server
        assert complete(base) == cold
        # (a host copy still pinned by its copy down, unreported by an idle engine, survived the reset)
        assert server_keys(server_metrics, "get") >= len(PROMPT) // 32, "the repeat did not read the server"
        reset(base, external=False)  # vLLM forgets: the repeat loads from the host tier
        assert complete(base) == cold
        yield {"prom": prom, "log": tmp / "vllm.log"}
    finally:
        prom.stop()
        if vllm.poll() is None:
            os.killpg(vllm.pid, 9)
        vllm.wait(timeout=30)
        server.kill()


def test_engine_hits_on_vllms_metrics_with_vllms_labels(stack: dict[str, Any]) -> None:
    prom: PrometheusServer = stack["prom"]
    sel = f'job="vllm",model_name="tiny",engine="0",cache_instance="{INSTANCE}"'
    hit = len(PROMPT) - 8  # 6 whole chunks; the tail is computed
    for tier in ("server", "cpu"):
        prom.wait_for(f'tiercache_hit_tokens_total{{{sel},tier="{tier}"}}', lambda r: values(r) == [hit])
    # each request asked for all its tokens (vLLM's cache was reset before)
    prom.wait_for(f"tiercache_lookup_tokens_total{{{sel}}}", lambda r: values(r) == [3 * len(PROMPT)])
    rate = prom.query(f"sum(tiercache_hit_tokens_total{{{sel}}}) / sum(tiercache_lookup_tokens_total{{{sel}}})")
    assert values(rate) == [pytest.approx(2 * hit / (3 * len(PROMPT)))]
    assert sum(values(prom.query(f'tiercache_tier_used_bytes{{{sel},tier="cpu"}}'))) > 0
    assert sum(values(prom.query(f'tiercache_transfer_seconds_count{{{sel},path="host_to_device"}}'))) >= 2
    # vLLM's own series sit next to them, on the same target
    assert values(prom.query('vllm:prompt_tokens_total{job="vllm",model_name="tiny"}')) == [3 * len(PROMPT)]


def test_the_cache_server_is_scraped_with_its_gets(stack: dict[str, Any]) -> None:
    prom: PrometheusServer = stack["prom"]
    # the engine's server hit read its 6 chunks
    prom.wait_for('tiercache_server_keys_total{job="tiercache_server",op="get",status="ok"}',
                  lambda r: sum(values(r)) >= 6)
    puts = prom.query('sum(tiercache_server_keys_total{job="tiercache_server",op="put"})')
    assert sum(values(puts)) >= 6  # written through at the cold request


def test_prometheus_accepts_every_dashboard_query(stack: dict[str, Any]) -> None:
    prom: PrometheusServer = stack["prom"]
    # every panel has data (a rate: once two scrapes saw its series) but those of things that did not
    # happen here: P/D, faults, failures, evictions, refusals, lookups told to wait, pinning (no CUDA)
    quiet = ("pd_", "faults", "failed_chunks", "evicted_chunks", "refused", "lookup_waits", "host_pinned")
    deadline = time.monotonic() + 60
    while True:
        # prom.query raises when Prometheus refuses the PromQL
        empty = [e for e in dashboard_queries() if not prom.query(for_prometheus(e)) and not any(q in e for q in quiet)]
        if not empty or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert empty == [], prom.query('{__name__=~"tiercache_.*"}')
