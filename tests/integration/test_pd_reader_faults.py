"""The P/D consumer's reader thread survives whatever a peer answers (tiercache/backends/nixl_peer.py).

A fake producer answers the handshake with a well-formed, compatible reply
whose NIXL agent metadata is garbage. Adding that agent raised inside NIXL (not
a ChannelError), which once ended the reader thread, after which no hand-off
ever completed; then it was caught as a ``reader_exception``. Now the metadata
is vetted in a throwaway process first (tiercache/nixl_vetting.py): NIXL's
refusal makes the producer incompatible (refused, counted in
``refused_peers``, never asked again), the job's keys fail (the engine
recomputes them), and the next hand-off, from a real producer, is read
byte-exact by the same reader.
"""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
import torch

pytest.importorskip("nixl._api")

from tests.e2e.conftest import free_port
from tests.integration.test_pd_channel import (
    FP,
    SLOT,
    chunk,
    into,
    producer_and_consumer,
    wait_result,
)
from tiercache import faults
from tiercache.pd import auth
from tiercache.pd.channel import recv_message, send_message


def garbage_producer(port: int, stop: threading.Event) -> threading.Thread:
    """Answers every hello as a compatible producer would, with unusable agent metadata."""
    listener = socket.create_server(("127.0.0.1", port))
    listener.settimeout(0.2)

    def serve() -> None:
        with listener:
            while not stop.is_set():
                try:
                    conn, _ = listener.accept()
                except OSError:
                    continue
                with conn:
                    try:  # the handshake as a producer without a secret makes it (empty key)
                        theirs, ours = recv_message(conn)["nonce"], auth.new_nonce()
                        send_message(conn, {"ok": True, "nonce": ours})
                        recv_message(conn)
                        send_message(conn, {"ok": True, "fingerprint": FP, "agent": "liar", "metadata": b"\x00garbage",
                                            "slab_addr": 4096, "slot_bytes": SLOT, "num_slots": 8, "tags_addr": 8192,
                                            "proof": auth.producer_proof(b"", theirs, ours)})
                        conn.recv(1)  # hold the connection until the consumer drops it
                    except Exception:
                        pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_the_reader_survives_garbage_agent_metadata_and_reads_the_next_hand_off() -> None:
    faults.reset_for_tests()
    stop = threading.Event()
    liar_port = free_port()
    garbage_producer(liar_port, stop)
    try:
        with producer_and_consumer() as (prod, _planes, cons, server, peer, port, _stepper):
            peer.expect({b"g" * 16: chunk(liar_port, 1, "req-g")})
            peer.submit_blocks(1, [b"g" * 16], into((0, 1)))
            bad = wait_result(peer)
            assert bad.failed_keys == (b"g" * 16,) and cons.untouched((0, 1))
            assert peer.counters["refused_peers"] == 1  # NIXL refused its metadata in the vetting process
            assert faults.take().get(faults.READER_EXCEPTION, 0) == 0  # an answer, not an exception

            prod[2] = torch.from_numpy(np.random.default_rng(1).integers(0, 256, SLOT, dtype=np.uint8))
            server.slot_filled([b"k" * 16], [2])
            peer.expect({b"k" * 16: chunk(port, 2, "req-k")})
            peer.submit_blocks(2, [b"k" * 16], into((4, 5)))
            good = wait_result(peer)
            assert good.ok and cons.holds(prod[2], (4, 5))  # the same reader thread, still alive
    finally:
        stop.set()
