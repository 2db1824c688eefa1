"""The P/D data path without engines: a producer's endpoint and a consumer's peer tier.

Real NIXL agents (UCX, DRAM to DRAM on this machine) and a real loopback
side channel: the consumer reads chunks from the producer's host slab straight
into its own KV blocks (vLLM-shaped tensors), byte-exact, and the producer hears
about it on the side channel; a chunk whose copy has not finished is waited for; a slot
re-filled with another chunk is never served for the old one; a producer with
another fingerprint is refused naming the field; a dead producer fails the read
within the timeout; garbage on the side channel harms no one else.

A ``Stepper`` thread stands in for the engine's steps and calls ``service()``
every few milliseconds. With UCX error handling ``none`` (the default) a READ
needs nothing from the producer; with ``peer`` it moves only while the
producer's UCX is progressed (its progress thread, or ``service()``).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time

import numpy as np
import pytest
import torch

pytest.importorskip("nixl._api")

from tests.e2e.conftest import free_port
from tiercache.backend import JobResult
from tiercache.layout import KVBlockLayout, slab_planes
from tiercache.pd.auth import release_token
from tiercache.pd.blocks import BlockRegions
from tiercache.pd.channel import key_tag
from tiercache.pd.nixl_reads import TagMirror
from tiercache.pd.peer_tier import (
    PEER_DATA_READ,
    PEER_HOST_TO_DEVICE,
    NixlPeerTier,
    PeerChunk,
    PeerSource,
)
from tiercache.pd.producer import ProducerEndpoint
from tiercache.pd.tagged_reads import TaggedReader
from tiercache.transfer.device import CopySegment

BLOCKS = 16  # the consumer's KV cache: 2 layers of (K/V, blocks, 32 tokens, 2 heads, 16) float32
BPC = 2  # blocks per chunk
LAYOUT_PAGE = 32 * 2 * 16 * 4
SLOT = BPC * 4 * LAYOUT_PAGE  # 4 regions (2 layers x K/V) of BPC pages: 32 KiB
SLOTS = 8
FP = {"model": "m", "kv_dtype": "torch.float32", "chunk_tokens": 64}
RELEASE_KEY = b"r" * 32  # the producer scheduler's release key: read notices carry its tokens


class ConsumerKV:
    """A consumer's vLLM-shaped KV cache, and how a producer's slot maps onto its blocks."""

    def __init__(self) -> None:
        self.kv = {f"layer.{i}": torch.zeros((2, BLOCKS, 32, 2, 16)) for i in range(2)}
        self.layout = KVBlockLayout.from_kv_caches(self.kv, BLOCKS)
        assert self.layout.slot_bytes(BPC) == SLOT
        self.regions = BlockRegions.from_layout(self.layout)

    def holds(self, slot: torch.Tensor, blocks: tuple[int, ...], first: int = 0) -> bool:
        """Our ``blocks`` hold the slot's chunk (from position ``first``), byte for byte."""
        for region, page, base in zip(self.layout.regions, self.layout.page_bytes,
                                      self.layout.region_offsets(BPC)):
            for pos, block in enumerate(blocks, start=first):
                if not torch.equal(region[block], slot[base + pos * page: base + (pos + 1) * page]):
                    return False
        return True

    def untouched(self, blocks: tuple[int, ...]) -> bool:
        return all(int(region[list(blocks)].sum()) == 0 for region in self.layout.regions)


class Stepper:
    """Calls ``service()`` like engine steps would; collects the read notifications."""

    def __init__(self, endpoint: ProducerEndpoint) -> None:
        self.endpoint = endpoint
        self.read: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.read |= self.endpoint.service()
            time.sleep(0.002)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def wait_result(peer: NixlPeerTier, timeout: float = 30) -> JobResult:
    """The first finished job."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = peer.poll_blocks()
        if done:
            return done[0]
        time.sleep(0.01)
    raise AssertionError("no result")


@contextlib.contextmanager
def producer_and_consumer(in_planes: bool = False):  # type: ignore[no-untyped-def]
    """A producer endpoint over a fresh slab (layout planes: it announces them) and a consumer reading it."""
    prod_slab = torch.zeros((SLOTS, SLOT), dtype=torch.uint8)
    cons = ConsumerKV()
    planes = slab_planes(prod_slab, cons.layout.page_bytes, BPC) if in_planes else None
    port = free_port()
    server = ProducerEndpoint(prod_slab.data_ptr(), SLOT, SLOTS, FP, "127.0.0.1", port,
                              slot_planes=BlockRegions.from_planes(planes) if planes is not None else None)
    server.set_holding(True)  # the scheduler says hand-offs are held
    server.set_release_key(RELEASE_KEY)  # ... and sends its release key
    stepper = Stepper(server)
    peer = NixlPeerTier(SLOT, FP, rank=0, read_timeout_s=2.0, max_blocks=BLOCKS)
    assert peer.wait_ready(60)  # the vetter's start is not charged to the first read's 2 s
    peer.expose_blocks(cons.regions)
    try:
        yield prod_slab, planes, cons, server, peer, port, stepper
    finally:
        peer.close()
        stepper.stop()
        server.close()


@pytest.fixture
def pair():
    with producer_and_consumer() as (prod_slab, _planes, cons, server, peer, port, stepper):
        yield prod_slab, cons, server, peer, port, stepper


def into(*blocks: tuple[int, ...]) -> list[CopySegment]:
    """Each chunk into these consumer blocks (no host slot: slot -1)."""
    return [CopySegment(-1, 0, b) for b in blocks]


def chunk(port: int, slot: int, request_id: str = "r") -> PeerChunk:
    return PeerChunk(PeerSource("127.0.0.1", port, request_id, release_token=release_token(RELEASE_KEY, request_id)),
                     slot)


def test_consumer_reads_producer_slots_byte_exact_and_producer_is_notified(pair) -> None:
    prod, cons, server, peer, port, stepper = pair
    rng = np.random.default_rng(0)
    for s in (2, 5):
        prod[s] = torch.from_numpy(rng.integers(0, 256, SLOT, dtype=np.uint8))
    keys = [b"k" * 15 + b"1", b"k" * 15 + b"2"]
    server.slot_filling([2, 5])
    server.slot_filled(keys, [2, 5])
    peer.expect({keys[0]: chunk(port, 2, "req-7"), keys[1]: chunk(port, 5, "req-7")})
    peer.submit_blocks(1, keys, into((0, 1), (7, 3)))  # consecutive blocks, and not
    res = wait_result(peer)
    assert res.ok and res.bytes == 2 * SLOT
    assert cons.holds(prod[2], (0, 1)) and cons.holds(prod[5], (7, 3))
    assert cons.untouched((2, 4, 5, 6))
    assert [(p, n) for p, n, _ in peer.take_transfers()] == [(PEER_HOST_TO_DEVICE, 2 * SLOT),
                                                               (PEER_DATA_READ, 2 * SLOT)]
    deadline = time.monotonic() + 10
    while not stepper.read and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stepper.read == {"req-7"}  # (checked before req-z's notice can race it in)
    # a partial chunk: its first block was computed here, the second comes from the slot
    prod[6] = torch.from_numpy(rng.integers(0, 256, SLOT, dtype=np.uint8))
    server.slot_filled([b"z" * 16], [6])
    peer.expect({b"z" * 16: chunk(port, 6, "req-z")})
    peer.submit_blocks(2, [b"z" * 16], [CopySegment(-1, 1, (9,))])
    assert wait_result(peer).ok and cons.holds(prod[6], (9,), first=1) and cons.untouched((8, 10))


def read_during_a_long_step(pair) -> None:  # type: ignore[no-untyped-def]
    """A first read (handshake) while the engine steps, a second one while it runs no step at all."""
    prod, cons, server, peer, port, stepper = pair
    server.slot_filled([b"h" * 16], [2])
    peer.expect({b"h" * 16: chunk(port, 2, "req-h")})
    peer.submit_blocks(8, [b"h" * 16], into((0, 1)))
    assert wait_result(peer).ok  # handshake done while the engine was stepping
    stepper.stop()  # the engine is "inside a long step" from now on: no service() at all
    prod[3] = 9
    server.slot_filled([b"p" * 16], [3])
    peer.expect({b"p" * 16: chunk(port, 3, "req-p")})
    start = time.monotonic()
    peer.submit_blocks(9, [b"p" * 16], into((2, 3)))
    res = wait_result(peer)
    assert res.ok and cons.holds(prod[3], (2, 3)) and time.monotonic() - start < 1.5
    assert {"req-h", "req-p"} <= heard_reads(server, stepper, {"req-h", "req-p"})  # at the next steps


def test_a_read_needs_nothing_from_the_producer(pair) -> None:
    """Error handling none: one-sided transports; a READ completes during a long producer step.

    The producer makes no UCX call meanwhile (no step, no progress thread)."""
    assert pair[2]._progress is None
    read_during_a_long_step(pair)
    assert pair[3].counters["inline_jobs"] == 1  # the second read ran on the submitting thread


@pytest.fixture
def peer_mode_pair():
    """UCX with peer-failure handling (tcp here): the producer runs its progress thread."""
    prod_slab = torch.zeros((SLOTS, SLOT), dtype=torch.uint8)
    cons = ConsumerKV()
    port = free_port()
    server = ProducerEndpoint(prod_slab.data_ptr(), SLOT, SLOTS, FP, "127.0.0.1", port,
                              error_handling="peer", busy_progress=True)
    server.set_holding(True)
    server.set_release_key(RELEASE_KEY)
    stepper = Stepper(server)
    peer = NixlPeerTier(SLOT, FP, rank=0, read_timeout_s=2.0, error_handling="peer", max_blocks=BLOCKS)
    assert peer.wait_ready(60)
    peer.expose_blocks(cons.regions)
    yield prod_slab, cons, server, peer, port, stepper
    peer.close()
    stepper.stop()
    server.close()


def test_peer_mode_between_steps_the_progress_thread_moves_the_read(peer_mode_pair) -> None:
    """tcp: a long producer step, no service() call during the READ; the progress thread carries it."""
    read_during_a_long_step(peer_mode_pair)
    assert peer_mode_pair[3].counters["inline_jobs"] == 0  # tcp reads never run inline


def heard_reads(server: ProducerEndpoint, stepper: Stepper, want: set[str], timeout_s: float = 5.0) -> set[str]:
    """What the producer heard was read, by now or by its next steps (the side channel is a thread)."""
    heard, deadline = set(stepper.read), time.monotonic() + timeout_s
    while not want <= heard and time.monotonic() < deadline:
        heard |= server.service()
        time.sleep(0.01)
    return heard


TAG_READS = pytest.mark.parametrize("mirror", [True, False], ids=["tag-mirror", "tag-runs"])


def tag_reads(monkeypatch: pytest.MonkeyPatch, mirror: bool) -> None:
    """Tags READ as the producer's whole array by one reusable handle (small arrays), or run by run."""
    if not mirror:
        monkeypatch.setattr(TagMirror, "MAX_BYTES", 0)


@TAG_READS
def test_read_waits_for_a_copy_still_in_progress(pair, monkeypatch: pytest.MonkeyPatch, mirror: bool) -> None:
    tag_reads(monkeypatch, mirror)
    prod, cons, server, peer, port, _ = pair
    key = b"w" * 16
    server.slot_filling([1])
    peer.expect({key: chunk(port, 1, "req-w")})
    peer.submit_blocks(2, [key], into((4, 5)))
    time.sleep(0.3)
    prod[1] = 7
    server.slot_filled([key], [1])
    res = wait_result(peer)
    assert res.ok and cons.holds(prod[1], (4, 5)) and int(prod[1].sum()) == 7 * SLOT
    assert bool(peer._mirrors) == mirror


@TAG_READS
def test_a_copy_that_ends_during_the_data_read_is_read_again(pair, monkeypatch: pytest.MonkeyPatch,
                                                             mirror: bool) -> None:
    """The producer's copy into a slot ends, and its tag is set, while our data READ of that slot runs:
    what we read may be torn. The tags are read before the data and after it, so a chunk is read
    only once its tag names it. (Tags read only after the data accepted the zeros read mid-copy.)"""
    tag_reads(monkeypatch, mirror)
    prod, cons, server, peer, port, _ = pair
    key = b"t" * 16
    server.slot_filling([1])  # the copy into slot 1 runs: the slot still holds zeros
    lock, finished = threading.Lock(), threading.Event()

    def copy_ends() -> None:
        with lock:
            if not finished.is_set():
                prod[1] = 7
                server.slot_filled([key], [1])
                finished.set()

    original = TaggedReader._read_descs

    def data_read_then_the_copy_ends(self, link, local, *args, **kwargs):  # type: ignore[no-untyped-def]
        original(self, link, local, *args, **kwargs)
        if int(np.asarray(local)[:, 1].max()) > 64 * 8:  # a data READ (tags are 8 bytes each)
            copy_ends()

    monkeypatch.setattr(TaggedReader, "_read_descs", data_read_then_the_copy_ends)
    peer.expect({key: chunk(port, 1, "req-t")})
    peer.submit_blocks(3, [key], into((4, 5)))
    if not finished.wait(0.3):
        copy_ends()  # no data was read while the tag was 0: the copy ends now
    res = wait_result(peer)
    assert res.ok and cons.holds(prod[1], (4, 5)) and int(prod[1].sum()) == 7 * SLOT


@TAG_READS
def test_reused_slot_is_not_served_for_the_old_key(pair, monkeypatch: pytest.MonkeyPatch, mirror: bool) -> None:
    tag_reads(monkeypatch, mirror)
    _prod, cons, server, peer, port, _ = pair
    old, new = one_engines_keys(2)  # real chunk keys: they share their first bytes (the namespace digest)
    server.slot_filled([old], [4])
    server.slot_filling([4])  # a new copy into slot 4 begins: the old key is gone
    server.slot_filled([new], [4])  # ... and slot 4 now holds another chunk of the same engine
    peer.expect({old: chunk(port, 4)})
    start = time.monotonic()
    peer.submit_blocks(3, [old], into((0, 1)))
    res = wait_result(peer)
    assert res.failed_keys == (old,) and time.monotonic() - start < 5
    assert peer.counters["stale_chunks"] == 1 and peer.take_transfers() == []


def one_engines_keys(n: int) -> list[bytes]:
    """``n`` chunk keys as one engine makes them (one namespace, different prefixes)."""
    from tiercache.keys import KeySpace, Namespace

    space = KeySpace(Namespace("m", "torch.float32", "NHD", 32, 32, 1, 4096, "sha256"), 1)
    return space.chunk_keys([bytes([i]) * 32 for i in range(n)])


def test_one_engines_chunks_get_different_tags() -> None:
    keys = one_engines_keys(64)
    assert len({key_tag(k) for k in keys}) == 64 and 0 not in {key_tag(k) for k in keys}


def test_slot_outside_the_producer_slab_fails_cleanly(pair) -> None:
    _prod, cons, _server, peer, port, _ = pair
    peer.expect({b"o" * 16: chunk(port, SLOTS + 3)})
    peer.submit_blocks(7, [b"o" * 16], into((0, 1)))
    assert wait_result(peer).failed_keys == (b"o" * 16,)
    peer.expect({b"q" * 16: chunk(port, 0)})
    peer.submit_blocks(8, [b"q" * 16], into((BLOCKS - 1, BLOCKS)))  # our own block ids out of range
    assert wait_result(peer).failed_keys == (b"q" * 16,)


def test_incompatible_producer_is_refused_naming_the_field(pair, caplog) -> None:
    _prod, cons, server, _peer, port, _ = pair
    other = NixlPeerTier(SLOT, {**FP, "kv_dtype": "torch.bfloat16"}, rank=0, read_timeout_s=2.0, max_blocks=BLOCKS)
    other.expose_blocks(cons.regions)
    try:
        server.slot_filled([b"x" * 16], [0])
        other.expect({b"x" * 16: chunk(port, 0)})
        with caplog.at_level("ERROR"):
            other.submit_blocks(4, [b"x" * 16], into((0, 1)))
            res = wait_result(other)
        assert not res.ok
        assert other.counters["refused_peers"] == 1
        assert "kv_dtype" in caplog.text and "bfloat16" in caplog.text
    finally:
        other.close()


def test_dead_producer_fails_within_the_timeout(pair) -> None:
    _prod, cons, _server, peer, _port, _ = pair
    dead = free_port()
    peer.expect({b"d" * 16: chunk(dead, 0)})
    start = time.monotonic()
    peer.submit_blocks(5, [b"d" * 16], into((0, 1)))
    res = wait_result(peer)
    assert not res.ok and time.monotonic() - start < 5


def test_garbage_on_the_side_channel_harms_no_one(pair) -> None:
    prod, cons, server, peer, port, _ = pair
    for junk in (b"\xff\xff\xff\xff", struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1", b"GET / HTTP/1.0\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(junk)
            s.settimeout(2)
            try:
                s.recv(10)
            except OSError:
                pass
    prod[6] = 3
    server.slot_filled([b"g" * 16], [6])
    peer.expect({b"g" * 16: chunk(port, 6)})
    peer.submit_blocks(6, [b"g" * 16], into((12, 13)))
    assert wait_result(peer).ok and cons.holds(prod[6], (12, 13))


@pytest.fixture
def plane_pair():
    """A producer whose slab is in layout planes (the via_host default): it sends its planes."""
    with producer_and_consumer(in_planes=True) as (prod_slab, planes, cons, server, peer, port, _stepper):
        yield prod_slab, planes, cons, server, peer, port


def holds_planes(cons: ConsumerKV, planes: tuple[torch.Tensor, ...], slot: int, blocks: tuple[int, ...],
                 first: int = 0) -> bool:
    """Our ``blocks`` hold slot ``slot`` of a planes slab (from position ``first``), byte for byte."""
    return all(torch.equal(region[block], plane[slot * BPC + pos])
               for region, plane in zip(cons.layout.regions, planes)
               for pos, block in enumerate(blocks, start=first))


def test_planes_slab_reads_a_run_of_slots_in_one_descriptor_per_region(plane_pair) -> None:
    prod, planes, cons, server, peer, port = plane_pair
    prod.copy_(torch.from_numpy(np.random.default_rng(3).integers(0, 256, prod.shape, dtype=np.uint8)))
    keys = [bytes([65 + i]) * 16 for i in range(3)]
    server.slot_filled(keys, [3, 4, 5])
    peer.expect({k: chunk(port, s, "req-run") for k, s in zip(keys, (3, 4, 5))})
    peer.submit_blocks(1, keys, into((6, 7), (8, 9), (10, 11)))  # consecutive slots into consecutive blocks
    res = wait_result(peer)
    assert res.ok and res.bytes == 3 * SLOT
    assert all(holds_planes(cons, planes, s, b) for s, b in ((3, (6, 7)), (4, (8, 9)), (5, (10, 11))))
    assert peer.counters["data_descs"] == len(cons.layout.regions)  # 4, not 3 chunks x 4 regions
    assert cons.untouched((0, 1, 2, 3, 4, 5, 12, 13, 14, 15))
    # no run: slots apart, blocks out of order, and a partial chunk from position 1
    more = [b"x" * 16, b"y" * 16]
    server.slot_filled(more, [0, 7])
    peer.expect({more[0]: chunk(port, 0, "req-apart"), more[1]: chunk(port, 7, "req-apart")})
    peer.submit_blocks(2, more, [CopySegment(-1, 0, (3, 0)), CopySegment(-1, 1, (14,))])
    assert wait_result(peer).ok
    assert holds_planes(cons, planes, 0, (3, 0)) and holds_planes(cons, planes, 7, (14,), first=1)


def test_planes_that_do_not_match_our_blocks_fail_the_read(plane_pair) -> None:
    _prod, _planes, cons, server, _peer, port = plane_pair
    # a producer that announces planes of another page size (a broken or foreign producer)
    other_slab = torch.zeros((SLOTS, SLOT), dtype=torch.uint8)
    wrong = slab_planes(other_slab, [p * 2 for p in cons.layout.page_bytes], BPC // 2)
    bad_port = free_port()
    bad = ProducerEndpoint(other_slab.data_ptr(), SLOT, SLOTS, FP, "127.0.0.1", bad_port,
                           slot_planes=BlockRegions.from_planes(wrong))
    bad.set_holding(True)
    reader = NixlPeerTier(SLOT, FP, rank=0, read_timeout_s=2.0, max_blocks=BLOCKS)
    reader.expose_blocks(cons.regions)
    try:
        bad.slot_filled([b"m" * 16], [1])
        reader.expect({b"m" * 16: chunk(bad_port, 1)})
        reader.submit_blocks(1, [b"m" * 16], into((0, 1)))
        assert wait_result(reader).failed_keys == (b"m" * 16,)
        assert cons.untouched((0, 1))
    finally:
        reader.close()
        bad.close()
