"""tiercache on a hybrid-attention model (full + sliding-window layers) on a real vLLM engine.

The model is the ``swa`` random-weight Llama (tiercache/testing/model_configs/swa.json):
the tiny model's dimensions (4 layers, 2 KV heads of 64, 4 KiB of float32 KV per
token) with ``layer_types`` alternating full and sliding attention and a 256-token
window. vLLM's hybrid KV-cache manager (on without a connector, and kept on by
tiercache's SupportsHMA) gives it two KV-cache groups: group 0 FullAttentionSpec
(layers 0, 2), group 1 SlidingWindowSpec (layers 1, 3) -- checked, not assumed,
by a worker call in every engine. Every prompt is longer than the window.

Engines (float32, 32-token blocks, a small engine KV space so its own cache
evicts), each run once for the whole module:

* ``baseline``: no connector;
* ``host``: tiercache with a host tier holding everything;
* ``disk``: a host tier of a few chunks in front of a disk tier (write-through),
  so hits of the sequential rounds must come from disk;
* ``corrupt_sw``: the negative control: ``faults.corrupt_loads_group`` zeroes the
  sliding-window group's loaded blocks only; the output of a hit round must change.

* ``small_host``: a host tier of six chunks, rounds 0 and 7-10 (below): tiercache
  evicts a prompt vLLM's own prefix cache still holds;
* ``incomplete_stores``: the same with ``faults.store_incomplete_chunks`` (the
  negative control of the rule that a chunk is stored only with every block a
  later hit loads): round 10's output must change;
* ``big_chunk``: 512-token chunks, longer than the window: a window-aware store
  keeps only the last window of each chunk's window-group blocks (rounds 0-2).

Rounds: (0) warm-up; (1) prompts sharing a 512-token prefix; (2) the same, one at
a time, after ``reset_prefix_cache()`` (hits only from tiercache); (3) a 4-turn
conversation with the engine cache reset between turns (turn 2 hits a chunk
completed by generated tokens); (4) more distinct prompts than the engine's KV
space; (5) the first of them again, one at a time; (6) the KV-cache groups;
(7) a prompt P (four chunks); (8) another, X: the small host tier evicts P's
last two chunks (deepest first), vLLM keeps P; (9) P with more tokens: a hit in
vLLM's own cache, whose window group holds only the last window's blocks, so
P's chunk 2 cannot be stored whole again (its first two window blocks are
vLLM's null block); (10) after ``reset_prefix_cache()``, P's first three chunks
with another ending: a hit on chunk 2 would load window-group positions nobody
wrote. ``small_host``, ``incomplete_stores`` and ``big_chunk`` store whole chunks only
(``partial_chunks: false``): partial chunks would take slots of the small host tier
and add to the bytes stored; ``host`` and ``disk`` store them (round 3's later turns
hit them, both groups' blocks).

Bytes moved per hit token (tiercache's ``host_to_device`` transfer bytes over its
hit tokens, rounds 2, 3 and 5) are printed, with the bytes stored per token, for
comparison with the full-attention tiny model of the same size (4096 bytes per
token both ways): a hit of ``L`` tokens loads ``2 KiB * L`` for the full group and
one window of blocks (``2 KiB * 256``) for the window group.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from tiercache.testing.engine_runner import random_prompts, run_engine
from tiercache.testing.random_llama import make_model_dir

from .conftest import cached, engine_spec, metric_delta

BLOCK = 32
CHUNK = 128
WINDOW = 256
ENGINE_BLOCKS = 96  # shared by both groups: ~2 of these prompts at a time, the engine's own cache evicts
SW_GROUP = 1  # vLLM's group order for this model (test_kv_cache_groups checks it)
FULL_KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 64 * 4  # layers * (K, V) * kv heads * head dim * float32: the tiny model's
FULL_GROUP_BYTES_PER_TOKEN = FULL_KV_BYTES_PER_TOKEN // 2  # the full-attention group: layers 0 and 2
DISK_HOST_CHUNKS = 12  # a chunk slot holds both groups: CHUNK * 4 KiB; one prompt is 7 chunks
SHARED_PREFIX = 512
FIRST_PROMPT = 600
CONV_MAX_TOKENS = 64
HIT_ROUNDS = (2, 5)
CONV_ROUND = 3
GROUPS_ROUND = 6
STALE_ROUND = 10  # the round a stored incomplete chunk would be loaded in
SMALL_HOST_CHUNKS = 6
BIG_CHUNK = 512  # longer than the window
ROUNDS_OF = {"small_host": (0, 7, 8, 9, 10), "incomplete_stores": (0, 7, 8, 9, 10), "big_chunk": (0, 1, 2)}
ENGINE_TIMEOUT_S = 300
ENV = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # the worker call of round 6


def kv_cache_groups(worker: Any) -> dict[str, Any]:
    """A ``worker_call``: the engine's KV-cache groups as the worker's model runner holds them."""
    config = worker.model_runner.kv_cache_config
    return {
        "num_blocks": int(config.num_blocks),
        "groups": [{"spec": type(g.kv_cache_spec).__name__, "layers": list(g.layer_names),
                    "sliding_window": getattr(g.kv_cache_spec, "sliding_window", None)}
                   for g in config.kv_cache_groups],
    }


def workload() -> list[dict[str, Any]]:
    shared = random_prompts(1, SHARED_PREFIX, seed=61)[0]
    prefixed = [p for i in range(6) for p in random_prompts(1, 300 + 20 * i, seed=70 + i, shared_prefix=shared)]
    distinct = random_prompts(10, 700, seed=62)
    p_prompt = random_prompts(1, 600, seed=65)[0]
    return [
        {"prompts": random_prompts(2, 64, seed=98), "max_tokens": 4, "warmup": True},
        {"prompts": prefixed, "max_tokens": 16},
        # One request at a time, so the disk engine's small host tier stages one prompt's chunks at a time.
        {"prompts": prefixed, "max_tokens": 16, "reset_prefix_cache_before": True, "sequential": True},
        {
            "conversation": {
                "first_prompt": random_prompts(1, FIRST_PROMPT, seed=63)[0],
                "turns": 4,
                "user_tokens_per_turn": random_prompts(3, 40, seed=64),
                "max_tokens": CONV_MAX_TOKENS,
                "reset_prefix_cache_between_turns": True,
            },
            "reset_prefix_cache_before": True,
        },
        {"prompts": distinct, "max_tokens": 8},
        {"prompts": distinct[:4], "max_tokens": 8, "sequential": True},
        {"worker_call": f"{__name__}:kv_cache_groups"},
        {"prompts": [p_prompt], "max_tokens": 4},
        {"prompts": random_prompts(1, 600, seed=66), "max_tokens": 4},
        {"prompts": random_prompts(1, 124, seed=67, shared_prefix=p_prompt[:576]), "max_tokens": 4},
        {"prompts": random_prompts(1, 300, seed=68, shared_prefix=p_prompt[:3 * CHUNK]), "max_tokens": 8,
         "reset_prefix_cache_before": True},
    ]


def spec(model: pathlib.Path, name: str, disk_root: pathlib.Path) -> dict[str, Any]:
    lower: list[dict[str, Any]] | None = []
    kv_extra: dict[str, Any] = {}
    if name == "baseline":
        lower = None
    elif name == "disk":
        lower = [{"name": "disk", "backend": "disk", "capacity": "256MiB", "options": {"root": str(disk_root)}}]
        kv_extra = {"host_capacity": DISK_HOST_CHUNKS * CHUNK * FULL_KV_BYTES_PER_TOKEN}
    elif name == "corrupt_sw":
        kv_extra = {"faults": {"corrupt_loads_group": SW_GROUP}}
    elif name in ("small_host", "incomplete_stores"):
        kv_extra = {"host_capacity": SMALL_HOST_CHUNKS * CHUNK * FULL_KV_BYTES_PER_TOKEN}
        if name == "incomplete_stores":
            kv_extra["faults"] = {"store_incomplete_chunks": True}
    if name in ROUNDS_OF:
        # these engines check whole chunks' window rule (eviction order, bytes per chunk): without the
        # partial chunks (connector/partial_chunks.py) that would take slots and add stored bytes
        kv_extra["partial_chunks"] = False
    rounds = [r for i, r in enumerate(workload()) if i in ROUNDS_OF.get(name, range(99))]
    return engine_spec(model, BIG_CHUNK if name == "big_chunk" else CHUNK, lower, rounds, kv_extra=kv_extra,
                       num_gpu_blocks_override=ENGINE_BLOCKS, env=ENV)


@pytest.fixture(scope="module")
def swa_model(models_root: pathlib.Path) -> pathlib.Path:
    return make_model_dir("swa", models_root)


@pytest.fixture(scope="module")
def runs(swa_model: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("hybrid")
    return {name: run_engine(spec(swa_model, name, tmp / "disk-tier"), timeout_s=ENGINE_TIMEOUT_S, workdir=tmp / name)
            for name in ("baseline", "host", "disk", "corrupt_sw", "small_host", "incomplete_stores", "big_chunk")}


def outputs(result: dict[str, Any]) -> list[list[list[int]]]:
    return [[r["output_token_ids"] for r in rnd["requests"]] for rnd in result["rounds"]]


def round_of(runs: dict[str, dict[str, Any]], name: str, rnd: int) -> dict[str, Any]:
    """Engine ``name``'s round that is the workload's round ``rnd`` (engines may run a subset)."""
    return runs[name]["rounds"][ROUNDS_OF.get(name, range(99)).index(rnd)]




def bytes_per_hit_token(result: dict[str, Any], rounds: tuple[int, ...]) -> float:
    """Bytes tiercache copied into vLLM's KV cache per token it served, over ``rounds``."""
    loaded = sum(metric_delta(result, r, "tiercache_transfer_bytes_total", 'path="host_to_device"') for r in rounds)
    hits = sum(metric_delta(result, r, "tiercache_hit_tokens_total") for r in rounds)
    return loaded / hits if hits else float("nan")


def transfer_report(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per tiercache engine: bytes loaded per hit token, and bytes stored per token of round 4's chunks.

    Round 4's prompts are distinct and their decode completes no chunk, so it stores exactly
    their whole chunks.
    """
    report: dict[str, Any] = {"full_attention_bytes_per_token": FULL_KV_BYTES_PER_TOKEN}
    stored_tokens = sum(len(p) // CHUNK * CHUNK for p in workload()[4]["prompts"])
    for name in ("host", "disk"):
        stored = metric_delta(runs[name], 4, "tiercache_transfer_bytes_total", 'path="device_to_host"')
        report[name] = {
            "bytes_per_hit_token": bytes_per_hit_token(runs[name], (*HIT_ROUNDS, CONV_ROUND)),
            "hit_tokens": sum(metric_delta(runs[name], r, "tiercache_hit_tokens_total")
                              for r in (*HIT_ROUNDS, CONV_ROUND)),
            "stored_bytes_per_token": stored / stored_tokens,
        }
    return report


def test_kv_cache_groups(runs: dict[str, dict[str, Any]]) -> None:
    """Two groups, full then sliding window, in every engine: the negative control corrupts the right one."""
    for name, result in runs.items():
        if GROUPS_ROUND not in ROUNDS_OF.get(name, range(99)):
            continue
        (info,) = result["rounds"][GROUPS_ROUND]["results"]
        specs = [(g["spec"], g["sliding_window"]) for g in info["groups"]]
        assert specs == [("FullAttentionSpec", None), ("SlidingWindowSpec", WINDOW)], (name, info)
        assert info["num_blocks"] == ENGINE_BLOCKS, (name, info)


@pytest.mark.parametrize("name", ["host", "disk", "small_host", "big_chunk"])
def test_output_identical_with_tiercache(runs: dict[str, dict[str, Any]], name: str) -> None:
    base, tc = outputs(runs["baseline"]), outputs(runs[name])
    rounds = ROUNDS_OF.get(name, range(len(base)))
    assert len(tc) == len(rounds)
    for i, t in zip(rounds, tc, strict=True):
        assert t == base[i], f"round {i}: greedy tokens differ with tiercache ({name})"


def test_negative_control_storing_incomplete_chunks_changes_output(runs: dict[str, dict[str, Any]]) -> None:
    """Round 9 stores P's chunk 2 from a table whose window group lacks two of its blocks;
    round 10 loads it: the unwritten window positions reach vLLM. Without the fault knob
    (``small_host``) chunk 2 is not stored and round 10 hits chunks 0-1 only."""
    bad = round_of(runs, "incomplete_stores", STALE_ROUND)
    base = runs["baseline"]["rounds"][STALE_ROUND]
    assert bad["requests"][0]["num_cached_tokens"] >= 3 * CHUNK  # the stale chunk was loaded
    assert [r["output_token_ids"] for r in bad["requests"]] != [r["output_token_ids"] for r in base["requests"]]
    good = round_of(runs, "small_host", STALE_ROUND)
    assert good["requests"][0]["num_cached_tokens"] == 2 * CHUNK  # chunk 2 not stored: computed


def test_a_window_aware_store_of_chunks_longer_than_the_window_keeps_one_window(
        runs: dict[str, dict[str, Any]], capsys: pytest.CaptureFixture[str]) -> None:
    """Round 1 of ``big_chunk`` stores one 512-token chunk (the shared prefix): the full group's
    2 KiB per token plus the window group's last 256 tokens only; round 2 (after a reset) hits it,
    token-exact (test_output_identical_with_tiercache)."""
    big = runs["big_chunk"]
    r1, r2 = ROUNDS_OF["big_chunk"].index(1), ROUNDS_OF["big_chunk"].index(2)
    stored = metric_delta(big, r1, "tiercache_transfer_bytes_total", 'path="device_to_host"')
    expected = (BIG_CHUNK + WINDOW) * FULL_GROUP_BYTES_PER_TOKEN
    with capsys.disabled():
        print(f"\nwindow-aware store, {BIG_CHUNK}-token chunks, {WINDOW}-token window: "
              f"{stored / BIG_CHUNK:,.0f} bytes stored per token (full attention: {FULL_KV_BYTES_PER_TOKEN:,})")
    assert stored == expected, (stored, expected)
    assert metric_delta(big, r2, "tiercache_hit_tokens_total") >= BIG_CHUNK  # (later prompts: vLLM's own cache)


@pytest.mark.parametrize("name", ["host", "disk"])
@pytest.mark.parametrize("rnd", HIT_ROUNDS)
def test_hits_served_by_tiercache(runs: dict[str, dict[str, Any]], rnd: int, name: str) -> None:
    base, tc = runs["baseline"], runs[name]
    assert sum(cached(tc, rnd)) > sum(cached(base, rnd)), (cached(tc, rnd), cached(base, rnd))
    assert metric_delta(tc, rnd, "tiercache_hit_tokens_total") > 0, tc["rounds"][rnd]["tiercache_metrics"]
    if rnd == 2:  # after a reset: the shared prefix (4 chunks, twice the window) comes from tiercache
        assert cached(base, rnd)[0] == 0
        assert all(c >= SHARED_PREFIX for c in cached(tc, rnd)), cached(tc, rnd)


@pytest.mark.parametrize("name", ["host", "disk"])
def test_conversation_hits_generated_tokens(runs: dict[str, dict[str, Any]], name: str) -> None:
    """Turn 2 hits the chunk completed while turn 1 was decoding; every later turn hits up to the turn
    before's last full block, both groups' blocks of a partial chunk included."""
    turns = runs[name]["rounds"][CONV_ROUND]["requests"]
    assert turns[0]["prompt_len"] == FIRST_PROMPT
    decoded_until = FIRST_PROMPT + CONV_MAX_TOKENS - 1  # the last sampled token has no KV
    expected = (decoded_until // CHUNK) * CHUNK
    assert expected > FIRST_PROMPT
    assert turns[1]["num_cached_tokens"] == expected, [t["num_cached_tokens"] for t in turns]
    # every later turn up to the last one's last full block, mid-chunk too (connector/partial_chunks.py)
    ends = [(t["prompt_len"] + CONV_MAX_TOKENS - 1) // BLOCK * BLOCK for t in turns[:-1]]
    assert [t["num_cached_tokens"] for t in turns[1:]] == ends, [t["num_cached_tokens"] for t in turns]
    assert any(end % CHUNK for end in ends)  # (one of them is a partial chunk's)


def test_disk_tier_serves_hits(runs: dict[str, dict[str, Any]]) -> None:
    """The host tier holds a dozen chunks: the sequential hit rounds must read chunks from disk."""
    disk_hits = sum(metric_delta(runs["disk"], r, "tiercache_hit_tokens_total", 'tier="disk"') for r in HIT_ROUNDS)
    assert disk_hits > 0, [runs["disk"]["rounds"][r]["tiercache_metrics"] for r in HIT_ROUNDS]


def test_negative_control_corrupted_window_group_changes_output(runs: dict[str, dict[str, Any]]) -> None:
    base, bad = outputs(runs["baseline"]), outputs(runs["corrupt_sw"])
    assert metric_delta(runs["corrupt_sw"], 2, "tiercache_hit_tokens_total") > 0
    changed = [i for i in (*HIT_ROUNDS, CONV_ROUND) if bad[i] != base[i]]
    assert changed, "zeroing the sliding-window group's loaded KV did not change the output"


@pytest.mark.parametrize("name", ["host", "disk"])
def test_window_group_loads_one_window_per_hit(runs: dict[str, dict[str, Any]], name: str) -> None:
    """Round 5 (every prompt hits tiercache alone): the full group loads 2 KiB per hit token, the window
    group exactly one window of blocks per request, whatever the hit's length."""
    tc, rnd = runs[name], 5
    hits = metric_delta(tc, rnd, "tiercache_hit_tokens_total")
    assert sum(cached(runs["baseline"], rnd)) == 0 and sum(cached(tc, rnd)) == hits > 0, (cached(tc, rnd), hits)
    loaded = metric_delta(tc, rnd, "tiercache_transfer_bytes_total", 'path="host_to_device"')
    window = len(cached(tc, rnd)) * WINDOW * FULL_GROUP_BYTES_PER_TOKEN
    assert loaded == FULL_GROUP_BYTES_PER_TOKEN * hits + window, (loaded, hits)


def test_window_aware_loads_move_less_than_full_attention(
        runs: dict[str, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Every hit token brings the full group's KV (2 KiB); the window group adds at most a window per hit."""
    report = transfer_report(runs)
    (tmp_path_factory.getbasetemp() / "hybrid_transfer_report.json").write_text(json.dumps(report, indent=1))
    with capsys.disabled():
        print(f"\nhybrid model transfer report: {json.dumps(report)}")
    for name in ("host", "disk"):
        per_token = report[name]["bytes_per_hit_token"]
        assert FULL_GROUP_BYTES_PER_TOKEN <= per_token < FULL_KV_BYTES_PER_TOKEN, (name, report)
