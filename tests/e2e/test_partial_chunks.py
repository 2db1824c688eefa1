"""Partial chunks on a real vLLM engine: a conversation's next turn reuses KV up to the last full block.

tiny random-weight Llama, float32, 32-token blocks, 128-token chunks (4 blocks).
A request that ends inside a chunk stores that chunk's full blocks under a
partial-chunk key (connector/partial_chunks.py); the next turn, whose prompt is
the last one, its answer and new words, hits them after its full chunks. Engines
(one workload each):

* ``baseline``: no connector;
* ``tiercache``: a host tier of 8 chunks in front of a disk tier;
* ``short``: the negative control: ``faults.partial_chunk_short_block`` stores
  every partial chunk one block short of what its key names (that one block
  of the slot is stale when the next turn loads it): the tokens must change.

Rounds: (0) warm-up; (1) a 3-turn conversation, the engine's own cache reset
between turns, turns ending 7 and 9 blocks in (mid-chunk); (2) a 100-token
prompt Q (shorter than a chunk); (3) ten other prompts, one at a time, which push
Q's partial chunk out of the small host tier; (4) after a reset, Q and 60 more tokens:
Q's three blocks come back from the disk tier.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from tiercache.testing.engine_runner import random_prompts, run_engine

from .conftest import cached, engine_spec, metric_delta

BLOCK = 32
CHUNK = 128
CHUNK_BYTES = CHUNK * 4096  # the tiny model's float32 KV: 4 KiB per token
FIRST_PROMPT = 200
USER_TOKENS = 40
MAX_TOKENS = 30
CONV_ROUND, Q_ROUND, Q_AGAIN_ROUND = 1, 2, 4
Q_LEN = 100


def workload() -> list[dict[str, Any]]:
    q = random_prompts(1, Q_LEN, seed=83)[0]
    return [
        {"prompts": random_prompts(2, 64, seed=97), "max_tokens": 4, "warmup": True},
        {
            "conversation": {
                "first_prompt": random_prompts(1, FIRST_PROMPT, seed=81)[0],
                "turns": 3,
                "user_tokens_per_turn": random_prompts(2, USER_TOKENS, seed=82),
                "max_tokens": MAX_TOKENS,
                "reset_prefix_cache_between_turns": True,
            },
            "reset_prefix_cache_before": True,
        },
        {"prompts": [q], "max_tokens": 8},
        {"prompts": random_prompts(10, 300, seed=84), "max_tokens": 2, "sequential": True},
        {"prompts": random_prompts(1, 60, seed=85, shared_prefix=q), "max_tokens": 8,
         "reset_prefix_cache_before": True},
        {"prompts": random_prompts(1, 64, seed=86), "max_tokens": 2},  # (metrics of round 4 settle)
    ]


def spec(model: pathlib.Path, name: str, disk: pathlib.Path) -> dict[str, Any]:
    if name == "baseline":
        return engine_spec(model, CHUNK, None, workload())
    lower = [{"name": "disk", "backend": "disk", "capacity": "64MiB", "options": {"root": str(disk)}}]
    kv_extra: dict[str, Any] = {"host_capacity": 8 * CHUNK_BYTES}
    if name == "short":
        kv_extra["faults"] = {"partial_chunk_short_block": True}
    return engine_spec(model, CHUNK, lower, workload(), kv_extra=kv_extra)


@pytest.fixture(scope="module")
def runs(tiny_model: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("partial-chunks")
    return {name: run_engine(spec(tiny_model, name, tmp / f"{name}-disk"), timeout_s=300, workdir=tmp / name)
            for name in ("baseline", "tiercache", "short")}


def outputs(result: dict[str, Any]) -> list[list[list[int]]]:
    return [[r["output_token_ids"] for r in rnd["requests"]] for rnd in result["rounds"]]


def test_output_identical_with_partial_chunks(runs: dict[str, dict[str, Any]]) -> None:
    for i, (b, t) in enumerate(zip(outputs(runs["baseline"]), outputs(runs["tiercache"]), strict=True)):
        assert t == b, f"round {i}: greedy tokens differ with partial chunks"


def test_each_turn_hits_up_to_the_last_turns_last_full_block(runs: dict[str, dict[str, Any]]) -> None:
    turns = runs["tiercache"]["rounds"][CONV_ROUND]["requests"]
    ends = [(t["prompt_len"] + MAX_TOKENS - 1) // BLOCK * BLOCK for t in turns]  # last sampled token: no KV
    assert all(end % CHUNK for end in ends[:2]), ends  # built so that each turn ends inside a chunk
    assert [t["num_cached_tokens"] for t in turns[1:]] == ends[:2]  # not the chunk boundary before it
    assert cached(runs["baseline"], CONV_ROUND)[1:] == [0, 0]  # the engine's own cache was reset


def test_a_partial_chunk_comes_back_from_the_disk_tier(runs: dict[str, dict[str, Any]]) -> None:
    result = runs["tiercache"]
    assert cached(result, Q_AGAIN_ROUND) == [Q_LEN // BLOCK * BLOCK]  # Q's three blocks: no full chunk of it
    assert sum(metric_delta(result, r, "tiercache_hit_tokens_total", 'tier="disk"')
               for r in (Q_AGAIN_ROUND, Q_AGAIN_ROUND + 1)) >= Q_LEN // BLOCK * BLOCK


def test_negative_control_a_partial_chunk_one_block_short_changes_the_tokens(
        runs: dict[str, dict[str, Any]]) -> None:
    short = runs["short"]
    assert [t["num_cached_tokens"] for t in short["rounds"][CONV_ROUND]["requests"][1:]] == \
        [t["num_cached_tokens"] for t in runs["tiercache"]["rounds"][CONV_ROUND]["requests"][1:]]
    base, bad = outputs(runs["baseline"]), outputs(short)
    changed = [i for i in (CONV_ROUND, Q_AGAIN_ROUND) if bad[i] != base[i]]
    assert changed, "a stale block in every partial chunk did not change the tokens: the test cannot fail"
