"""Self-check of the e2e harness: one real vLLM engine on the tiny random model.

Every connector test compares greedy outputs, which proves something only if
(a) the model's output depends on earlier context (a changed first token
changes the continuation), (b) outputs are reproducible across a prefix-cache
reset, and (c) the engine's own prefix cache reports hits, so num_cached_tokens
is a usable signal. This test checks all three, plus the conversation rounds of
the runner and its ``worker_call`` rounds (which bench/pd.py uses to READ raw
NIXL inside a decode worker), with a single engine start (float32, no
kv_transfer_config).
"""

from __future__ import annotations

import itertools
import pathlib
from typing import Any

import pytest

from tiercache.testing.engine_runner import random_prompts, run_engine
from tiercache.testing.random_llama import make_model_dir

BLOCK = 32
PROMPT_LEN = 3 * BLOCK + 5
MAX_TOKENS = 16
NUM_PAIRS = 4
VOCAB = 1024


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The tiny Llama with context-sensitive random weights, built once per module."""
    return make_model_dir("tiny", tmp_path_factory.mktemp("models"))


def first_token_pairs() -> list[list[int]]:
    """Interleaved prompt pairs [a0, b0, a1, b1, ...] where b differs from a in token 0 only."""
    prompts: list[list[int]] = []
    for a in random_prompts(NUM_PAIRS, PROMPT_LEN, vocab=VOCAB, seed=7):
        b = [3 + (a[0] - 3 + VOCAB // 2) % (VOCAB - 3)] + a[1:]
        prompts += [a, b]
    return prompts


def selfcheck_spec(model_dir: pathlib.Path, prompts: list[list[int]]) -> dict[str, Any]:
    """Rounds: warmup, baseline, rerun after reset, rerun without reset, a short chat."""
    user_turns = random_prompts(2, 8, vocab=VOCAB, seed=11)
    return {
        "model_dir": str(model_dir),
        "dtype": "float32",
        "block_size": BLOCK,
        "max_model_len": 1024,
        "kv_transfer_config": None,
        "in_process": False,  # vLLM's usual processes: the worker_call round checks them
        "env": {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"},  # worker_call sends a function
        "rounds": [
            {"prompts": random_prompts(2, 40, vocab=VOCAB, seed=99), "max_tokens": 4,
             "warmup": True},
            {"prompts": prompts, "max_tokens": MAX_TOKENS, "reset_prefix_cache_before": True},
            {"prompts": prompts, "max_tokens": MAX_TOKENS, "reset_prefix_cache_before": True},
            {"prompts": prompts, "max_tokens": MAX_TOKENS, "reset_prefix_cache_before": False},
            {"conversation": {"first_prompt": random_prompts(1, 2 * BLOCK, seed=5)[0],
                              "turns": 3, "user_tokens_per_turn": user_turns,
                              "max_tokens": 8},
             "reset_prefix_cache_before": True},
            {"worker_call": "tiercache.testing.engine_runner:worker_pid"},
        ],
    }


def outputs(round_result: dict[str, Any]) -> list[list[int]]:
    return [r["output_token_ids"] for r in round_result["requests"]]


def cached(round_result: dict[str, Any]) -> list[int]:
    return [r["num_cached_tokens"] for r in round_result["requests"]]


def check_conversation(conv: dict[str, Any]) -> None:
    """Each turn extends the previous prompt + output and hits the prefix cache."""
    turns = conv["requests"]
    assert conv["kind"] == "conversation" and len(turns) == 3
    assert turns[0]["num_cached_tokens"] == 0
    for prev, cur in itertools.pairwise(turns):
        history = prev["prompt_token_ids"] + prev["output_token_ids"]
        assert cur["prompt_token_ids"][: len(history)] == history
        assert len(cur["prompt_token_ids"]) == len(history) + 8
        assert cur["num_cached_tokens"] >= BLOCK, cached(conv)


@pytest.mark.e2e
@pytest.mark.timeout(420)
def test_harness_selfcheck(tiny_model_dir: pathlib.Path) -> None:
    prompts = first_token_pairs()
    result = run_engine(selfcheck_spec(tiny_model_dir, prompts), timeout_s=360)
    _warmup, base, after_reset, no_reset, conv, call = result["rounds"]
    print(f"\nengine start {result['engine_start_s']:.1f}s, total {result['total_s']:.1f}s")
    for name, rnd in (("base", base), ("after_reset", after_reset), ("no_reset", no_reset)):
        print(f"{name}: wall {rnd['wall_s']:.3f}s cached={cached(rnd)} metrics={rnd['metrics']}")

    base_out = outputs(base)
    assert all(len(o) == MAX_TOKENS for o in base_out)
    # (a) context sensitivity: a changed first token changes the greedy continuation.
    same_pairs = [i for i in range(NUM_PAIRS) if base_out[2 * i] == base_out[2 * i + 1]]
    assert not same_pairs, f"pairs {same_pairs} ignore their first token: {base_out}"
    # (b) reproducible after resetting the engine's prefix cache, with nothing cached.
    assert outputs(after_reset) == base_out
    assert cached(base) == [0] * len(prompts)
    assert cached(after_reset) == [0] * len(prompts)
    # (c) without a reset, the engine's own prefix cache serves the prompts.
    assert all(c > 0 for c in cached(no_reset)), cached(no_reset)
    assert outputs(no_reset) == base_out
    check_conversation(conv)
    # worker_call ran in the worker (one, TP=1), a process of its own, not the runner
    assert call["kind"] == "worker_call" and len(call["results"]) == 1
    assert isinstance(call["results"][0], int) and call["results"][0] != result["runner_pid"]
    # Most test engines run some of vLLM's processes inside the runner (engine_runner
    # ``in_process``: "all" for baselines, "core" with a connector): the same tokens as vLLM's
    # usual processes, and a real difference there would fail every token-exact test rather
    # than pass a negative control.
    for layout in ("all", "core"):
        spec = selfcheck_spec(tiny_model_dir, prompts)
        spec["in_process"] = layout
        spec["rounds"] = [spec["rounds"][1], spec["rounds"][-1]]
        run = run_engine(spec, timeout_s=360)
        assert outputs(run["rounds"][0]) == base_out, layout
        worker = run["rounds"][1]["results"]
        assert (worker == [run["runner_pid"]]) == (layout == "all"), (layout, worker)
