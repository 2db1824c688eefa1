"""Prefill/decode disaggregation on real vLLM engines: a producer and consumers over NIXL.

Every test runs for both producer modes: ``via_host`` (the prompt's chunks go
through the producer's host tier) and ``direct`` (the consumer reads the
producer's KV blocks, which stay allocated, pinned by tiercache, until the hand-off ends).

Engines (tiny random-weight Llama, float32), separate processes on loopback:

* ``baseline``: one engine, no connector, prompts A then B (10 tokens each);
* ``producer`` (kv_producer): prefills A and B (max_tokens 1, kv_transfer_params
  ``{"do_remote_decode": true}``, as vLLM's P/D proxies send) and returns the
  hand-off parameters; it stays up while the consumer reads;
* ``consumer`` (kv_consumer, async loads), running at the same time: round 0
  decodes all of A at once (several hand-offs in flight) with the producer's
  parameters: tokens equal the baseline's and its prompt tokens come from the
  transfer: the chunks and the partial last chunk (the prompt's tail,
  connector/prompt_tail.py) of three prompts, the whole chunks of the fourth;
  vLLM's own local-compute count is exactly one token per prompt.
  Nobody reads B: after ``handoff_timeout_s`` the producer's next step expires
  those hand-offs and their chunks are released (held gauge back to 0; in mode
  direct the blocks go back to vLLM: its KV-cache usage returns to 0). Then the
  producer is SIGKILLed, and the consumer's round 1 decodes B with the dead
  producer's parameters: it recomputes, tokens equal, within the read timeout;
* ``mismatched`` (kv_consumer with another chunk size; via_host only, the check
  is the same in both modes): refuses A's hand-offs with an error naming the
  differing fields, and recomputes identically.

The negative control (a consumer that did NOT recompute could not produce the
baseline's tokens) is the random-weight model itself (tests/e2e/test_harness_selfcheck.py
shows zeroed KV changes the output); here the local-compute count proves the
tokens came from the transferred KV.
"""

from __future__ import annotations

import json
import pathlib
import time
from typing import Any

import pytest

from tiercache.testing.engine_runner import EngineRun, random_prompts, run_engine

from .conftest import free_port, tiercache_kv_config

CHUNK = 32  # one engine block
PROMPT_LEN = 400  # 12 full blocks + a 16-token tail, handed off too: the decode engine computes the last token only
WHOLE_LEN = 384  # 12 full blocks: all 12 load, the decode engine computes the last token only
A = random_prompts(3, PROMPT_LEN, seed=51) + random_prompts(1, WHOLE_LEN, seed=54)
B = random_prompts(2, PROMPT_LEN, seed=52)
TINY = random_prompts(1, 40, seed=53)
HANDOFF_TIMEOUT_S = 12.0
READ_TIMEOUT_S = 3.0


def loaded_tokens(prompt: list[int]) -> int:
    """What the decode engine loads of a prompt: all of it (chunks and tail) but the last token, vLLM computes it."""
    return len(prompt) - 1


def loaded_chunks(prompts: list[list[int]]) -> int:
    return sum(-(-loaded_tokens(p) // CHUNK) for p in prompts)


# The two engines run at once: each on its own core (vLLM pins a CPU worker process, all its
# threads included, to its OpenMP cores; two workers spinning on one core starve each other's
# hand-off service for seconds, see docs/pd.md).
PRODUCER_CPU = {"VLLM_CPU_OMP_THREADS_BIND": "0"}
CONSUMER_CPU = {"VLLM_CPU_OMP_THREADS_BIND": "1"}


PD_TEST_BLOCKS = 2048  # every P/D test engine's KV cache, in blocks


def engine_spec(kv: dict[str, Any] | None, rounds: list[dict[str, Any]], metrics_port: int | None,
                env: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "env": env or {},
        "model_dir": "",  # filled in by the fixture
        "dtype": "float32",
        "block_size": 32,
        "max_model_len": 1024,
        # a P/D engine registers (and prefaults) its whole KV cache with NIXL: 1 GiB took ~3.7 s
        # per engine here; these tests hold a few hundred blocks at most
        "num_gpu_blocks_override": PD_TEST_BLOCKS,
        "kv_transfer_config": kv,
        "tiercache_metrics_url": f"http://127.0.0.1:{metrics_port}/metrics" if metrics_port else None,
        "rounds": rounds,
        # P/D engines keep vLLM's usual processes: kv_transfer_params cross the front-end /
        # engine-core boundary (serialized) as in a deployment; a baseline runs in one process
        **({"in_process": False} if kv else {}),
    }


def producer_kv(side_port: int, metrics_port: int, mode: str) -> dict[str, Any]:
    return tiercache_kv_config(CHUNK, [], metrics_port=metrics_port, kv_role="kv_producer",
                               pd={"port": side_port, "handoff_timeout_s": HANDOFF_TIMEOUT_S, "mode": mode})


def consumer_kv(metrics_port: int, chunk: int = CHUNK) -> dict[str, Any]:
    return tiercache_kv_config(chunk, [], metrics_port=metrics_port, kv_role="kv_consumer",
                               load_mode="async", pd={"read_timeout_s": READ_TIMEOUT_S})


def decode_round(prompts: list[list[int]], params_file: pathlib.Path, barrier: str) -> dict[str, Any]:
    return {"prompts": prompts, "max_tokens": 10, "barrier": barrier,
            "kv_transfer_params_file": str(params_file)}


def tokens(result: dict[str, Any], rnd: int) -> list[list[int]]:
    return [r["output_token_ids"] for r in result["rounds"][rnd]["requests"]]


def sample(rnd: dict[str, Any], prefix: str, *label_parts: str) -> float:
    return sum(v for k, v in rnd["tiercache_metrics"].items()
               if k.startswith(prefix) and all(p in k for p in label_parts))


def vllm_counter(rnd: dict[str, Any], name_part: str, label_part: str) -> float:
    return sum(float(v) for k, v in rnd["metrics"].items()
               if name_part in k and label_part in k and isinstance(v, (int, float)))


@pytest.fixture(scope="module")
def baseline(tiny_model: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("pd-baseline")
    baseline_rounds = [{"prompts": A, "max_tokens": 10}, {"prompts": B, "max_tokens": 10}]
    return run_engine({**engine_spec(None, baseline_rounds, None), "model_dir": str(tiny_model)},
                      timeout_s=400, workdir=tmp / "baseline")


@pytest.fixture(scope="module", params=["via_host", "direct"])
def runs(request: pytest.FixtureRequest, tiny_model: pathlib.Path, baseline: dict[str, Any],
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    mode = request.param
    tmp = tmp_path_factory.mktemp(f"pd-{mode}")
    model = str(tiny_model)
    side, p_metrics, c_metrics, m_metrics = free_port(), free_port(), free_port(), free_port()
    params_a, params_b = tmp / "params_a.json", tmp / "params_b.json"
    prefill = {"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    producer_rounds = [
        {"prompts": A + B, **prefill},
        # An idle producer hears of reads (and expiries) at its next step: one after A's reads,
        {"prompts": TINY, "max_tokens": 1, "barrier": "heard"},
        {"prompts": TINY, "max_tokens": 1, "barrier": "expire"},  # one after the timeout
        {"prompts": TINY, "max_tokens": 1, "barrier": "end"},  # killed while waiting here
    ]
    consumer_rounds = [decode_round(A, params_a, "A"), decode_round(B, params_b, "B")]
    producer = EngineRun({**engine_spec(producer_kv(side, p_metrics, mode), producer_rounds, p_metrics, PRODUCER_CPU),
                          "model_dir": model}, tmp / "producer")
    consumer = EngineRun({**engine_spec(consumer_kv(c_metrics), consumer_rounds, c_metrics, CONSUMER_CPU),
                          "model_dir": model}, tmp / "consumer")
    out: dict[str, Any] = {"mode": mode, "baseline": baseline}
    try:
        producer.wait_for("heard", timeout_s=400)
        prefilled_at = time.monotonic()
        handed = producer.partial("heard")["rounds"][0]
        params = [r["kv_transfer_params"] for r in handed["requests"]]
        out["producer_r0"] = handed
        params_a.write_text(json.dumps(params[: len(A)]))
        params_b.write_text(json.dumps(params[len(A):]))
        consumer.wait_for("A", timeout_s=400)
        consumer.release("A")
        consumer.wait_for("B", timeout_s=400)
        producer.release("heard")
        producer.wait_for("expire", timeout_s=120)
        time.sleep(max(0.0, prefilled_at + HANDOFF_TIMEOUT_S + 1 - time.monotonic()))
        producer.release("expire")
        producer.wait_for("end", timeout_s=120)
        out["producer_r1"] = producer.partial("end")["rounds"][2]
        producer.kill()  # after prefill, before anyone reads B
        consumer.release("B")
        out["consumer"] = consumer.result(timeout_s=400)
    finally:
        producer.kill()
        consumer.kill()
    out["consumer_log"] = (tmp / "consumer" / "engine.log").read_text(errors="replace")
    if mode != "via_host":
        return out
    mismatched = {**engine_spec(consumer_kv(m_metrics, chunk=2 * CHUNK),
                                [{"prompts": A, "max_tokens": 10, "kv_transfer_params_file": str(params_a)}],
                                m_metrics), "model_dir": model}
    out["mismatched"] = run_engine(mismatched, timeout_s=400, workdir=tmp / "mismatched")
    out["mismatched_log"] = (tmp / "mismatched" / "engine.log").read_text(errors="replace")
    return out


def test_producer_returns_nixl_shaped_params(runs: dict[str, Any]) -> None:
    for req in runs["producer_r0"]["requests"]:
        params = req["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        for field in ("remote_engine_id", "remote_host", "remote_port", "remote_block_ids", "remote_request_id"):
            assert field in params
    for req, prompt in zip(runs["producer_r0"]["requests"], A + B):
        params = req["kv_transfer_params"]
        tail = len(prompt) % CHUNK
        assert params["tiercache"]["tail_tokens"] == tail
        assert len(params["tiercache"]["chunk_keys"]) == len(prompt) // CHUNK + (1 if tail else 0)
        assert params["tiercache"]["mode"] == runs["mode"]
        # via_host: one host slot per chunk; direct: the chunk's blocks (one block per chunk here)
        assert len(params["remote_block_ids"]) == len(params["tiercache"]["chunk_keys"])


def test_consumer_decodes_token_exact_without_recomputing_the_prompt(runs: dict[str, Any]) -> None:
    consumer, baseline = runs["consumer"], runs["baseline"]
    assert tokens(consumer, 0) == tokens(baseline, 0)
    r0 = consumer["rounds"][0]
    tier = "peer"  # both modes: READ straight into the blocks
    assert sample(r0, "tiercache_hit_tokens_total", f'tier="{tier}"') == sum(loaded_tokens(p) for p in A)
    local = vllm_counter(r0, "prompt_tokens_by_source", "local_compute")
    assert local == len(A)  # the last token of each prompt: nothing else recomputed, tails included


def test_read_handoffs_are_released_and_unread_ones_expire(runs: dict[str, Any]) -> None:
    r1 = runs["producer_r1"]
    assert sample(r1, "tiercache_pd_handoffs_total", 'outcome="offered"') == len(A) + len(B)
    assert sample(r1, "tiercache_pd_handoffs_total", 'outcome="read"') == len(A)
    assert sample(r1, "tiercache_pd_handoffs_total", 'outcome="expired"') == len(B)
    assert sample(r1, "tiercache_pd_held_chunks") == 0
    # mode direct: the hand-offs' blocks stayed allocated (pinned) until they ended; now they are free again
    usage = [float(v) for k, v in r1["metrics"].items() if "kv_cache_usage" in k]
    assert usage and max(usage) == 0.0, r1["metrics"]
    held = [float(v) for k, v in runs["producer_r0"]["metrics"].items() if "kv_cache_usage" in k]
    if runs["mode"] == "direct":  # right after the prefills, nothing read yet: A's and B's blocks
        assert held and max(held) > 0.0, runs["producer_r0"]["metrics"]
    else:  # via_host: the chunks wait in the host tier, the blocks went back to vLLM at once
        assert held and max(held) == 0.0, runs["producer_r0"]["metrics"]


def test_dead_producer_means_recompute_with_identical_output(runs: dict[str, Any]) -> None:
    consumer, baseline = runs["consumer"], runs["baseline"]
    assert tokens(consumer, 1) == tokens(baseline, 1)
    r0, r1 = consumer["rounds"][0], consumer["rounds"][1]
    # the consumer planned B's loads from the dead producer; every one failed and was recomputed
    failed = sample(r1, "tiercache_failed_chunks_total", 'op="load"') - \
        sample(r0, "tiercache_failed_chunks_total", 'op="load"')
    assert failed == loaded_chunks(B)
    assert consumer["rounds"][1]["wall_s"] < READ_TIMEOUT_S * 4 + 20


def test_mismatched_consumer_is_refused_naming_the_difference(runs: dict[str, Any]) -> None:
    if "mismatched" not in runs:
        pytest.skip("the fingerprint check is the same in mode direct; run once (via_host)")
    mismatched, baseline = runs["mismatched"], runs["baseline"]
    assert tokens(mismatched, 0) == tokens(baseline, 0)
    assert sample(mismatched["rounds"][0], "tiercache_pd_handoffs_total", 'outcome="refused"') == len(A)
    log = runs["mismatched_log"]
    assert "incompatible peer" in log and "chunk_tokens: ours 64, peer 32" in log


# ------------------------------------------------------------------ tensor parallel
# Both engines with TP=2: each consumer rank READs its shard from the producer rank of the
# same number (side channel on port + rank) and notifies that rank; a hold ends, and mode
# direct's blocks are unpinned, only once both ranks heard. Each engine's two workers share
# one core ("0|0" / "1|1"): sharing cores between the engines stalled the producer's
# side-channel threads for seconds (docs/pd.md).
TP2 = {"producer": {"VLLM_CPU_OMP_THREADS_BIND": "0|0"}, "consumer": {"VLLM_CPU_OMP_THREADS_BIND": "1|1"}}


def handoff_rounds(prompts: list[list[int]]) -> list[dict[str, Any]]:
    """A producer's rounds: hand ``prompts`` off; at barrier ``heard``, a step after its
    consumers' reads (it hears them there); then wait at ``end``."""
    return [
        {"prompts": prompts, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        {"prompts": TINY, "max_tokens": 1, "barrier": "heard"},
        {"prompts": TINY, "max_tokens": 1, "barrier": "end"},
    ]


def decoded(consumer: EngineRun, barrier: str, timeout_s: float) -> dict[str, Any]:
    """Let a consumer waiting at ``barrier`` decode; its result."""
    consumer.wait_for(barrier, timeout_s=timeout_s)
    consumer.release(barrier)
    return consumer.result(timeout_s=timeout_s)


def round_after_the_reads(producer: EngineRun) -> dict[str, Any]:
    """A :func:`handoff_rounds` producer's round after its consumers' reads."""
    producer.release("heard")
    producer.wait_for("end", timeout_s=120)
    return producer.partial("end")["rounds"][1]


@pytest.fixture(scope="module", params=["via_host", "direct"])
def tp2_runs(request: pytest.FixtureRequest, tiny_model: pathlib.Path,
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    mode = request.param
    tmp = tmp_path_factory.mktemp(f"pd-tp2-{mode}")
    side, p_metrics, c_metrics = free_port(), free_port(), free_port()
    params_a = tmp / "params_a.json"
    tp2 = {"llm_kwargs": {"tensor_parallel_size": 2}, "model_dir": str(tiny_model)}
    producer_rounds = handoff_rounds(A)
    pkv = producer_kv(side, p_metrics, mode)
    # no expiry tested here: the producer is released only after the consumer's process exited
    # (a TP=2 engine's workers took 5 s to exit here), which crossed a 12 s deadline when loaded
    pkv["kv_connector_extra_config"]["pd"]["handoff_timeout_s"] = 120.0
    producer = EngineRun({**engine_spec(pkv, producer_rounds, p_metrics, TP2["producer"]), **tp2},
                         tmp / "producer")
    consumer = EngineRun({**engine_spec(consumer_kv(c_metrics), [decode_round(A, params_a, "A")], c_metrics,
                                        TP2["consumer"]), **tp2}, tmp / "consumer")
    out: dict[str, Any] = {"mode": mode}
    try:
        producer.wait_for("heard", timeout_s=400)
        params_a.write_text(json.dumps([r["kv_transfer_params"] for r in
                                        producer.partial("heard")["rounds"][0]["requests"]]))
        out["consumer"] = decoded(consumer, "A", timeout_s=400)
        out["producer_r1"] = round_after_the_reads(producer)
    finally:
        producer.kill()
        consumer.kill()
    return out


def test_tp2_consumer_decodes_token_exact_from_both_ranks_and_the_producer_lets_go(
        tp2_runs: dict[str, Any], baseline: dict[str, Any]) -> None:
    consumer, r1 = tp2_runs["consumer"], tp2_runs["producer_r1"]
    assert tokens(consumer, 0) == tokens(baseline, 0)
    r0 = consumer["rounds"][0]
    assert sample(r0, "tiercache_hit_tokens_total", 'tier="peer"') == sum(loaded_tokens(p) for p in A)
    local = vllm_counter(r0, "prompt_tokens_by_source", "local_compute")
    assert local == len(A)
    # both ranks' notices arrived: every hand-off read, nothing held, every block vLLM's again
    assert sample(r1, "tiercache_pd_handoffs_total", 'outcome="read"') == len(A)
    assert sample(r1, "tiercache_pd_handoffs_total", 'outcome="expired"') == 0
    assert sample(r1, "tiercache_pd_held_chunks") == 0
    usage = [float(v) for k, v in r1["metrics"].items() if "kv_cache_usage" in k]
    assert usage and max(usage) < 0.01, r1["metrics"]  # TINY's own block at most
