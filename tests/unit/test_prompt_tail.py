"""A P/D prompt's partial last chunk (its tail) handed off with its chunks, without engines.

The tail key (tiercache.keys.KeySpace.tail_key, connector/prompt_tail.py) must
change with every token it covers and with what precedes them; the producer
stores the tail's partial blocks (via_host) or holds them (direct) and names
the tail last in the params; the consumer loads it only when its own prompt
gives the same key, so its engine computes just the last token. The real
engines' check (vLLM's local-compute count is one token per prompt) is
tests/e2e/test_pd.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tiercache.connector.prompt_tail import prompt_tail
from tiercache.keys import KeySpace, Namespace

BLOCK = 32
NS = Namespace("m", "torch.float32", "NHD", BLOCK, 2 * BLOCK, 1, 8192, "sha256")
KEYS = KeySpace(NS, 2)  # chunks of 2 blocks, 64 tokens


def request(tokens: list[int], rid: str = "r", **extra: Any) -> SimpleNamespace:
    """A vLLM request as the connector reads it: hashes of its full blocks (fake but chained by content)."""
    hashes = [bytes([sum(tokens[: (i + 1) * BLOCK]) % 251]) * 32 for i in range(len(tokens) // BLOCK)]
    return SimpleNamespace(request_id=rid, prompt_token_ids=tokens, num_prompt_tokens=len(tokens),
                           num_tokens=len(tokens), num_computed_tokens=0, block_hashes=hashes,
                           kv_transfer_params={"do_remote_decode": True}, **extra)


PROMPT = list(range(1, 2 * 64 + 40 + 1))  # 2 whole chunks and a 40-token tail (one full block and 8 tokens)


def test_the_tail_key_covers_its_tokens_what_precedes_them_and_the_salt() -> None:
    tail = prompt_tail(request(PROMPT), KEYS, 64, BLOCK)
    assert tail is not None and (tail.chunk, tail.tokens, tail.blocks(BLOCK)) == (2, 40, 2)
    assert len(tail.key) == len(KEYS.chunk_keys(request(PROMPT).block_hashes)[0])
    assert tail.key not in KEYS.chunk_keys(request(PROMPT).block_hashes)
    again = prompt_tail(request(list(PROMPT)), KEYS, 64, BLOCK)
    assert again is not None and again.key == tail.key  # another process, same tokens: same key
    changed = [PROMPT[:-1] + [999], PROMPT[:150] + [999] + PROMPT[151:]]  # the last token; one in the full block
    for tokens in changed:
        other = prompt_tail(request(tokens), KEYS, 64, BLOCK)
        assert other is not None and other.key != tail.key
    earlier = request(PROMPT)
    earlier.block_hashes[3] = b"\x00" * 32  # a token before the tail (the parent block's chained hash)
    assert prompt_tail(earlier, KEYS, 64, BLOCK).key != tail.key  # type: ignore[union-attr]
    salted = prompt_tail(request(PROMPT, cache_salt="tenant-b"), KEYS, 64, BLOCK)
    assert salted is not None and salted.key != tail.key
    lora = prompt_tail(request(PROMPT, lora_request=SimpleNamespace(lora_name="a")), KEYS, 64, BLOCK)
    assert lora is not None and lora.key != tail.key


def test_no_tail_when_none_is_worth_it_or_token_ids_do_not_decide_the_kv() -> None:
    assert prompt_tail(request(PROMPT[:128]), KEYS, 64, BLOCK) is None  # whole chunks
    assert prompt_tail(request(PROMPT[:129]), KEYS, 64, BLOCK) is None  # one token: computed anyway
    assert prompt_tail(request(PROMPT[:130]), KEYS, 64, BLOCK) is not None
    assert prompt_tail(request(PROMPT[:20]), KEYS, 64, BLOCK) is not None  # a prompt shorter than a chunk
    assert prompt_tail(request(PROMPT, mm_features=[object()]), KEYS, 64, BLOCK) is None
    assert prompt_tail(request(PROMPT, prompt_embeds=object()), KEYS, 64, BLOCK) is None
    unhashed = request(PROMPT)
    unhashed.block_hashes = unhashed.block_hashes[:2]
    assert prompt_tail(unhashed, KEYS, 64, BLOCK) is None


# ------------------------------------------------------------------ through the scheduler
pytest.importorskip("vllm")

from tiercache.config.schema import load_config  # noqa: E402
from tiercache.connector.engine_info import ChunkGeometry, EngineGeometry  # noqa: E402
from tiercache.connector.scheduler import TierCacheScheduler  # noqa: E402
from tiercache.pd.handoff import Handoff  # noqa: E402


def scheduler(kv_role: str, mode: str = "via_host", blocks: list[int] | None = None,
              pool: Any = None) -> TierCacheScheduler:
    config = load_config(chunk_tokens=64, tiers=[{"name": "cpu", "backend": "cpu", "capacity": "1MiB"}],
                         pd={"mode": mode})
    engine = EngineGeometry(model="m", kv_dtype="torch.float32", kv_layout="NHD", block_size=BLOCK, tp_size=1,
                            world_size=1, bytes_per_block=4096, hash_algo="sha256")
    sched = TierCacheScheduler(config, ChunkGeometry.build(config, engine), kv_role=kv_role)
    ids = blocks or [10, 11, 12, 13, 14, 15]
    sched.bind_kv_cache_manager(SimpleNamespace(get_block_ids=lambda rid: (ids,), block_pool=pool))  # type: ignore[arg-type]
    return sched


def step(sched: TierCacheScheduler, req: SimpleNamespace, tokens: int) -> Any:
    return sched.build_connector_meta(SimpleNamespace(  # type: ignore[arg-type]
        num_scheduled_tokens={req.request_id: tokens}, finished_req_ids=set(), preempted_req_ids=None))


def produce_via_host(sched: TierCacheScheduler, tokens: list[int]) -> tuple[Any, dict[str, Any]]:
    """A via_host producer prefills ``tokens``: the store step's metadata and the hand-off params."""
    req = request(tokens, rid="p")
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # type: ignore[arg-type]
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([],)), 0)  # type: ignore[arg-type]
    meta = step(sched, req, len(tokens))
    (store,) = meta.stores
    sched.manager.complete_store(list(store.keys))
    req.status = _length_capped()
    _, params = sched.request_finished(req)  # type: ignore[arg-type]
    assert params is not None
    return meta, params


def _length_capped() -> Any:
    from vllm.v1.request import RequestStatus

    return RequestStatus.FINISHED_LENGTH_CAPPED


def test_via_host_producer_stores_the_tails_blocks_and_names_it_last_then_drops_it() -> None:
    sched = scheduler("kv_producer")
    meta, params = produce_via_host(sched, PROMPT)
    (store,) = meta.stores
    tail = prompt_tail(request(PROMPT), sched.keys, 64, BLOCK)
    assert tail is not None and store.keys[-1] == tail.key
    # two whole chunks of 2 blocks, then the tail's 2 blocks (the second holds 8 tokens)
    assert [s.block_ids for s in store.segments] == [(10, 11), (12, 13), (14, 15)]
    handoff = Handoff.from_params(params)
    assert handoff is not None and handoff.tail_tokens == 40 and handoff.tail_key == tail.key
    assert len(handoff.slots) == 3 and sched.pd is not None and sched.pd.held_chunks == 3
    sched.pd.handoffs_read({"p": {0}})
    assert sched.manager.lookup([tail.key]) == 0  # dropped: only a hand-off ever looks a tail up
    assert sched.manager.lookup(list(handoff.full_keys)) == 2  # the chunks stay, as ordinary cache


def test_direct_producer_holds_the_tails_blocks_with_the_chunks() -> None:
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(32, enable_caching=True, hash_block_size=BLOCK)
    sched = scheduler("kv_producer", mode="direct", pool=pool)
    assert sched.pd is not None
    blocks = [b.block_id for b in pool.get_new_blocks(6)]
    req = request(PROMPT, rid="d", status=_length_capped())
    _, params = sched.request_finished(req, (blocks,))  # type: ignore[arg-type]
    tail = prompt_tail(req, sched.keys, 64, BLOCK)
    handoff = Handoff.from_params(params or {})
    assert tail is not None and handoff is not None
    assert handoff.keys == (*sched.keys.chunk_keys(req.block_hashes), tail.key) and handoff.tail_tokens == 40
    assert handoff.blocks_of(2) == [tuple(blocks[0:2]), tuple(blocks[2:4]), tuple(blocks[4:6])]
    marks, _, _ = sched.pd.take_direct()
    assert marks["d"].keys[-1] == tail.key and marks["d"].blocks[-1] == tuple(blocks[4:6])  # tagged as the tail
    assert sched.pd.pinned_blocks == 6


def consume(sched: TierCacheScheduler, params: dict[str, Any], tokens: list[int]) -> tuple[int, Any]:
    """A consumer's lookup and load plan for ``tokens`` with a producer's params: (hit, the step's metadata)."""
    req = request(tokens, rid="c")
    req.kv_transfer_params = params
    hit, _ = sched.get_num_new_matched_tokens(req, 0)  # type: ignore[arg-type]
    assert hit is not None
    blocks = SimpleNamespace(get_block_ids=lambda: ([20, 21, 22, 23, 24, 25],))
    sched.update_state_after_alloc(req, blocks, hit)  # type: ignore[arg-type]
    req.num_computed_tokens = hit
    return hit, step(sched, req, len(tokens) - hit)


@pytest.mark.parametrize("mode", ["via_host", "direct"])
def test_consumer_loads_the_tail_and_leaves_only_the_last_token(mode: str) -> None:
    _, params = produce_via_host(scheduler("kv_producer"), PROMPT)
    if mode == "direct":  # the same keys, named by blocks: 2 per chunk, the tail's 2
        params = {**params, "remote_block_ids": [4, 5, 6, 7, 8, 9], "tiercache": {**params["tiercache"],
                                                                                   "mode": "direct"}}
    sched = scheduler("kv_consumer")
    hit, meta = consume(sched, params, PROMPT)
    assert hit == len(PROMPT) - 1
    (load,) = meta.loads
    assert [s.block_ids for s in load.segments] == [(20, 21), (22, 23), (24, 25)]
    assert load.keys[-1] == Handoff.from_params(params).tail_key  # type: ignore[union-attr]
    assert set(load.reader_sources()) == set(load.keys)
    if mode == "direct":
        assert load.reader_sources()[load.keys[-1]].blocks == (8, 9)


def test_consumer_whose_tail_differs_loads_the_chunks_and_computes_the_tail() -> None:
    """Same whole chunks, another last token: the producer's tail is not this prompt's."""
    _, params = produce_via_host(scheduler("kv_producer"), PROMPT)
    sched = scheduler("kv_consumer")
    hit, meta = consume(sched, params, PROMPT[:-1] + [999])
    assert hit == 128  # the two whole chunks only
    (load,) = meta.loads
    assert len(load.keys) == 2
    assert sched.pd is not None and sched.pd.counters["handoffs_refused"] == 0
