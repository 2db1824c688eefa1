"""Prefill/decode hand-offs of a hybrid-attention model (full + sliding-window KV-cache groups), mode via_host.

The model is the ``swa`` random-weight Llama (tiercache/testing/model_configs/swa.json,
as in tests/e2e/test_hybrid_models.py): group 0 full attention, group 1 a
256-token sliding window. A via_host hand-off's chunk covers both groups (group
``g``'s blocks at slot positions ``g * bpc ..``, connector/kv_groups.py); the
consumer READs one entry per run of its allocated blocks (tiercache/pd/peer_tier.py).
In mode direct a key names every group's device blocks, group-major, -1 where the
producer holds none (connector/pd/direct_blocks.py); the consumer READs them block
for block.

Engines (float32, 32-token blocks, 64-token chunks: two blocks per group per
chunk), machinery and CPU pinning as in tests/e2e/test_pd.py:

* ``baseline``: no connector; decodes A, C and D (prompts longer than the window);
* ``producer`` (kv_producer): prefills A + C + D (max_tokens 1, ``do_remote_decode``)
  and returns the hand-off params; then (a worker call, at a barrier once the
  params are known) zeroes the window group's positions of C's and D's host
  slots (the negative controls' source: the hand-off's window-group bytes wrong,
  the full group's right); it stays up while the consumers read;
* ``consumer`` (kv_consumer, defaults: what it receives is page-hash verified):
  round 0 decodes A with the producer's params: tokens equal the baseline's and
  vLLM computes exactly one token per prompt (both groups' KV came from the
  hand-off: three prompts with a partial last chunk, one of whole chunks);
  round 1 records its KV-cache groups; round 2 (after a barrier, so that rounds
  0-1 are kept whatever it does) decodes C: the window group's corrupted bytes
  fail their page hashes, so the consumer must recompute (failed loads, tokens
  equal) rather than use them;
* ``unverified`` (kv_consumer, ``keep_received: false``: nothing hashed): decodes
  D, reading the corrupted window group unchecked, one token computed per
  prompt: the output changes. This is the negative control of the token
  equality: a hand-off whose window-group KV is wrong (not read, read from the
  wrong positions) cannot give the baseline's tokens on this model.

Mode direct, a second pair (after the first is gone):

* ``direct_producer`` (kv_producer, ``pd.mode: direct``): prefills A + D and holds their
  device blocks; then (a worker call, once the params are known) zeroes the window
  group's held blocks of D's hand-offs (after their tags were set);
* ``direct_consumer`` (kv_consumer): decodes A (tokens equal the baseline's, one token
  computed per prompt: both groups' blocks came from the producer's), then D: direct
  hand-offs carry no page hashes, so D's zeroed window blocks are loaded (one token
  computed per prompt) and the output changes: the negative control of the direct
  token equality, one KV-cache group of one hand-off wrong.

Both tiercache engines record their KV-cache groups (test_hybrid_models's worker call).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from tiercache.testing.engine_runner import EngineRun, random_prompts, run_engine
from tiercache.testing.random_llama import make_model_dir

from .conftest import free_port, tiercache_kv_config
from .test_hybrid_models import kv_cache_groups
from .test_pd import (
    CONSUMER_CPU,
    PRODUCER_CPU,
    decode_round,
    engine_spec,
    sample,
    tokens,
    vllm_counter,
)

CHUNK = 64  # two 32-token blocks per group per chunk
WINDOW = 256
SW_GROUP = 1
# 600 % 64 = 24, 650 % 64 = 10, 700 % 64 = 60: a partial last chunk (the prompt tail);
# 640: ten whole chunks. All longer than the window; a window of 256 tokens ending at the
# last loaded token starts mid-chunk for some (a chunk whose window-group blocks are half null).
A = [random_prompts(1, n, seed=81 + i)[0] for i, n in enumerate((600, 650, 700))] + random_prompts(1, 640, seed=84)
C = [random_prompts(1, n, seed=85 + i)[0] for i, n in enumerate((620, 672))]  # corrupted, verified: recomputed
D = [random_prompts(1, n, seed=87 + i)[0] for i, n in enumerate((630, 704))]  # corrupted, unverified: output changes
TINY = random_prompts(1, 40, seed=89)
MAX_TOKENS = 10
HANDOFF_TIMEOUT_S = 600.0  # no expiry here (test_pd.py tests it): held until read or the producer dies
READ_TIMEOUT_S = 10.0
ENGINE_TIMEOUT_S = 400
WORKER_CALLS = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # the worker calls below


def corrupt_window_group(worker: Any, params_file: str, group: int) -> dict[str, Any]:
    """A producer ``worker_call``: zero KV-cache group ``group``'s positions of every host slot the
    hand-offs in ``params_file`` name; returns how many slots, and how many held their key then
    (its tag set: the copy into the slot had finished, so nothing rewrites it)."""
    del worker
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from tiercache.layout import region_offsets
    from tiercache.pd.channel import key_tag

    tc_worker = get_kv_transfer_group()._worker
    transfer = tc_worker.engine.engine  # WorkerPipeline -> TransferEngine
    endpoint = tc_worker.pd.endpoint
    slot_blocks, per_group = transfer.blocks_per_chunk, transfer.group_blocks
    positions = range(group * per_group, (group + 1) * per_group)
    slots = tagged = 0
    for params in json.loads(pathlib.Path(params_file).read_text()):
        for key_hex, slot in zip(params["tiercache"]["chunk_keys"], params["remote_block_ids"], strict=True):
            tagged += int(endpoint.tags[slot]) == key_tag(bytes.fromhex(key_hex))
            if transfer.planes is not None:  # planes: host block slot * slot_blocks + position, per region
                for plane in transfer.planes:
                    for p in positions:
                        plane[slot * slot_blocks + p].zero_()
            else:  # slots: region r's pages at its offset in the slot
                row = transfer.host.slab[slot]
                pages = transfer.layout.page_bytes
                for off, page in zip(region_offsets(pages, slot_blocks), pages):
                    row[off + positions.start * page: off + positions.stop * page].zero_()
            slots += 1
    return {"slots": slots, "tagged": tagged, "planes": transfer.planes is not None}


def corrupt_direct_window_group(worker: Any, params_file: str, group: int) -> dict[str, Any]:
    """A direct producer's ``worker_call``: zero group ``group``'s held blocks of the hand-offs in
    ``params_file`` (each key names ``groups * bpc`` blocks, group-major, -1 where none); returns how
    many blocks, and how many were tagged with their key (held: the consumer will read them)."""
    del worker
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from tiercache.pd.channel import key_tag

    tc_worker = get_kv_transfer_group()._worker
    transfer = tc_worker.engine.engine  # WorkerPipeline -> TransferEngine
    endpoint = tc_worker.pd.endpoint
    per_key, per_group = transfer.blocks_per_chunk, transfer.group_blocks
    zeroed = tagged = 0
    for params in json.loads(pathlib.Path(params_file).read_text()):
        blocks = params["remote_block_ids"]
        for i, key_hex in enumerate(params["tiercache"]["chunk_keys"]):
            for block in blocks[i * per_key + group * per_group: i * per_key + (group + 1) * per_group]:
                if block < 0:
                    continue
                tagged += int(endpoint.block_tags[block]) == key_tag(bytes.fromhex(key_hex))
                for region in transfer.layout.regions:
                    region[block].zero_()
                zeroed += 1
    return {"blocks": zeroed, "tagged": tagged}


def groups_call() -> dict[str, Any]:
    return {"worker_call": f"{kv_cache_groups.__module__}:kv_cache_groups"}


def producer_kv(side_port: int, metrics_port: int, mode: str = "via_host") -> dict[str, Any]:
    return tiercache_kv_config(CHUNK, [], metrics_port=metrics_port, kv_role="kv_producer",
                               pd={"port": side_port, "handoff_timeout_s": HANDOFF_TIMEOUT_S, "mode": mode})


def consumer_kv(metrics_port: int, **pd: Any) -> dict[str, Any]:
    return tiercache_kv_config(CHUNK, [], metrics_port=metrics_port, kv_role="kv_consumer",
                               load_mode="async", pd={"read_timeout_s": READ_TIMEOUT_S, **pd})


def spec(model: pathlib.Path, kv: dict[str, Any] | None, rounds: list[dict[str, Any]], metrics_port: int | None,
         cpu: dict[str, str] | None = None) -> dict[str, Any]:
    return {**engine_spec(kv, rounds, metrics_port, {**(cpu or {}), **WORKER_CALLS}), "model_dir": str(model)}


def local_compute(result: dict[str, Any], rnd: int) -> float:
    """Prompt tokens vLLM computed itself during round ``rnd``."""
    before = vllm_counter(result["rounds"][rnd - 1], "prompt_tokens_by_source", "local_compute") if rnd else 0.0
    return vllm_counter(result["rounds"][rnd], "prompt_tokens_by_source", "local_compute") - before


def params_at_barrier(producer: EngineRun) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A producer at barrier ``params`` (its hand-off round done): that round, and each request's params."""
    producer.wait_for("params", timeout_s=ENGINE_TIMEOUT_S)
    handed = producer.partial("params")["rounds"][0]
    return handed, [r["kv_transfer_params"] for r in handed["requests"]]


def released_to_end(producer: EngineRun) -> dict[str, Any]:
    """Let a producer at barrier ``params`` run on to barrier ``end``; its rounds so far."""
    producer.release("params")
    producer.wait_for("end", timeout_s=120)
    return producer.partial("end")


@pytest.fixture(scope="module")
def runs(models_root: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = make_model_dir("swa", models_root)
    tmp = tmp_path_factory.mktemp("pd-hybrid")
    out: dict[str, Any] = {}
    out["baseline"] = run_engine(spec(model, None, [{"prompts": A + C + D, "max_tokens": MAX_TOKENS}], None),
                                 timeout_s=ENGINE_TIMEOUT_S, workdir=tmp / "baseline")
    side, p_metrics, c_metrics, u_metrics = free_port(), free_port(), free_port(), free_port()
    params_a, params_c, params_d, corrupt = (tmp / f"params_{n}.json" for n in ("a", "c", "d", "corrupt"))
    producer_rounds = [
        {"prompts": A + C + D, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        {"worker_call": f"{__name__}:corrupt_window_group", "barrier": "params",
         "kwargs": {"params_file": str(corrupt), "group": SW_GROUP}},
        groups_call(),
        {"prompts": TINY, "max_tokens": 1, "barrier": "end"},  # killed while waiting here
    ]
    consumer_rounds = [decode_round(A, params_a, "A"), groups_call(),
                       {"prompts": C, "max_tokens": MAX_TOKENS, "kv_transfer_params_file": str(params_c),
                        "barrier": "C"}]
    producer = EngineRun(spec(model, producer_kv(side, p_metrics), producer_rounds, p_metrics, PRODUCER_CPU),
                         tmp / "producer")
    consumer = EngineRun(spec(model, consumer_kv(c_metrics), consumer_rounds, c_metrics, CONSUMER_CPU),
                         tmp / "consumer")
    try:
        out["producer_r0"], params = params_at_barrier(producer)
        p_a, p_c, p_d = params[:len(A)], params[len(A):len(A) + len(C)], params[len(A) + len(C):]
        for path, value in ((params_a, p_a), (params_c, p_c), (params_d, p_d), (corrupt, p_c + p_d)):
            path.write_text(json.dumps(value))
        out["producer"] = released_to_end(producer)
        consumer.wait_for("A", timeout_s=ENGINE_TIMEOUT_S)
        consumer.release("A")
        consumer.wait_for("C", timeout_s=ENGINE_TIMEOUT_S)
        out["consumer"] = consumer.partial("C")  # A's round and the groups, whatever C's round does
        consumer.release("C")
        try:
            out["consumer_c"] = consumer.result(timeout_s=ENGINE_TIMEOUT_S)
        except RuntimeError as exc:  # reported by test_corrupted_window_group_is_caught_by_page_hashes
            lines = str(exc).splitlines()
            out["consumer_c_error"] = "\n".join([ln for ln in lines if "Error:" in ln][-3:] or lines[-5:])
        unverified = spec(model, consumer_kv(u_metrics, keep_received=False),
                          [{"prompts": D, "max_tokens": MAX_TOKENS, "kv_transfer_params_file": str(params_d)}],
                          u_metrics, CONSUMER_CPU)
        out["unverified"] = run_engine(unverified, timeout_s=ENGINE_TIMEOUT_S, workdir=tmp / "unverified")
    finally:
        producer.kill()
        consumer.kill()
    run_direct_pair(model, tmp, out)
    return out


def run_direct_pair(model: pathlib.Path, tmp: pathlib.Path, out: dict[str, Any]) -> None:
    """Mode direct: a producer holding A's and D's device blocks, a consumer decoding A then D."""
    side, p_metrics, c_metrics = free_port(), free_port(), free_port()
    params_a, params_d = tmp / "direct_a.json", tmp / "direct_d.json"
    producer_rounds = [
        {"prompts": A + D, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        {"worker_call": f"{__name__}:corrupt_direct_window_group", "barrier": "params",
         "kwargs": {"params_file": str(params_d), "group": SW_GROUP}},
        {"prompts": TINY, "max_tokens": 1, "barrier": "end"},  # killed while waiting here
    ]
    consumer_rounds = [decode_round(A, params_a, "A"),
                       {"prompts": D, "max_tokens": MAX_TOKENS, "kv_transfer_params_file": str(params_d)}]
    producer = EngineRun(spec(model, producer_kv(side, p_metrics, "direct"), producer_rounds, p_metrics,
                              PRODUCER_CPU), tmp / "direct_producer")
    consumer = EngineRun(spec(model, consumer_kv(c_metrics), consumer_rounds, c_metrics, CONSUMER_CPU),
                         tmp / "direct_consumer")
    try:
        out["direct_producer_r0"], params = params_at_barrier(producer)
        params_a.write_text(json.dumps(params[:len(A)]))
        params_d.write_text(json.dumps(params[len(A):]))
        out["direct_producer"] = released_to_end(producer)
        consumer.wait_for("A", timeout_s=ENGINE_TIMEOUT_S)
        consumer.release("A")
        out["direct_consumer"] = consumer.result(timeout_s=ENGINE_TIMEOUT_S)
    finally:
        producer.kill()
        consumer.kill()


def baseline_tokens(runs: dict[str, Any], prompts: list[list[int]]) -> list[list[int]]:
    everything = A + C + D
    start = next(i for i in range(len(everything)) if everything[i:i + len(prompts)] == prompts)
    return tokens(runs["baseline"], 0)[start:start + len(prompts)]


def test_kv_cache_groups(runs: dict[str, Any]) -> None:
    """Both tiercache engines have the two groups, full then sliding window (group 1 is the one corrupted)."""
    for name, rnd in (("producer", 2), ("consumer", 1)):
        (info,) = runs[name]["rounds"][rnd]["results"]
        specs = [(g["spec"], g["sliding_window"]) for g in info["groups"]]
        assert specs == [("FullAttentionSpec", None), ("SlidingWindowSpec", WINDOW)], (name, info)


def test_producer_hands_off_every_chunk_and_tail(runs: dict[str, Any]) -> None:
    for req, prompt in zip(runs["producer_r0"]["requests"], A + C + D, strict=True):
        params = req["kv_transfer_params"]
        tail = len(prompt) % CHUNK
        assert params["tiercache"]["mode"] == "via_host" and params["tiercache"]["tail_tokens"] == tail
        assert len(params["tiercache"]["chunk_keys"]) == len(prompt) // CHUNK + (1 if tail else 0)
        assert len(params["remote_block_ids"]) == len(params["tiercache"]["chunk_keys"])  # one host slot per chunk


def test_consumer_decodes_token_exact_without_recomputing_the_prompt(runs: dict[str, Any]) -> None:
    consumer = runs["consumer"]
    assert tokens(consumer, 0) == baseline_tokens(runs, A)
    r0 = consumer["rounds"][0]
    assert sample(r0, "tiercache_hit_tokens_total", 'tier="peer"') == sum(len(p) - 1 for p in A)
    assert local_compute(consumer, 0) == len(A)  # the last token of each prompt: both groups came from the hand-off


def test_corrupted_window_group_is_caught_by_page_hashes(runs: dict[str, Any]) -> None:
    """C's window-group slot positions were zeroed after their hashes: the consumer recomputes, never uses them."""
    (corrupted,) = runs["producer"]["rounds"][1]["results"]
    n_slots = sum(len(p) // CHUNK + (1 if len(p) % CHUNK else 0) for p in C + D)
    assert corrupted["slots"] == corrupted["tagged"] == n_slots, corrupted
    assert "consumer_c" in runs, f"the consumer died recomputing C: {runs.get('consumer_c_error')}"
    consumer, rnd = runs["consumer_c"], 2
    assert tokens(consumer, rnd) == baseline_tokens(runs, C)
    before, after = consumer["rounds"][rnd - 1], consumer["rounds"][rnd]
    failed = sample(after, "tiercache_failed_chunks_total", 'op="load"') - \
        sample(before, "tiercache_failed_chunks_total", 'op="load"')
    assert failed > 0


def test_negative_control_unverified_corrupted_window_group_changes_output(runs: dict[str, Any]) -> None:
    """D read unchecked with its window group zeroed: loaded (one token computed per prompt), tokens differ."""
    unverified = runs["unverified"]
    assert local_compute(unverified, 0) == len(D)
    assert tokens(unverified, 0) != baseline_tokens(runs, D)


def test_direct_producer_names_every_groups_blocks_per_key(runs: dict[str, Any]) -> None:
    for req, prompt in zip(runs["direct_producer_r0"]["requests"], A + D, strict=True):
        params = req["kv_transfer_params"]
        keys = len(prompt) // CHUNK + (1 if len(prompt) % CHUNK else 0)
        assert params["tiercache"]["mode"] == "direct" and len(params["tiercache"]["chunk_keys"]) == keys
        blocks = params["remote_block_ids"]
        assert len(blocks) == keys * 2 * (CHUNK // 32)  # two groups, two blocks each per key
        full_group = [b for i in range(keys) for b in blocks[i * 4:i * 4 + 2]]
        assert -1 not in full_group[:(len(prompt) // 32)]  # every full-attention block of the prompt held


def test_direct_consumer_decodes_token_exact_from_both_groups_blocks(runs: dict[str, Any]) -> None:
    consumer = runs["direct_consumer"]
    assert tokens(consumer, 0) == baseline_tokens(runs, A)
    r0 = consumer["rounds"][0]
    hit = sample(r0, "tiercache_hit_tokens_total", 'tier="peer"')
    assert hit == sum(len(p) - 1 for p in A)
    assert local_compute(consumer, 0) == len(A)
    for mode, rnd, path in (("via_host", runs["consumer"]["rounds"][0], "peer_host_to_device"),
                            ("direct", r0, "peer_device_to_device")):
        moved = sample(rnd, "tiercache_transfer_bytes_total", f'path="{path}"')
        print(f"\nP/D {mode}, swa model: {moved / hit:,.0f} bytes read per handed-off token "
              f"(full attention everywhere: 4,096)")


def test_negative_control_direct_window_group_zeroed_at_the_producer_changes_output(runs: dict[str, Any]) -> None:
    (zeroed,) = runs["direct_producer"]["rounds"][1]["results"]
    assert zeroed["blocks"] > 0 and zeroed["tagged"] == zeroed["blocks"], zeroed
    consumer = runs["direct_consumer"]
    assert local_compute(consumer, 1) == len(D)  # loaded: tags match, no page hashes in mode direct
    assert tokens(consumer, 1) != baseline_tokens(runs, D)
