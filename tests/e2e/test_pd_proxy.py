"""The documented P/D example, for real: two ``vllm serve`` processes and examples/pd_proxy.py.

A prefill server (kv_producer, configs/pd-prefill.yaml's settings) and a
decode server (kv_consumer, configs/pd-decode.yaml's settings), each its own
OpenAI API server process on loopback, pinned to its own core, with the
random-weight test model; the proxy in front. A completion through the proxy
(streamed and not) returns the same greedy tokens as the prefill server
alone, and the decode server's metrics show the prompt came from the producer
(peer-tier hits) while the producer counts the hand-off as read.
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

from tiercache.testing.engine_runner import random_prompts

from .conftest import free_port

REPO = pathlib.Path(__file__).resolve().parents[2]
PROMPT = random_prompts(1, 300, seed=61)[0]
CHUNK = 32
START_TIMEOUT_S = 300


def tiercache_config(role: str, side_port: int, metrics_port: int) -> dict[str, Any]:
    config = REPO / "configs" / ("pd-prefill.yaml" if role == "kv_producer" else "pd-decode.yaml")
    extra: dict[str, Any] = {"config_file": str(config), "metrics": {"port": metrics_port},
                             "tiers": [{"name": "cpu", "backend": "cpu", "capacity": "64MiB"}]}
    extra["pd"] = {"port": side_port} if role == "kv_producer" else {"read_timeout_s": 10}
    return {"kv_connector": "TierCacheConnector", "kv_connector_module_path": "tiercache.connector.vllm",
            "kv_role": role, "kv_connector_extra_config": extra}


def start_server(model: pathlib.Path, port: int, kv: dict[str, Any], cpu: str, log: pathlib.Path) -> subprocess.Popen:
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": cpu, "VLLM_CPU_KVCACHE_SPACE": "1",
           "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", "tiny", "--skip-tokenizer-init", "--dtype", "float32",
           "--block-size", "32", "--max-model-len", "1024", "--enforce-eager", "--host", "127.0.0.1",
           "--port", str(port), "--kv-transfer-config", json.dumps(kv)]
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_healthy(url: str, proc: subprocess.Popen, log: pathlib.Path, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{url} exited {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"{url} not healthy after {timeout_s}s:\n{log.read_text(errors='replace')[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, 9)
    proc.wait(timeout=30)


def post(url: str, body: dict[str, Any]) -> bytes:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return resp.read()


def completion(base: str, max_tokens: int = 8, stream: bool = False) -> list[int]:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, "stream": stream}
    raw = post(base + "/v1/completions", body)
    if not stream:
        return list(json.loads(raw)["choices"][0]["token_ids"])
    ids: list[int] = []
    for line in raw.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            ids += json.loads(line[6:])["choices"][0].get("token_ids") or []
    return ids


def scrape(port: int, name: str, label: str = "") -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and label in line)


@pytest.fixture(scope="module")
def servers(tiny_model: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("pd_proxy")
    ports = {k: free_port() for k in ("prefill", "decode", "proxy", "side", "p_metrics", "d_metrics")}
    prefill = start_server(tiny_model, ports["prefill"], tiercache_config("kv_producer", ports["side"],
                           ports["p_metrics"]), "0", tmp / "prefill.log")
    decode = start_server(tiny_model, ports["decode"], tiercache_config("kv_consumer", 0, ports["d_metrics"]),
                          "1", tmp / "decode.log")
    procs = [prefill, decode]
    try:
        wait_healthy(f"http://127.0.0.1:{ports['prefill']}", prefill, tmp / "prefill.log")
        wait_healthy(f"http://127.0.0.1:{ports['decode']}", decode, tmp / "decode.log")
        proxy = subprocess.Popen([sys.executable, str(REPO / "examples" / "pd_proxy.py"), "--prefill",
                                  f"http://127.0.0.1:{ports['prefill']}", "--decode",
                                  f"http://127.0.0.1:{ports['decode']}", "--port", str(ports["proxy"])],
                                 stdout=open(tmp / "proxy.log", "wb"), stderr=subprocess.STDOUT,
                                 start_new_session=True)
        procs.append(proxy)
        wait_healthy(f"http://127.0.0.1:{ports['proxy']}", proxy, tmp / "proxy.log", 30)  # /health: decode's
        yield {"ports": ports, "tmp": tmp}
    finally:
        for proc in procs:
            stop(proc)


def test_proxy_completion_equals_a_single_engine_and_skips_the_prompt(servers: dict[str, Any]) -> None:
    ports = servers["ports"]
    alone = completion(f"http://127.0.0.1:{ports['prefill']}")  # one engine, no hand-off
    via_proxy = completion(f"http://127.0.0.1:{ports['proxy']}")
    assert len(alone) == 8 and via_proxy == alone
    # 9 whole chunks and the 12-token tail: all but the last token come from the producer
    assert scrape(ports["d_metrics"], "tiercache_hit_tokens_total", 'tier="peer"') == len(PROMPT) - 1
    assert scrape(ports["d_metrics"], "tiercache_failed_chunks_total") == 0
    # An idle producer does not step (the READ needed nothing from it); it hears of the read,
    # and releases the hand-off, at its next step.
    deadline = time.monotonic() + 10
    while scrape(ports["p_metrics"], "tiercache_pd_handoffs_total", 'outcome="read"') < 1:
        assert time.monotonic() < deadline, "the producer never heard that its hand-off was read"
        completion(f"http://127.0.0.1:{ports['prefill']}", max_tokens=1)
        time.sleep(0.2)
    assert scrape(ports["p_metrics"], "tiercache_pd_held_chunks") == 0


def test_proxy_streams_the_decode_answer(servers: dict[str, Any]) -> None:
    ports = servers["ports"]
    alone = completion(f"http://127.0.0.1:{ports['prefill']}", max_tokens=6)
    assert completion(f"http://127.0.0.1:{ports['proxy']}", max_tokens=6, stream=True) == alone
