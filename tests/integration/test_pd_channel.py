"""The P/D data path without engines: a producer's endpoint and a consumer's peer tier.

Real NIXL agents (UCX, DRAM to DRAM on this machine) and a real loopback
side channel: the consumer reads chunks from the producer's host slab into its
own slots, byte-exact, and the producer hears about it through the NIXL
notification; a chunk whose copy has not finished is waited for; a slot
re-filled with another chunk is never served for the old one; a producer with
another fingerprint is refused naming the field; a dead producer fails the read
within the timeout; garbage on the side channel harms no one else.

A ``Stepper`` thread stands in for the engine's steps and calls ``service()``
every few milliseconds. With UCX error handling ``none`` (the default) a READ
needs nothing from the producer; with ``peer`` it moves only while the
producer's UCX is progressed (its progress thread, or ``service()``).
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import numpy as np
import pytest
import torch

pytest.importorskip("nixl._api")

from tiercache.backend import JobResult  # noqa: E402
from tiercache.backends.nixl_peer import PEER_TO_HOST, NixlPeerTier, PeerChunk, PeerSource  # noqa: E402
from tiercache.pd_channel import ProducerEndpoint  # noqa: E402
from tests.e2e.conftest import free_port  # noqa: E402

SLOT = 64 * 1024
SLOTS = 8
FP = {"model": "m", "kv_dtype": "torch.float32", "chunk_tokens": 128}


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


def wait_result(peer: NixlPeerTier, timeout: float = 30, blocks: bool = False) -> JobResult:
    """The first finished job (``blocks``: a mode-direct one)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = peer.poll_blocks() if blocks else peer.poll()
        if done:
            return done[0]
        time.sleep(0.01)
    raise AssertionError("no result")


@pytest.fixture
def pair():
    prod_slab = torch.zeros((SLOTS, SLOT), dtype=torch.uint8)
    cons_slab = torch.zeros((SLOTS, SLOT), dtype=torch.uint8)
    port = free_port()
    server = ProducerEndpoint(prod_slab.data_ptr(), SLOT, SLOTS, FP, "127.0.0.1", port)
    server.set_holding(True)  # the scheduler says hand-offs are held
    stepper = Stepper(server)
    peer = NixlPeerTier(cons_slab.data_ptr(), cons_slab.numel(), SLOT, FP, rank=0, read_timeout_s=2.0)
    yield prod_slab, cons_slab, server, peer, port, stepper
    peer.close()
    stepper.stop()
    server.close()


def views(slab: torch.Tensor, slots: list[int]) -> list[memoryview]:
    rows = slab.numpy()
    return [memoryview(rows[s]) for s in slots]


def chunk(port: int, slot: int, request_id: str = "r") -> PeerChunk:
    return PeerChunk(PeerSource("127.0.0.1", port, request_id), slot)


def test_consumer_reads_producer_slots_byte_exact_and_producer_is_notified(pair) -> None:
    prod, cons, server, peer, port, stepper = pair
    rng = np.random.default_rng(0)
    for s in (2, 5):
        prod[s] = torch.from_numpy(rng.integers(0, 256, SLOT, dtype=np.uint8))
    keys = [b"k" * 15 + b"1", b"k" * 15 + b"2"]
    server.slot_filling([2, 5])
    server.slot_filled(keys, [2, 5])
    peer.expect({keys[0]: chunk(port, 2, "req-7"), keys[1]: chunk(port, 5, "req-7")})
    peer.submit_get(1, keys, views(cons, [0, 3]))
    res = wait_result(peer)
    assert res.ok and res.bytes == 2 * SLOT
    assert torch.equal(cons[0], prod[2]) and torch.equal(cons[3], prod[5])
    assert [(p, n) for p, n, _ in peer.take_transfers()] == [(PEER_TO_HOST, 2 * SLOT)]
    deadline = time.monotonic() + 10
    while not stepper.read and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stepper.read == {"req-7"}


def read_during_a_long_step(pair) -> None:  # type: ignore[no-untyped-def]
    """A first read (handshake) while the engine steps, a second one while it runs no step at all."""
    prod, cons, server, peer, port, stepper = pair
    server.slot_filled([b"h" * 16], [2])
    peer.expect({b"h" * 16: chunk(port, 2, "req-h")})
    peer.submit_get(8, [b"h" * 16], views(cons, [0]))
    assert wait_result(peer).ok  # handshake done while the engine was stepping
    stepper.stop()  # the engine is "inside a long step" from now on: no service() at all
    prod[3] = 9
    server.slot_filled([b"p" * 16], [3])
    peer.expect({b"p" * 16: chunk(port, 3, "req-p")})
    start = time.monotonic()
    peer.submit_get(9, [b"p" * 16], views(cons, [1]))
    res = wait_result(peer)
    assert res.ok and int(cons[1].sum()) == 9 * SLOT and time.monotonic() - start < 1.5
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
    cons_slab = torch.zeros((SLOTS, SLOT), dtype=torch.uint8)
    port = free_port()
    server = ProducerEndpoint(prod_slab.data_ptr(), SLOT, SLOTS, FP, "127.0.0.1", port,
                              error_handling="peer", busy_progress=True)
    server.set_holding(True)
    stepper = Stepper(server)
    peer = NixlPeerTier(cons_slab.data_ptr(), cons_slab.numel(), SLOT, FP, rank=0, read_timeout_s=2.0,
                        error_handling="peer")
    yield prod_slab, cons_slab, server, peer, port, stepper
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


def test_read_waits_for_a_copy_still_in_progress(pair) -> None:
    prod, cons, server, peer, port, _ = pair
    key = b"w" * 16
    server.slot_filling([1])
    peer.expect({key: chunk(port, 1, "req-w")})
    peer.submit_get(2, [key], views(cons, [1]))
    time.sleep(0.3)
    prod[1] = 7
    server.slot_filled([key], [1])
    res = wait_result(peer)
    assert res.ok and int(cons[1].sum()) == 7 * SLOT


def test_reused_slot_is_not_served_for_the_old_key(pair) -> None:
    _prod, cons, server, peer, port, _ = pair
    server.slot_filled([b"a" * 16], [4])
    server.slot_filling([4])  # a new copy into slot 4 begins: the old key is gone
    server.slot_filled([b"b" * 16], [4])  # ... and slot 4 now holds another chunk
    peer.expect({b"a" * 16: chunk(port, 4)})
    start = time.monotonic()
    peer.submit_get(3, [b"a" * 16], views(cons, [0]))
    res = wait_result(peer)
    assert res.failed_keys == (b"a" * 16,) and time.monotonic() - start < 5
    assert int(cons[0].sum()) == 0  # nothing was copied into the consumer's slot


def test_slot_outside_the_producer_slab_fails_cleanly(pair) -> None:
    _prod, cons, _server, peer, port, _ = pair
    peer.expect({b"o" * 16: chunk(port, SLOTS + 3)})
    peer.submit_get(7, [b"o" * 16], views(cons, [0]))
    assert wait_result(peer).failed_keys == (b"o" * 16,)


def test_incompatible_producer_is_refused_naming_the_field(pair, caplog) -> None:
    _prod, cons, server, _peer, port, _ = pair
    other = NixlPeerTier(cons.data_ptr(), cons.numel(), SLOT, {**FP, "kv_dtype": "torch.bfloat16"},
                         rank=0, read_timeout_s=2.0)
    try:
        server.slot_filled([b"x" * 16], [0])
        other.expect({b"x" * 16: chunk(port, 0)})
        with caplog.at_level("ERROR"):
            other.submit_get(4, [b"x" * 16], views(cons, [0]))
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
    peer.submit_get(5, [b"d" * 16], views(cons, [0]))
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
    peer.submit_get(6, [b"g" * 16], views(cons, [2]))
    assert wait_result(peer).ok and torch.equal(cons[2], prod[6])
