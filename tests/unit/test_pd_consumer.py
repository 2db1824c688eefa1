"""The P/D consumer's scheduler half without an engine: a mode-direct hand-off's load plan.

vLLM's request, block and scheduler-output objects are stood in for by plain
namespaces carrying the fields the connector reads (the real engine path is
tests/e2e/test_pd.py). Checks: a direct hand-off loads from tier ``peer`` (a direct tier)
with no host slot, the worker is told where each key lives,
``pd.keep_received`` decides whether those chunks are offered to the host tier
afterwards (only chunks read with their page hashes checked, mode via_host, unless
``pd.store_unverified``), and a prompt that is all whole chunks loads all of them (vLLM then
computes only its last token).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from tiercache.connector.engine_info import ChunkGeometry, EngineGeometry
from tiercache.connector.scheduler import TierCacheScheduler

from tiercache.config.schema import load_config
from tiercache.pd.handoff import Handoff
from tiercache.pd.peer_tier import PEER_TIER

BLOCK = 32
PROMPT = 4 * BLOCK + 8  # 4 full chunks (one block each) and a tail


def consumer(keep_received: bool, store_unverified: bool = False) -> TierCacheScheduler:
    config = load_config(chunk_tokens=BLOCK, tiers=[{"name": "cpu", "backend": "cpu", "capacity": "1MiB"}],
                         pd={"keep_received": keep_received, "store_unverified": store_unverified})
    engine = EngineGeometry(model="m", kv_dtype="torch.float32", kv_layout="NHD", block_size=BLOCK, tp_size=1,
                            world_size=1, bytes_per_block=4096, hash_algo="sha256")
    sched = TierCacheScheduler(config, ChunkGeometry.build(config, engine), kv_role="kv_consumer")
    sched.bind_kv_cache_manager(SimpleNamespace(get_block_ids=lambda rid: ([20, 21, 22, 23, 24],)))  # type: ignore[arg-type]
    return sched


def direct_request(sched: TierCacheScheduler, mode: str = "direct", prompt: int = PROMPT) -> Any:
    """A request with a producer's hand-off: its blocks (mode direct) or host slots (via_host) 7..10."""
    hashes = [bytes([i]) * 32 for i in range(4)]
    keys = tuple(sched.keys.chunk_keys(hashes))
    assert sched.pd is not None
    params = Handoff("prod", "127.0.0.1", 5700, "p-1", keys, (7, 8, 9, 10), sched.pd.fingerprint,
                     mode=mode).to_params()
    return SimpleNamespace(request_id="c-1", block_hashes=hashes, num_tokens=prompt, num_prompt_tokens=prompt,
                           num_computed_tokens=0, kv_transfer_params=params)


def load_then_step(sched: TierCacheScheduler, mode: str = "direct") -> tuple[Any, Any]:
    req = direct_request(sched, mode)
    hit, _async = sched.get_num_new_matched_tokens(req, 0)  # type: ignore[arg-type]
    assert hit == 4 * BLOCK
    blocks = SimpleNamespace(get_block_ids=lambda: ([20, 21, 22, 23, 24],))
    sched.update_state_after_alloc(req, blocks, hit)  # type: ignore[arg-type]
    req.num_computed_tokens = hit  # vLLM counts the loaded tokens; this step computes the last 8
    meta = sched.build_connector_meta(SimpleNamespace(  # type: ignore[arg-type]
        num_scheduled_tokens={"c-1": 8}, finished_req_ids=set(), preempted_req_ids=None))
    return req, meta


@pytest.mark.parametrize("keep_received", [True, False])
def test_direct_hand_off_loads_into_blocks_and_keep_received_decides_the_store(keep_received: bool) -> None:
    sched = consumer(keep_received, store_unverified=True)  # mode direct publishes no page hashes
    _req, meta = load_then_step(sched)
    (load,) = meta.loads
    assert [seg.slot for seg in load.segments] == [-1, -1, -1, -1]  # no host staging slot
    assert [seg.block_ids for seg in load.segments] == [(20,), (21,), (22,), (23,)]
    assert load.staging() == (PEER_TIER,) * 4
    assert [load.reader_sources()[k].blocks for k in load.keys] == [(7,), (8,), (9,), (10,)]
    # the loaded chunks are offered to the host tier (a copy out of the blocks) only when kept
    assert [len(s.keys) for s in meta.stores] == ([4] if keep_received else [])


def test_only_verified_hand_off_chunks_are_stored() -> None:
    """Mode direct (no page hashes) is not stored by default; via_host (hashes checked) is."""
    _req, meta = load_then_step(consumer(keep_received=True))
    assert meta.stores == []
    _req, meta = load_then_step(consumer(keep_received=True), mode="via_host")
    assert all(c.source.where.verify for c in meta.loads[0].chunks)
    assert [len(s.keys) for s in meta.stores] == [4]


def test_the_workers_peer_transfers_reach_the_transfer_metrics() -> None:
    """What NixlPeerTier timed (READ to tags checked) is exported per path, beside the load jobs."""
    from tiercache.connector.metadata import TierCacheWorkerMetadata
    from tiercache.connector.pd.step import PDWorkerReport

    sched = consumer(keep_received=False)
    report = TierCacheWorkerMetadata(pd=PDWorkerReport(transfers=[("peer_device_to_device", 4096, 0.002),
                                                                  ("peer_device_to_device", 8192, 0.003)]))
    sched.update_connector_output(report)
    metrics, path = sched.metrics, "peer_device_to_device"
    assert metrics.sample("tiercache_transfer_bytes_total", path=path) == 4096 + 8192
    assert metrics.sample("tiercache_transfer_seconds_count", path=path) == 2
    assert metrics.sample("tiercache_transfer_seconds_sum", path=path) == pytest.approx(0.005)


def test_a_via_host_hand_off_is_read_into_the_blocks_too() -> None:
    """No staging host slot for either producer mode: the READ lands in the blocks (from the producer's slots)."""
    sched = consumer(keep_received=False)
    _req, meta = load_then_step(sched, mode="via_host")
    (load,) = meta.loads
    assert [seg.slot for seg in load.segments] == [-1, -1, -1, -1]
    assert load.staging() == (PEER_TIER,) * 4
    assert [(load.reader_sources()[k].slot, load.reader_sources()[k].blocks) for k in load.keys] == [
        (7, ()), (8, ()), (9, ()), (10, ())]
    assert meta.stores == []


def test_a_prompt_of_whole_chunks_loads_them_all_and_leaves_one_token_to_compute() -> None:
    """As after NixlConnector's hand-off: 4 chunks of a 128-token prompt hit, vLLM is told 127 tokens.

    The last chunk's block loads whole; the forward pass of the last token writes its KV slot again.
    Before, the hit stopped at the last whole block below the last token (96 tokens: 32 recomputed).
    """
    sched = consumer(keep_received=False)
    req = direct_request(sched, prompt=4 * BLOCK)
    hit, _async = sched.get_num_new_matched_tokens(req, 0)  # type: ignore[arg-type]
    assert hit == 4 * BLOCK - 1
    blocks = SimpleNamespace(get_block_ids=lambda: ([20, 21, 22, 23],))
    sched.update_state_after_alloc(req, blocks, hit)  # type: ignore[arg-type]
    meta = sched.build_connector_meta(SimpleNamespace(  # type: ignore[arg-type]
        num_scheduled_tokens={"c-1": 1}, finished_req_ids=set(), preempted_req_ids=None))
    (load,) = meta.loads
    assert [seg.block_ids for seg in load.segments] == [(20,), (21,), (22,), (23,)]
    # vLLM's own local hit of the first three blocks: only the last chunk is loaded
    hit, _async = sched.get_num_new_matched_tokens(direct_request(sched, prompt=4 * BLOCK), 3 * BLOCK)  # type: ignore[arg-type]
    assert hit == BLOCK - 1
