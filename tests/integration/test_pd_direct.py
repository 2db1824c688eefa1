"""P/D mode direct without engines: a consumer READs a producer's KV blocks into its own.

Real NIXL agents and a real loopback side channel, as in test_pd_channel.py,
with fake paged KV caches shaped like vLLM's CPU attention cache
(``(2, num_blocks, block_size, heads, head_dim)`` per layer). The consumer
reads a chunk's blocks, byte-exact, into other block ids (a partial chunk too);
it waits for a hold its producer's worker has not marked yet; a hold released
and its blocks reused is never served; a hold never marked fails within the
read timeout; a producer not in mode direct, or with another KV layout, is
refused with a clear reason.
"""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("nixl._api")

from tests.integration.test_pd_channel import (
    FP,
    RELEASE_KEY,
    Stepper,
    one_engines_keys,
    wait_result,
)
from tiercache.backend import JobResult
from tiercache.layout import KVBlockLayout
from tiercache.pd.auth import release_token
from tiercache.pd.blocks import BlockRegions
from tiercache.pd.nixl_reads import TagMirror
from tiercache.pd.peer_tier import (
    PEER_DATA_READ,
    PEER_DEVICE_TO_DEVICE,
    NixlPeerTier,
    PeerChunk,
    PeerSource,
)
from tiercache.pd.producer import ProducerEndpoint
from tiercache.testing.ports import free_port
from tiercache.transfer.device import CopySegment

BLOCKS = 16
LAYERS = 3
SLOT = 4096
BPC = 2


def kv_caches(seed: int, heads: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer.{i}": torch.randn((2, BLOCKS, 32, heads, 16), generator=g) for i in range(LAYERS)}


def regions(kv: dict[str, torch.Tensor]) -> BlockRegions:
    return BlockRegions.from_layout(KVBlockLayout.from_kv_caches(kv, BLOCKS))


def wait_blocks(peer: NixlPeerTier) -> JobResult:
    return wait_result(peer)


def same_block(a: dict[str, torch.Tensor], ab: int, b: dict[str, torch.Tensor], bb: int) -> bool:
    return all(torch.equal(a[n][:, ab], b[n][:, bb]) for n in a)


@pytest.fixture
def direct():
    prod_kv, cons_kv = kv_caches(1), kv_caches(2)
    prod_slab = torch.zeros((2, SLOT), dtype=torch.uint8)
    port = free_port()
    server = ProducerEndpoint(prod_slab.data_ptr(), SLOT, 2, FP, "127.0.0.1", port, blocks=regions(prod_kv))
    server.set_release_key(RELEASE_KEY)
    stepper = Stepper(server)
    peer = NixlPeerTier(SLOT, FP, rank=0, read_timeout_s=1.5, max_blocks=BLOCKS)
    assert peer.wait_ready(60)  # the vetter's start is not charged to the first read
    peer.expose_blocks(regions(cons_kv))
    yield prod_kv, cons_kv, server, peer, port, stepper
    peer.close()
    stepper.stop()
    server.close()


def src(port: int, rid: str) -> PeerSource:
    return PeerSource("127.0.0.1", port, rid, release_token=release_token(RELEASE_KEY, rid))


def test_blocks_arrive_byte_exact_in_other_block_ids_and_the_producer_hears(direct) -> None:
    prod, cons, server, peer, port, stepper = direct
    keys = [b"a" * 16, b"b" * 16]
    server.hold_blocks("req-1", keys, [(3, 4), (9, 5)])
    s = src(port, "req-1")
    peer.expect({keys[0]: PeerChunk(s, -1, (3, 4)), keys[1]: PeerChunk(s, -1, (9, 5))})
    # the second chunk partly: the consumer computed its first block itself
    peer.submit_blocks(1, keys, [CopySegment(-1, 0, (0, 1)), CopySegment(-1, 1, (12,))])
    res = wait_blocks(peer)
    assert res.ok and res.ok_keys == tuple(keys)
    page = sum(regions(prod).pages)
    assert res.bytes == 3 * page
    assert same_block(prod, 3, cons, 0) and same_block(prod, 4, cons, 1) and same_block(prod, 5, cons, 12)
    assert not same_block(prod, 9, cons, 11)  # untouched
    # the transfer metrics: the READ of what arrived, once (the worker hands it to the metrics), and
    # its data READ alone (the same bytes, read once, in part of that time)
    [(path, moved, secs), (data_path, data_bytes, data_secs)] = peer.take_transfers()
    assert path == PEER_DEVICE_TO_DEVICE and moved == 3 * page and secs > 0
    assert data_path == PEER_DATA_READ and data_bytes == moved and 0 < data_secs <= secs
    assert peer.take_transfers() == []
    deadline = time.monotonic() + 10
    while "req-1" not in stepper.read and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "req-1" in stepper.read
    assert server.release_blocks("req-1") and not server.release_blocks("req-1")
    assert int(server.block_tags[[3, 4, 9, 5]].sum()) == 0


@pytest.mark.parametrize("mirror", [True, False], ids=["tag-mirror", "tag-runs"])
def test_read_waits_for_the_hold_to_be_marked(direct, monkeypatch: pytest.MonkeyPatch, mirror: bool) -> None:
    if not mirror:  # tags READ run by run, not as the producer's whole array
        monkeypatch.setattr(TagMirror, "MAX_BYTES", 0)
    """The consumer may read before the producer's worker marked the hold.

    The link exists already (a first read), so the read is tried inline first; it meets
    a tag of 0 and goes to the I/O thread, which waits for the mark.
    """
    prod, cons, server, peer, port, _ = direct
    server.hold_blocks("req-0", [b"0" * 16], [(0, 1)])
    peer.expect({b"0" * 16: PeerChunk(src(port, "req-0"), -1, (0, 1))})
    peer.submit_blocks(1, [b"0" * 16], [CopySegment(-1, 0, (0, 1))])
    assert wait_blocks(peer).ok and peer.counters["inline_jobs"] == 0  # a handshake: on the I/O thread
    key = b"w" * 16
    peer.expect({key: PeerChunk(src(port, "req-w"), -1, (6, 7))})
    peer.submit_blocks(2, [key], [CopySegment(-1, 0, (2, 3))])
    time.sleep(0.3)
    server.hold_blocks("req-w", [key], [(6, 7)])
    res = wait_blocks(peer)
    assert res.ok and same_block(prod, 6, cons, 2) and same_block(prod, 7, cons, 3)
    assert peer.counters["inline_jobs"] == 0  # it had to wait: not inline
    server.hold_blocks("req-i", [b"i" * 16], [(12, 13)])
    peer.expect({b"i" * 16: PeerChunk(src(port, "req-i"), -1, (12, 13))})
    peer.submit_blocks(3, [b"i" * 16], [CopySegment(-1, 0, (14, 15))])
    assert peer.counters["inline_jobs"] == 1  # done before submit_blocks returned
    assert wait_blocks(peer).ok and same_block(prod, 12, cons, 14) and same_block(prod, 13, cons, 15)


@pytest.mark.parametrize("mirror", [True, False], ids=["tag-mirror", "tag-runs"])
def test_released_and_reused_blocks_are_not_served(direct, monkeypatch: pytest.MonkeyPatch, mirror: bool) -> None:
    if not mirror:  # tags READ run by run, not as the producer's whole array
        monkeypatch.setattr(TagMirror, "MAX_BYTES", 0)
    _prod, _cons, server, peer, port, _ = direct
    old, new = one_engines_keys(2)  # real chunk keys: they share their first bytes (the namespace digest)
    server.hold_blocks("old", [old], [(1, 2)])
    server.release_blocks("old")
    server.hold_blocks("new", [new], [(1, 2)])  # vLLM gave the blocks to another hand-off
    peer.expect({old: PeerChunk(src(port, "old"), -1, (1, 2))})
    peer.submit_blocks(3, [old], [CopySegment(-1, 0, (4, 5))])
    res = wait_blocks(peer)
    assert res.failed_keys == (old,) and peer.counters["stale_chunks"] == 1
    assert peer.take_transfers() == []  # a stale chunk counts as no transfer


def test_a_hold_never_marked_fails_within_the_timeout(direct) -> None:
    _prod, _cons, _server, peer, port, _ = direct
    peer.expect({b"x" * 16: PeerChunk(src(port, "gone"), -1, (8, 10))})
    start = time.monotonic()
    peer.submit_blocks(4, [b"x" * 16], [CopySegment(-1, 0, (6, 7))])
    res = wait_blocks(peer)
    assert res.failed_keys == (b"x" * 16,) and time.monotonic() - start < 5


def test_block_ids_outside_the_producer_cache_fail_cleanly(direct) -> None:
    _prod, _cons, server, peer, port, _ = direct
    peer.expect({b"z" * 16: PeerChunk(src(port, "z"), -1, (BLOCKS + 1, 2))})
    peer.submit_blocks(5, [b"z" * 16], [CopySegment(-1, 0, (6, 7))])
    assert wait_blocks(peer).failed_keys == (b"z" * 16,)


def test_producer_not_in_mode_direct_is_a_clear_failure(caplog) -> None:
    slab = torch.zeros((2, SLOT), dtype=torch.uint8)
    port = free_port()
    server = ProducerEndpoint(slab.data_ptr(), SLOT, 2, FP, "127.0.0.1", port)  # no expose_blocks
    stepper = Stepper(server)
    peer = NixlPeerTier(SLOT, FP, rank=0, read_timeout_s=1.0, max_blocks=BLOCKS)
    peer.expose_blocks(regions(kv_caches(3)))
    try:
        peer.expect({b"q" * 16: PeerChunk(src(port, "q"), -1, (1, 2))})
        with caplog.at_level("WARNING"):
            peer.submit_blocks(6, [b"q" * 16], [CopySegment(-1, 0, (1, 2))])
            assert not wait_blocks(peer).ok
        assert "exposes no KV blocks" in caplog.text
    finally:
        peer.close()
        stepper.stop()
        server.close()


def test_producer_with_another_kv_layout_is_refused(direct, caplog) -> None:
    _prod, _cons, server, _peer, port, _ = direct
    other = NixlPeerTier(SLOT, FP, rank=0, read_timeout_s=1.0, max_blocks=BLOCKS)
    other.expose_blocks(regions(kv_caches(4, heads=4)))  # twice the page size
    try:
        server.hold_blocks("l", [b"l" * 16], [(1, 2)])
        other.expect({b"l" * 16: PeerChunk(src(port, "l"), -1, (1, 2))})
        with caplog.at_level("ERROR"):
            other.submit_blocks(7, [b"l" * 16], [CopySegment(-1, 0, (1, 2))])
            assert not wait_blocks(other).ok
        assert other.counters["refused_peers"] == 1 and "page bytes" in caplog.text
    finally:
        other.close()
