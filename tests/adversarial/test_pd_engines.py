"""P/D security on real vLLM engines: a consumer given an untrusted producer recomputes, tokens identical.

Engines (tiny random-weight Llama, float32, via tiercache.testing.engine_runner),
all with the side channel's secret from the environment (``TIERCACHE_PD__SECRET``):

* ``baseline``: no connector, prompts A;
* ``producer`` (via_host): prefills A and hands them off;
* ``untrusted`` consumer: its ``pd.trusted_producers`` names another port, so it
  refuses every hand-off before anything connects, computes A itself (tokens
  equal the baseline's, no peer hit, one ``untrusted`` per hand-off);
* ``trusted`` consumer (the control): lists the producer and decodes A from the
  transfer (mutual authentication, page hashes checked, read notices with their
  release tokens: the producer counts every hand-off read).

Neither engine's log shows the secret.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from tests.e2e.conftest import models_root, tiercache_kv_config, tiny_model
from tests.e2e.test_pd import (
    PRODUCER_CPU,
    TINY,
    engine_spec,
    loaded_tokens,
    sample,
    tokens,
    vllm_counter,
)
from tiercache.testing.engine_runner import EngineRun, random_prompts, run_engine
from tiercache.testing.ports import free_port

pytestmark = pytest.mark.e2e

CHUNK = 32
A = random_prompts(2, 200, seed=61)
SECRET = "e2e-side-channel-secret-4f1c9b"
ENV = {"TIERCACHE_PD__SECRET": SECRET}
CONSUMER_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "1", **ENV}


def consumer_kv(metrics_port: int, trusted: list[str]) -> dict[str, Any]:
    return tiercache_kv_config(CHUNK, [], metrics_port=metrics_port, kv_role="kv_consumer",
                               pd={"read_timeout_s": 5.0, "trusted_producers": trusted})


def test_an_untrusted_producer_is_not_read_and_the_consumer_recomputes_identically(
        tiny_model: pathlib.Path, tmp_path: pathlib.Path) -> None:
    model = str(tiny_model)
    baseline = run_engine({**engine_spec(None, [{"prompts": A, "max_tokens": 10}], None), "model_dir": model},
                          timeout_s=400, workdir=tmp_path / "baseline")
    side, p_metrics, u_metrics, t_metrics = free_port(), free_port(), free_port(), free_port()
    params = tmp_path / "params.json"
    pkv = tiercache_kv_config(CHUNK, [], metrics_port=p_metrics, kv_role="kv_producer",
                              pd={"port": side, "handoff_timeout_s": 300.0})
    producer = EngineRun({**engine_spec(pkv, [
        {"prompts": A, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        {"prompts": TINY, "max_tokens": 1, "barrier": "heard"},  # a step after the reads: it hears them
        {"prompts": TINY, "max_tokens": 1, "barrier": "end"},
    ], p_metrics, {**PRODUCER_CPU, **ENV}), "model_dir": model}, tmp_path / "producer")
    decode = [{"prompts": A, "max_tokens": 10, "kv_transfer_params_file": str(params)}]
    try:
        producer.wait_for("heard", timeout_s=400)
        params.write_text(json.dumps([r["kv_transfer_params"] for r in
                                      producer.partial("heard")["rounds"][0]["requests"]]))
        untrusted = run_engine({**engine_spec(consumer_kv(u_metrics, [f"127.0.0.1:{side + 7}"]), decode, u_metrics,
                                              CONSUMER_ENV), "model_dir": model},
                               timeout_s=400, workdir=tmp_path / "untrusted")
        trusted = run_engine({**engine_spec(consumer_kv(t_metrics, [f"127.0.0.1:{side}"]), decode, t_metrics,
                                            CONSUMER_ENV), "model_dir": model},
                             timeout_s=400, workdir=tmp_path / "trusted")
        producer.release("heard")
        producer.wait_for("end", timeout_s=120)
        after = producer.partial("end")["rounds"][1]
    finally:
        producer.kill()

    u0, t0 = untrusted["rounds"][0], trusted["rounds"][0]
    assert tokens(untrusted, 0) == tokens(baseline, 0)
    assert sample(u0, "tiercache_pd_handoffs_total", 'outcome="untrusted"') == len(A)
    assert sample(u0, "tiercache_hit_tokens_total", 'tier="peer"') == 0
    assert vllm_counter(u0, "prompt_tokens_by_source", "local_compute") == sum(len(p) for p in A)
    # control: the trusted consumer decodes from the transfer, and its notices release the hand-offs
    assert tokens(trusted, 0) == tokens(baseline, 0)
    assert sample(t0, "tiercache_hit_tokens_total", 'tier="peer"') == sum(loaded_tokens(p) for p in A)
    assert vllm_counter(t0, "prompt_tokens_by_source", "local_compute") == len(A)
    assert sample(after, "tiercache_pd_handoffs_total", 'outcome="read"') == len(A)
    for name in ("producer", "untrusted", "trusted"):
        log = (tmp_path / name / "engine.log").read_text(errors="replace")
        assert SECRET not in log
    untrusted_log = (tmp_path / "untrusted" / "engine.log").read_text(errors="replace")
    assert "is not in pd.trusted_producers" in untrusted_log
