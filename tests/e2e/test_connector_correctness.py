"""tiercache on a real vLLM engine: token-exact greedy output, real hits, and controls.

Four engine processes share one workload and one engine configuration (tiny
random-weight Llama, float32, 32-token blocks, a small engine KV space so the
engine's own cache evicts and requests get preempted, and a small token budget
per step so long prompts are prefilled in chunks):

* ``baseline``: no connector;
* ``tiercache`` (sync loads, the default) and ``tiercache_async`` (async
  loads): TierCacheConnector with a host tier; every round's greedy tokens
  must equal the baseline's, and the rounds built to hit must report cached
  tokens served by tiercache (vLLM's ``num_cached_tokens`` and tiercache's
  own Prometheus hit counter);
* ``corrupt``: the negative control: loads are zeroed on their way back, and
  the output must change (otherwise the comparison could not fail);
* ``fail_loads``: every host-tier load fails; vLLM recomputes, the output is
  still identical, nothing crashes, and the failures are counted.

Rounds: (0) warm-up; (1) prompts sharing a 512-token prefix; (2) the same after
``reset_prefix_cache()`` (hits can only come from tiercache); (3) a 4-turn
conversation with the engine cache reset between turns (turn 2 must hit a chunk
completed by generated tokens); (4) more distinct prompts than the engine's KV
space; (5) the first of them again; (6) many concurrent long generations that
force preemption.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from tiercache.testing.engine_runner import random_prompts, run_engine

from .conftest import free_port

BLOCK = 32
CHUNK = 128
ENGINE_BLOCKS = 64  # 2048 tokens of engine KV: forces eviction and preemption
FIRST_PROMPT = 300
CONV_MAX_TOKENS = 100
HIT_ROUNDS = (2, 5)


def workload() -> list[dict[str, Any]]:
    shared = random_prompts(1, 512, seed=1)[0]
    prefixed = [p for i in range(6) for p in random_prompts(1, 100 + 20 * i, seed=10 + i, shared_prefix=shared)]
    distinct = random_prompts(12, 400, seed=2)
    conv_first = random_prompts(1, FIRST_PROMPT, seed=3)[0]
    return [
        {"prompts": random_prompts(2, 64, seed=99), "max_tokens": 4, "warmup": True},
        {"prompts": prefixed, "max_tokens": 16},
        {"prompts": prefixed, "max_tokens": 16, "reset_prefix_cache_before": True},
        {
            "conversation": {
                "first_prompt": conv_first,
                "turns": 4,
                "user_tokens_per_turn": random_prompts(3, 40, seed=4),
                "max_tokens": CONV_MAX_TOKENS,
                "reset_prefix_cache_between_turns": True,
            },
            "reset_prefix_cache_before": True,
        },
        {"prompts": distinct, "max_tokens": 8},
        {"prompts": distinct[:4], "max_tokens": 8},
        {"prompts": random_prompts(8, 300, seed=5), "max_tokens": 200},
    ]


def engine_spec(model: pathlib.Path, kv: dict[str, Any] | None, port: int | None) -> dict[str, Any]:
    return {
        "model_dir": str(model),
        "dtype": "float32",
        "block_size": BLOCK,
        "max_model_len": 1024,
        "num_gpu_blocks_override": ENGINE_BLOCKS,
        "max_num_batched_tokens": 256,
        "max_num_seqs": 8,
        "kv_transfer_config": kv,
        "tiercache_metrics_url": f"http://127.0.0.1:{port}/metrics" if port else None,
        "rounds": workload(),
        # tiercache engines in vLLM's usual processes here (the layout `vllm serve` runs); other
        # modules run the engine core in the test's runner process (engine_runner in_process)
        **({"in_process": False} if kv else {}),
    }


def tiercache_kv(port: int, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "TierCacheConnector",
        "kv_connector_module_path": "tiercache.connector.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "config_file": str(pathlib.Path(__file__).resolve().parents[2] / "configs" / "cpu.yaml"),
            "chunk_tokens": CHUNK,
            "tiers": [{"name": "cpu", "backend": "cpu", "capacity": "64MiB"}],
            "metrics": {"port": port},
            **extra,
        },
    }


def run(model: pathlib.Path, tmp: pathlib.Path, name: str, **extra: Any) -> dict[str, Any]:
    if name == "baseline":
        return run_engine(engine_spec(model, None, None), timeout_s=420, workdir=tmp / name)
    port = free_port()
    spec = engine_spec(model, tiercache_kv(port, **extra), port)
    return run_engine(spec, timeout_s=420, workdir=tmp / name)


def outputs(result: dict[str, Any]) -> list[list[list[int]]]:
    return [[r["output_token_ids"] for r in rnd["requests"]] for rnd in result["rounds"]]


def cached(result: dict[str, Any], rnd: int) -> list[int]:
    return [r["num_cached_tokens"] for r in result["rounds"][rnd]["requests"]]


def metric_delta(result: dict[str, Any], rnd: int, prefix: str) -> float:
    def total(i: int) -> float:
        samples = result["rounds"][i]["tiercache_metrics"] if i >= 0 else {}
        return sum(v for k, v in samples.items() if k.startswith(prefix) and not k.endswith("_created"))

    return total(rnd) - total(rnd - 1)


@pytest.fixture(scope="module")
def runs(tiny_model: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("correctness")
    return {
        "baseline": run(tiny_model, tmp, "baseline"),
        "tiercache": run(tiny_model, tmp, "tiercache"),
        "tiercache_async": run(tiny_model, tmp, "tiercache_async", load_mode="async"),
        "corrupt": run(tiny_model, tmp, "corrupt", faults={"corrupt_loads": True}),
        "fail_loads": run(tiny_model, tmp, "fail_loads", faults={"fail_loads": True}),
    }


MODES = ("tiercache", "tiercache_async")


@pytest.mark.parametrize("mode", MODES)
def test_output_identical_with_tiercache(runs: dict[str, dict[str, Any]], mode: str) -> None:
    base, tc = outputs(runs["baseline"]), outputs(runs[mode])
    for i, (b, t) in enumerate(zip(base, tc)):
        assert t == b, f"round {i}: greedy tokens differ with tiercache on ({mode})"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rnd", HIT_ROUNDS)
def test_hits_served_by_tiercache(runs: dict[str, dict[str, Any]], rnd: int, mode: str) -> None:
    base, tc = runs["baseline"], runs[mode]
    assert sum(cached(tc, rnd)) > sum(cached(base, rnd)), (cached(tc, rnd), cached(base, rnd))
    assert metric_delta(tc, rnd, "tiercache_hit_tokens_total") > 0
    # After a reset the engine's own cache is empty: every cached token came from tiercache.
    if rnd == 2:
        # (Later prompts of a batch share the first one's prefix even in the baseline.)
        assert cached(base, rnd)[0] == 0
        assert all(c >= 512 for c in cached(tc, rnd)), cached(tc, rnd)


@pytest.mark.parametrize("mode", MODES)
def test_conversation_hits_generated_tokens(runs: dict[str, dict[str, Any]], mode: str) -> None:
    """Turn 2 hits a chunk that was completed while turn 1 was decoding."""
    turns = runs[mode]["rounds"][3]["requests"]
    first_len = turns[0]["prompt_len"]
    assert first_len == FIRST_PROMPT
    decoded_until = FIRST_PROMPT + CONV_MAX_TOKENS - 1  # the last sampled token has no KV
    expected = (decoded_until // CHUNK) * CHUNK
    assert expected > FIRST_PROMPT  # the workload is built so this chunk ends inside decode
    assert turns[1]["num_cached_tokens"] == expected
    # every later turn up to the last one's last full block, mid-chunk too (connector/partial_chunks.py)
    ends = [(t["prompt_len"] + CONV_MAX_TOKENS - 1) // BLOCK * BLOCK for t in turns[:-1]]
    assert [t["num_cached_tokens"] for t in turns[1:]] == ends, ends
    assert any(end % CHUNK for end in ends)  # (one of them is a partial chunk's)


def test_preemption_and_chunked_prefill_happened(runs: dict[str, dict[str, Any]]) -> None:
    metrics = runs["tiercache"]["rounds"][6]["metrics"]
    preemptions = sum(v for k, v in metrics.items() if "num_preemptions" in k and isinstance(v, (int, float)))
    assert preemptions > 0, metrics


def test_negative_control_corrupted_loads_change_output(runs: dict[str, dict[str, Any]]) -> None:
    base, bad = outputs(runs["baseline"]), outputs(runs["corrupt"])
    assert metric_delta(runs["corrupt"], 2, "tiercache_hit_tokens_total") > 0
    changed = [i for i in HIT_ROUNDS if bad[i] != base[i]]
    assert changed, "zeroing loaded KV did not change the output: the comparison cannot fail"


def test_failed_loads_recompute_with_identical_output(runs: dict[str, dict[str, Any]]) -> None:
    base, failed = outputs(runs["baseline"]), outputs(runs["fail_loads"])
    for i, (b, f) in enumerate(zip(base, failed)):
        assert f == b, f"round {i}: output changed when loads failed"
    last = runs["fail_loads"]["rounds"][-1]["tiercache_metrics"]
    failures = sum(v for k, v in last.items() if k.startswith("tiercache_failed_chunks_total"))
    assert failures > 0, last
