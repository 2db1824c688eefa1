"""P/D between engines of different TP sizes (tiercache.pd.heads): real vLLM engines over NIXL.

Tiny random-weight Llama (2 KV heads), float32, producer modes via_host and direct, the two
engines at once:

* ``1to2``: a TP=1 producer (core 0) hands prompts off to a TP=2 consumer (both workers
  on core 1); consumer rank r READs head r's sub-run of every page of producer rank 0,
  which ends a hold only once both consumer ranks said they read it;
* ``2to1``: a TP=2 producer (both workers on core 0) to a TP=1 consumer (core 1), which
  READs head r of its pages from producer rank r.

Each: the decode engine's tokens equal a single engine's of the consumer's TP size
without tiercache; every prompt token but the last comes from the producer (tier
``peer``), vLLM computes exactly one token per prompt; the producer counts every
hand-off read and holds nothing afterwards.

Negative control (``1to2``, via_host): a second TP=2 consumer with the test hook
``TIERCACHE_TEST_PD_WRONG_HEAD=1`` READs the other head's sub-run (tags pass, bytes
are wrong): its tokens differ from the baseline's.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from tiercache.testing.engine_runner import EngineRun, random_prompts

from .conftest import free_port
from .test_pd import (
    consumer_kv,
    decode_round,
    decoded,
    engine_spec,
    handoff_rounds,
    loaded_tokens,
    producer_kv,
    round_after_the_reads,
    sample,
    tokens,
    vllm_counter,
)

A = random_prompts(1, 400, seed=61) + random_prompts(1, 384, seed=62)  # a 16-token tail; whole chunks
WRONG = random_prompts(2, 400, seed=63)  # the negative control's prompts
HANDOFF_TIMEOUT_S = 240.0  # the negative control's consumer starts after the first one finished
CPU = {("producer", 1): "0", ("producer", 2): "0|0", ("consumer", 1): "1", ("consumer", 2): "1|1"}


def tp_spec(model: pathlib.Path, tp: int) -> dict[str, Any]:
    return {"llm_kwargs": {"tensor_parallel_size": tp}, "model_dir": str(model)}


def env(side: str, tp: int, **extra: str) -> dict[str, str]:
    return {"VLLM_CPU_OMP_THREADS_BIND": CPU[(side, tp)], **extra}


@pytest.fixture(scope="module")
def baselines(tiny_model: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """A single engine of each TP size, no connector: A and WRONG's prompts."""
    tmp = tmp_path_factory.mktemp("pd-hetero-baseline")
    rounds = [{"prompts": A + WRONG, "max_tokens": 10}]
    engines = {tp: EngineRun({**engine_spec(None, rounds, None, env("producer" if tp == 1 else "consumer", tp)),
                              **tp_spec(tiny_model, tp)}, tmp / f"tp{tp}") for tp in (1, 2)}
    try:
        return {tp: run.result(timeout_s=500) for tp, run in engines.items()}
    finally:
        for run in engines.values():
            run.kill()


@pytest.fixture(scope="module", params=["1to2-via_host", "2to1-via_host", "1to2-direct", "2to1-direct"])
def runs(request: pytest.FixtureRequest, tiny_model: pathlib.Path,
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    direction, mode = request.param.split("-")
    ptp, ctp = (1, 2) if direction == "1to2" else (2, 1)
    tmp = tmp_path_factory.mktemp(f"pd-hetero-{request.param}")
    side, p_metrics, c_metrics, w_metrics = free_port(), free_port(), free_port(), free_port()
    control = request.param == "1to2-via_host"
    prompts = A + (WRONG if control else [])
    params_a, params_w = tmp / "params_a.json", tmp / "params_w.json"
    pkv = producer_kv(side, p_metrics, mode)
    pkv["kv_connector_extra_config"]["pd"]["handoff_timeout_s"] = HANDOFF_TIMEOUT_S
    producer_rounds = handoff_rounds(prompts)
    producer = EngineRun({**engine_spec(pkv, producer_rounds, p_metrics, env("producer", ptp)),
                          **tp_spec(tiny_model, ptp)}, tmp / "producer")
    consumer = EngineRun({**engine_spec(consumer_kv(c_metrics), [decode_round(A, params_a, "A")], c_metrics,
                                        env("consumer", ctp)), **tp_spec(tiny_model, ctp)}, tmp / "consumer")
    out: dict[str, Any] = {"ptp": ptp, "ctp": ctp, "control": control, "mode": mode}
    wrong = None
    try:
        producer.wait_for("heard", timeout_s=500)
        params = [r["kv_transfer_params"] for r in producer.partial("heard")["rounds"][0]["requests"]]
        params_a.write_text(json.dumps(params[:len(A)]))
        params_w.write_text(json.dumps(params[len(A):]))
        out["consumer"] = decoded(consumer, "A", timeout_s=500)
        if control:  # the same hand-off path, reading the other head's sub-run
            wrong = EngineRun({**engine_spec(consumer_kv(w_metrics), [decode_round(WRONG, params_w, "W")], w_metrics,
                                             env("consumer", ctp, TIERCACHE_TEST_PD_WRONG_HEAD="1")),
                               **tp_spec(tiny_model, ctp)}, tmp / "wrong")
            out["wrong"] = decoded(wrong, "W", timeout_s=500)
        out["producer_r1"] = round_after_the_reads(producer)
    finally:
        producer.kill()
        consumer.kill()
        if wrong is not None:
            wrong.kill()
    out["consumer_log"] = (tmp / "consumer" / "engine.log").read_text(errors="replace")
    return out


def test_decode_engine_of_another_tp_size_is_token_exact_and_computes_one_token(
        runs: dict[str, Any], baselines: dict[int, dict[str, Any]]) -> None:
    consumer = runs["consumer"]
    assert tokens(consumer, 0) == tokens(baselines[runs["ctp"]], 0)[:len(A)], runs["consumer_log"][-3000:]
    r0 = consumer["rounds"][0]
    assert sample(r0, "tiercache_hit_tokens_total", 'tier="peer"') == sum(loaded_tokens(p) for p in A)
    assert vllm_counter(r0, "prompt_tokens_by_source", "local_compute") == len(A)


def test_producer_hears_every_reader_and_lets_go(runs: dict[str, Any]) -> None:
    r1 = runs["producer_r1"]
    handed = len(A) + (len(WRONG) if runs["control"] else 0)
    assert sample(r1, "tiercache_pd_handoffs_total", 'outcome="offered"') == handed
    assert sample(r1, "tiercache_pd_handoffs_total", 'outcome="read"') == handed
    assert sample(r1, "tiercache_pd_handoffs_total", 'outcome="expired"') == 0
    assert sample(r1, "tiercache_pd_held_chunks") == 0
    # mode direct: every producer rank cleared its blocks' tags, so they were unpinned
    usage = [float(v) for k, v in r1["metrics"].items() if "kv_cache_usage" in k]
    assert usage and max(usage) < 0.01, r1["metrics"]  # TINY's own block at most


def test_negative_control_wrong_head_changes_the_tokens(runs: dict[str, Any],
                                                        baselines: dict[int, dict[str, Any]]) -> None:
    if not runs["control"]:
        pytest.skip("one negative control (1to2, via_host) is enough")
    wrong = runs["wrong"]
    r0 = wrong["rounds"][0]
    # the READs themselves succeeded (tags checked): the bytes were another head's
    assert sample(r0, "tiercache_hit_tokens_total", 'tier="peer"') == sum(loaded_tokens(p) for p in WRONG)
    assert tokens(wrong, 0) != tokens(baselines[runs["ctp"]], 0)[len(A):]
