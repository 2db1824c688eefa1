"""P/D mode direct with a hybrid model: each key names every KV-cache group's blocks, NO_BLOCK where none.

connector/pd/direct_blocks.py picks them from the request's tables (a window
group's null blocks become NO_BLOCK, a tail's positions past its tokens too);
the scheduler role holds, pins and hands them off on a real vLLM block pool;
the params validate and split per key on the consumer's side; the producer
never tags a NO_BLOCK (numpy would take -1 as the last block); a consumer
position naming one fails the read instead of reading the wrong block.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from tiercache.connector.pd.direct_blocks import NO_BLOCK, key_blocks

from tiercache.pd.channel import ChannelError, key_tag
from tiercache.pd.handoff import Handoff, HandoffError

NULL = 0  # vLLM's null block id


def test_one_group_names_the_chunks_blocks_as_before() -> None:
    held, tail = key_blocks([[1, 2, 3, 4, 5]], chunks=2, bpc=2, tail_blocks=1, null_block=NULL)
    assert held == [(1, 2), (3, 4), (5,)] and tail
    held, tail = key_blocks([[1, 2, 3]], chunks=2, bpc=2, tail_blocks=1, null_block=NULL)
    assert held == [(1, 2)] and not tail  # the table ends inside the second chunk: no tail either


def test_a_hybrid_key_names_every_groups_blocks_group_major_with_no_block_for_freed_ones() -> None:
    full, window = [1, 2, 3, 4, 5], [NULL, NULL, 7, 8, 9]  # the window group freed its first two
    held, tail = key_blocks([full, window], chunks=2, bpc=2, tail_blocks=1, null_block=NULL)
    assert held == [(1, 2, NO_BLOCK, NO_BLOCK), (3, 4, 7, 8), (5, NO_BLOCK, 9, NO_BLOCK)] and tail
    held, tail = key_blocks([full, window[:3]], chunks=2, bpc=2, tail_blocks=1, null_block=NULL)
    assert held == [(1, 2, NO_BLOCK, NO_BLOCK)] and not tail  # as many chunks as every group covers


def hybrid_direct_producer():  # type: ignore[no-untyped-def]
    """A mode-direct producer of a full + sliding-window model on a real vLLM block pool."""
    pytest.importorskip("vllm")
    from tiercache.connector.block_pins import VllmBlockPins
    from tiercache.connector.pd.scheduler_role import PDScheduler
    from vllm.v1.core.block_pool import BlockPool

    from tiercache.config.schema import PDConfig
    from tiercache.keys import KeySpace, Namespace
    from tiercache.manager.directory import TierSpec
    from tiercache.manager.offloading import OffloadingManager

    ns = Namespace("m", "torch.float32", "NHD", 32, 64, 1, 4096, "sha256", kv_groups="full,sliding_window:64")
    pd = PDScheduler(PDConfig(mode="direct", handoff_timeout_s=5), "kv_producer", KeySpace(ns, 2),
                     OffloadingManager([TierSpec("cpu", 4)]), chunk_tokens=64, engine_id="e", tp_size=1,
                     blocks_per_chunk=2)
    pd.bind_pins(VllmBlockPins(BlockPool(32, enable_caching=True, hash_block_size=32)))
    return pd


def test_the_producer_holds_pins_and_hands_off_every_groups_blocks() -> None:
    from vllm.v1.request import RequestStatus

    pd = hybrid_direct_producer()
    pool = pd.pins.pool
    full = [b.block_id for b in pool.get_new_blocks(5)]
    window = [NULL, NULL] + [b.block_id for b in pool.get_new_blocks(3)]
    req = SimpleNamespace(request_id="h", kv_transfer_params={"do_remote_decode": True}, num_prompt_tokens=140,
                          prompt_token_ids=list(range(140)),
                          block_hashes=[bytes([i]) * 32 for i in range(4)],
                          status=RequestStatus.FINISHED_LENGTH_CAPPED)
    pd.mark_prefill(req, (full, window))
    marks, _, _ = pd.take_direct()
    expected = [(full[0], full[1], NO_BLOCK, NO_BLOCK), (full[2], full[3], window[2], window[3]),
                (full[4], NO_BLOCK, window[4], NO_BLOCK)]
    assert list(marks["h"].blocks) == expected and marks["h"].tail_tokens == 12
    _, params = pd.request_finished(req, (full, window))  # type: ignore[arg-type]
    assert params is not None and params["remote_block_ids"] == [b for k in expected for b in k]
    pd.pins.unpin(full + window[2:])  # vLLM frees the request at once: our pins keep the named blocks
    assert [pd.pins.refs(b) for b in full + window[2:]] == [1] * 8 and pd.pinned_blocks == 8
    handoff = Handoff.from_params(params)
    assert handoff is not None and handoff.blocks_of(4) == expected  # the consumer's split: groups * bpc


def test_params_allow_no_block_only_for_a_hybrid_direct_hand_off() -> None:
    pd = hybrid_direct_producer()
    params = Handoff(engine_id="e", host="127.0.0.1", port=5000, request_id="r", keys=(b"k" * 32,),
                     slots=(3, 4, NO_BLOCK, NO_BLOCK), fingerprint=dict(pd.fingerprint), mode="direct").to_params()
    assert Handoff.from_params(params) is not None
    for bad in ([3, 4, NO_BLOCK, -2], [3, 4, NO_BLOCK]):  # below NO_BLOCK; one group's worth short
        with pytest.raises(HandoffError, match="remote_block_ids"):
            Handoff.from_params({**params, "remote_block_ids": bad})
    one_group = {**params["tiercache"]["fingerprint"], "kv_groups": ""}
    with pytest.raises(HandoffError, match="remote_block_ids"):  # one group: never a NO_BLOCK
        Handoff.from_params({**params, "remote_block_ids": [3, NO_BLOCK],
                             "tiercache": {**params["tiercache"], "fingerprint": one_group}})


def test_the_producer_never_tags_a_no_block_and_the_consumer_never_reads_one() -> None:
    pytest.importorskip("nixl._api")
    from tiercache.pd.blocks import BlockRegions
    from tiercache.pd.peer_chunks import PeerChunk, PeerSource
    from tiercache.pd.producer import ProducerEndpoint
    from tiercache.pd.read_plans import _source_blocks
    from tiercache.transfer.device import CopySegment

    endpoint = SimpleNamespace(block_tags=np.zeros(8, dtype=np.uint64), _held_blocks={},
                               release_blocks=lambda rid: False)
    ProducerEndpoint.hold_blocks(endpoint, "r", [b"k" * 32], [(3, 4, NO_BLOCK, NO_BLOCK)])  # type: ignore[arg-type]
    assert endpoint.block_tags[7] == 0 and list(endpoint.block_tags[3:5]) == [key_tag(b"k" * 32)] * 2
    link = SimpleNamespace(address="producer:1")
    theirs = BlockRegions((0,), (4096,), (4096,), 8, "DRAM", 0)
    chunk = PeerChunk(PeerSource("127.0.0.1", 1, "r"), -1, (3, 4, NO_BLOCK, 6))
    assert _source_blocks(link, theirs, [CopySegment(0, 0, (10, 11))], [chunk]) == [[3, 4]]  # type: ignore[arg-type]
    assert _source_blocks(link, theirs, [CopySegment(0, 3, (12,))], [chunk]) == [[6]]  # type: ignore[arg-type]
    with pytest.raises(ChannelError, match="no block"):
        _source_blocks(link, theirs, [CopySegment(0, 2, (12, 13))], [chunk])  # type: ignore[arg-type]
