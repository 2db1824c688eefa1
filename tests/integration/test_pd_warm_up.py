"""The P/D consumer's start-up warm-up (``pd.warm_up_s``): handshake and READs before any hand-off.

Real NIXL agents and a real loopback side channel, no engines (the rig of
test_pd_channel.py). A warmed-up consumer's first hand-off from that producer
runs inline on the submitting thread, as only a read from a producer already
shaken hands with can; without the warm-up the same first read goes to the
I/O thread (the control). A producer that comes up late is waited for; one
that refuses us, or does not prove the secret, is known before any request
meets it; closing the consumer ends a warm-up that is still waiting.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

pytest.importorskip("nixl._api")

from tests.e2e.conftest import free_port
from tests.integration.test_pd_channel import (
    BLOCKS,
    FP,
    RELEASE_KEY,
    SLOT,
    SLOTS,
    ConsumerKV,
    chunk,
    into,
    producer_and_consumer,
    wait_result,
)
from tiercache.pd.peer_tier import NixlPeerTier
from tiercache.pd.producer import ProducerEndpoint


def wait_for(condition, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def first_read_runs_inline(warm_up: bool) -> tuple[bool, dict[str, int]]:
    """One hand-off from a fresh producer; whether it ran inline, and the reader's counters."""
    with producer_and_consumer() as (prod, _planes, cons, server, peer, port, _stepper):
        if warm_up:
            peer.warm_up([("127.0.0.1", port)], for_s=20)
            wait_for(lambda: peer.counters["warmed_peers"] == 1)
            assert peer._reads.mirrors, "the warm-up made no tag mirror"
        prod[4] = torch.from_numpy(np.random.default_rng(1).integers(0, 256, SLOT, dtype=np.uint8))
        server.slot_filled([b"f" * 16], [4])
        peer.expect({b"f" * 16: chunk(port, 4, "req-f")})
        peer.submit_blocks(1, [b"f" * 16], into((2, 3)))
        result = wait_result(peer)
        assert result.ok and cons.holds(prod[4], (2, 3))
        return peer.counters["inline_jobs"] == 1, dict(peer.counters)


def test_a_warmed_up_consumers_first_hand_off_needs_no_handshake() -> None:
    inline, counters = first_read_runs_inline(warm_up=True)
    assert inline, counters
    assert counters["hello_retries"] == 0 and counters["refused_peers"] == 0


def test_control_without_the_warm_up_the_first_hand_off_shakes_hands_on_the_io_thread() -> None:
    inline, counters = first_read_runs_inline(warm_up=False)
    assert not inline and counters["warmed_peers"] == 0, counters


def test_a_producer_that_starts_later_is_warmed_up_when_it_answers() -> None:
    port = free_port()
    peer = NixlPeerTier(SLOT, FP, rank=1, read_timeout_s=2.0, max_blocks=BLOCKS)
    peer.expose_blocks(ConsumerKV().regions)
    slab = torch.zeros((SLOTS, SLOT), dtype=torch.uint8)
    server = None
    try:
        peer.warm_up([("127.0.0.1", port)], for_s=30)  # rank 1 reads producer rank 1: port + 1
        time.sleep(2.5)  # nobody listens: a few refused connections
        assert peer.counters["warmed_peers"] == 0
        server = ProducerEndpoint(slab.data_ptr(), SLOT, SLOTS, FP, "127.0.0.1", port + 1)
        server.set_release_key(RELEASE_KEY)
        wait_for(lambda: peer.counters["warmed_peers"] == 1)
        assert ("127.0.0.1", port + 1) in peer._links
    finally:
        peer.close()
        if server is not None:
            server.close()


def test_an_incompatible_producer_is_refused_at_the_warm_up_not_at_a_request(caplog) -> None:
    with producer_and_consumer() as (_prod, _planes, cons, server, _peer, port, _stepper):
        other = NixlPeerTier(SLOT, {**FP, "kv_dtype": "torch.bfloat16"}, rank=0, read_timeout_s=2.0,
                             max_blocks=BLOCKS)
        other.expose_blocks(cons.regions)
        try:
            with caplog.at_level("ERROR"):
                other.warm_up([("127.0.0.1", port)], for_s=20)
                wait_for(lambda: other.counters["refused_peers"] == 1)
            assert "kv_dtype" in caplog.text and other.counters["warmed_peers"] == 0
            server.slot_filled([b"x" * 16], [0])
            other.expect({b"x" * 16: chunk(port, 0)})
            start = time.monotonic()
            other.submit_blocks(3, [b"x" * 16], into((0, 1)))
            assert not wait_result(other).ok and time.monotonic() - start < 1.0  # remembered: no new handshake
        finally:
            other.close()


def test_a_producer_without_our_secret_is_counted_at_the_warm_up() -> None:
    slab = torch.zeros((SLOTS, SLOT), dtype=torch.uint8)
    port = free_port()
    server = ProducerEndpoint(slab.data_ptr(), SLOT, SLOTS, FP, "127.0.0.1", port, key=b"p" * 32)
    peer = NixlPeerTier(SLOT, FP, rank=0, read_timeout_s=2.0, max_blocks=BLOCKS, key=b"c" * 32)
    peer.expose_blocks(ConsumerKV().regions)
    try:
        peer.warm_up([("127.0.0.1", port)], for_s=20)
        wait_for(lambda: peer.counters["auth_failures"] >= 1)
        assert peer.counters["warmed_peers"] == 0 and ("127.0.0.1", port) not in peer._links
    finally:
        peer.close()
        server.close()


def test_closing_the_consumer_ends_a_warm_up_still_waiting() -> None:
    peer = NixlPeerTier(SLOT, FP, rank=0, read_timeout_s=2.0, max_blocks=BLOCKS)
    peer.expose_blocks(ConsumerKV().regions)
    peer.warm_up([("127.0.0.1", free_port())], for_s=600)  # nobody will ever listen there
    time.sleep(1.5)
    start = time.monotonic()
    peer.close()
    assert time.monotonic() - start < 3.0
    assert peer._warm_up is not None and not peer._warm_up.alive()
