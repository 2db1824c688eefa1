"""P/D between TP sizes without engines: real NIXL agents, real side channels, fake KV caches.

Pages shaped like vLLM 0.32 CPU's (``[blocks, heads, tokens, content]``, head-major),
2 global KV heads. A TP=1 producer's host slots (layout planes) are READ by the two
ranks of a TP=2 consumer, each taking its head's sub-run of every page; the producer
counts the hand-off read only once both ranks said so. Two TP=2 producer ranks are
READ by one TP=1 consumer, each into its head's offset of our pages. And mode direct
(the producer's KV blocks). Byte-exact, and the wrong-head hook breaks it.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest
import torch

pytest.importorskip("nixl._api")

from tests.integration.test_pd_channel import RELEASE_KEY, Stepper, wait_result
from tiercache.layout import KVBlockLayout, slab_planes
from tiercache.pd.auth import release_token
from tiercache.pd.blocks import BlockRegions
from tiercache.pd.heads import WRONG_HEAD_ENV, page_heads
from tiercache.pd.peer_tier import NixlPeerTier, PeerChunk, PeerSource
from tiercache.pd.producer import ProducerEndpoint
from tiercache.testing.ports import free_port
from tiercache.transfer.device import CopySegment

HEADS, BLOCKS, TOKENS, CONTENT, LAYERS = 2, 8, 32, 16, 2
BPC, SLOTS = 2, 3


def caches(tp: int, seed: int | None = None) -> dict[str, torch.Tensor]:
    shape = (BLOCKS, HEADS // tp, TOKENS, CONTENT)
    if seed is None:
        return {f"layer.{i}": torch.zeros(shape) for i in range(LAYERS)}
    g = torch.Generator().manual_seed(seed)
    return {f"layer.{i}": torch.randn(shape, generator=g) for i in range(LAYERS)}


def fp(tp: int, chunk_bytes: int) -> dict:
    return {"model": "m", "kv_dtype": "torch.float32", "chunk_tokens": 64, "kv_heads": HEADS,
            "tp_size": tp, "bytes_per_chunk": chunk_bytes, "shard_bytes": chunk_bytes * tp // HEADS}


class Producer:
    """One producer rank: a planes slab of random pages (mode direct: its KV blocks too)."""

    def __init__(self, tp: int, rank: int, port: int, direct: bool = False) -> None:
        self.kv = caches(tp, seed=10 + rank)
        layout = KVBlockLayout.from_kv_caches(self.kv, BLOCKS)
        self.slot = layout.slot_bytes(BPC)
        self.slab = torch.zeros((SLOTS, self.slot), dtype=torch.uint8)
        self.planes = slab_planes(self.slab, layout.page_bytes, BPC)
        for i, plane in enumerate(self.planes):
            g = torch.Generator().manual_seed(100 * rank + i)
            plane.copy_(torch.randint(0, 256, plane.shape, generator=g, dtype=torch.uint8))
        self.server = ProducerEndpoint(
            self.slab.data_ptr(), self.slot, SLOTS, fp(tp, self.slot), "127.0.0.1", port + rank,
            blocks=BlockRegions.from_layout(layout) if direct else None,
            slot_planes=BlockRegions.from_planes(self.planes),
            page_heads=page_heads(self.kv, BLOCKS, HEADS, tp, rank, HEADS // tp))
        self.server.set_holding(True)
        self.server.set_release_key(RELEASE_KEY)
        self.stepper = Stepper(self.server)

    def host_head(self, region: int, slot: int, pos: int, head: int) -> np.ndarray:
        page = self.planes[region][slot * BPC + pos].numpy()
        inner = page.size // (HEADS // tp_of(self))
        return page[head * inner:(head + 1) * inner]

    def block_head(self, region: int, block: int, head: int) -> np.ndarray:
        return self.kv[f"layer.{region}"][block, head].contiguous().view(torch.uint8).numpy().reshape(-1)

    def close(self) -> None:
        self.stepper.stop()
        self.server.close()


def tp_of(p: Producer) -> int:
    return HEADS // p.kv["layer.0"].shape[1]


class Consumer:
    def __init__(self, tp: int, rank: int) -> None:
        self.kv = caches(tp)
        layout = KVBlockLayout.from_kv_caches(self.kv, BLOCKS)
        self.peer = NixlPeerTier(layout.slot_bytes(BPC), fp(tp, layout.slot_bytes(BPC)), rank, read_timeout_s=3.0,
                                 max_blocks=BLOCKS)
        assert self.peer.wait_ready(60)
        self.peer.expose_blocks(BlockRegions.from_layout(layout))
        self.peer.page_heads = page_heads(self.kv, BLOCKS, HEADS, tp, rank, HEADS // tp)

    def head(self, region: int, block: int, head: int) -> np.ndarray:
        return self.kv[f"layer.{region}"][block, head].contiguous().view(torch.uint8).numpy().reshape(-1)


def ports(n: int) -> int:
    for _ in range(50):
        port = free_port()
        with contextlib.ExitStack() as stack:
            import socket
            try:
                for i in range(1, n):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port + i))
            except OSError:
                continue
        return port
    raise RuntimeError("no free ports")


def wait_read(stepper: Stepper, rid: str, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while rid not in stepper.read and time.monotonic() < deadline:
        time.sleep(0.01)
    return rid in stepper.read


KEYS = [b"k" * 15 + b"1", b"k" * 15 + b"2"]


def fill(producer: Producer, slots: list[int]) -> None:
    producer.server.slot_filling(slots)
    producer.server.slot_filled(KEYS[:len(slots)], slots)


def test_tp1_producer_read_by_both_ranks_of_a_tp2_consumer() -> None:
    port = ports(1)
    prod = Producer(1, 0, port)
    consumers = [Consumer(2, 0), Consumer(2, 1)]
    try:
        fill(prod, [2, 0])
        src = PeerSource("127.0.0.1", port, "req-1", tp_size=1, release_token=release_token(RELEASE_KEY, "req-1"))
        for rank, cons in enumerate(consumers):
            cons.peer.expect({KEYS[0]: PeerChunk(src, 2), KEYS[1]: PeerChunk(src, 0)})
            # second chunk partly (its first block computed by the consumer)
            cons.peer.submit_blocks(1, KEYS, [CopySegment(-1, 0, (4, 5)), CopySegment(-1, 1, (1,))])
            res = wait_result(cons.peer)
            assert res.ok and res.ok_keys == tuple(KEYS), res
            for r in range(LAYERS):
                assert np.array_equal(cons.head(r, 4, 0), prod.host_head(r, 2, 0, rank))
                assert np.array_equal(cons.head(r, 5, 0), prod.host_head(r, 2, 1, rank))
                assert np.array_equal(cons.head(r, 1, 0), prod.host_head(r, 0, 1, rank))
                assert not cons.head(r, 0, 0).any()  # untouched
            if rank == 0:  # one of the two consumer ranks read it: not released yet
                time.sleep(0.2)
                assert "req-1" not in prod.stepper.read
        assert wait_read(prod.stepper, "req-1")
    finally:
        for c in consumers:
            c.peer.close()
        prod.close()


@pytest.mark.parametrize("direct", [False, True], ids=["via_host", "direct"])
def test_tp2_producer_ranks_read_into_one_tp1_consumer(direct: bool) -> None:
    port = ports(2)
    prods = [Producer(2, 0, port, direct), Producer(2, 1, port, direct)]
    cons = Consumer(1, 0)
    try:
        src = PeerSource("127.0.0.1", port, "req-2", tp_size=2, release_token=release_token(RELEASE_KEY, "req-2"))
        if direct:
            for p in prods:
                p.server.hold_blocks("req-2", KEYS[:1], [(6, 3)])
            cons.peer.expect({KEYS[0]: PeerChunk(src, -1, (6, 3))})
        else:
            for p in prods:
                fill(p, [1])
            cons.peer.expect({KEYS[0]: PeerChunk(src, 1)})
        cons.peer.submit_blocks(1, KEYS[:1], [CopySegment(-1, 0, (2, 7))])
        res = wait_result(cons.peer)
        assert res.ok, res
        for r in range(LAYERS):
            for head, p in enumerate(prods):
                for pos, ours in enumerate((2, 7)):
                    theirs = p.block_head(r, (6, 3)[pos], 0) if direct else p.host_head(r, 1, pos, 0)
                    assert np.array_equal(cons.head(r, ours, head), theirs)
        assert all(wait_read(p.stepper, "req-2") for p in prods)
    finally:
        cons.peer.close()
        for p in prods:
            p.close()


def test_wrong_head_hook_reads_other_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WRONG_HEAD_ENV, "1")
    port = ports(1)
    prod = Producer(1, 0, port)
    cons = Consumer(2, 0)
    try:
        fill(prod, [0])
        cons.peer.expect({KEYS[0]: PeerChunk(PeerSource("127.0.0.1", port, "req-3", tp_size=1, release_token=release_token(RELEASE_KEY, "req-3")), 0)})
        cons.peer.submit_blocks(1, KEYS[:1], [CopySegment(-1, 0, (0, 1))])
        assert wait_result(cons.peer).ok  # tags fine: it is the bytes that are wrong
        assert np.array_equal(cons.head(0, 0, 0), prod.host_head(0, 0, 0, 1))
        assert not np.array_equal(cons.head(0, 0, 0), prod.host_head(0, 0, 0, 0))
    finally:
        cons.peer.close()
        prod.close()


def test_token_major_consumer_is_refused_and_recomputes() -> None:
    port = ports(1)
    prod = Producer(1, 0, port)
    cons = Consumer(2, 0)
    cons.peer.page_heads = page_heads({"l": torch.zeros((BLOCKS, TOKENS, 2, CONTENT))}, BLOCKS, HEADS, 2, 0, 2)
    try:
        fill(prod, [0])
        cons.peer.expect({KEYS[0]: PeerChunk(PeerSource("127.0.0.1", port, "req-4", tp_size=1, release_token=release_token(RELEASE_KEY, "req-4")), 0)})
        cons.peer.submit_blocks(1, KEYS[:1], [CopySegment(-1, 0, (0, 1))])
        res = wait_result(cons.peer)
        assert not res.ok and res.failed_keys == (KEYS[0],)
        assert cons.peer.counters["refused_peers"] == 1
    finally:
        cons.peer.close()
        prod.close()
