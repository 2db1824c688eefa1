"""The P/D side channel under attack: real ProducerEndpoint, real NIXL agents, real sockets and processes, loopback only.

* A stranger without the secret (another process) learns nothing: no agent
  metadata, no address, no fingerprint value in any byte it receives, and it
  can neither READ nor WRITE the producer's slab. Control: the same process
  with the secret reads the slab and writes over it (the threat is real).
* Read notices: a stranger's, or an authenticated consumer's without the
  hand-off's release token, leave the hand-off held; the right token releases it.
* A consumer with another secret (or none) is refused; a fake producer that
  cannot prove the secret is not read from. Control: the right secret reads.
* 1,000 connections held open (and reopened when dropped) by a flooder leave a
  real consumer's handshakes working with bounded latency (p99 printed) and
  the producer's connections and memory bounded. Control: with eviction off,
  the same flood locks the consumer out.
* A consumer given a producer outside its allow-list refuses without
  connecting. Control: the listed producer is read.
* Integrity: a chunk whose bytes differ from the producer's page hashes fails
  (recomputed). Control: without the check the same bytes are accepted.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("nixl._api")

from tests.integration.test_pd_channel import (
    BLOCKS,
    SLOT,
    SLOTS,
    ConsumerKV,
    into,
    wait_result,
)
from tiercache.pd import auth, side_channel
from tiercache.pd.channel import (
    ChannelError,
    encode_message,
    make_agent,
    recv_message,
    send_message,
)
from tiercache.pd.link import AuthError, PeerLink, PeerLinks
from tiercache.pd.peer_tier import NixlPeerTier, PeerChunk, PeerSource
from tiercache.pd.producer import ProducerEndpoint
from tiercache.pd.side_channel import ChannelLimits
from tiercache.pd.trust import ProducerTrust
from tiercache.testing.ports import free_port
from tiercache.transfer.device import CopySegment

ROOT = Path(__file__).resolve().parents[2]
KEY = b"adversarial-test-secret-0123456789"
WRONG = b"adversarial-test-secret-9876543210"
RELEASE_KEY = auth.new_release_key()
# distinctive fingerprint values: none may reach a stranger
FP = {"model": "model-XQZ-distinct", "kv_dtype": "torch.float32", "chunk_tokens": 64,
      "namespace_salt": "salt-digest-7f3e9a1c55d2"}


def token(rid: str) -> str:
    return auth.release_token(RELEASE_KEY, rid)


@contextlib.contextmanager
def producer(key: bytes = KEY, limits: ChannelLimits = ChannelLimits()) -> Iterator[tuple[torch.Tensor, ProducerEndpoint, int]]:
    """A producer endpoint over a random slab (layout slots, pages known: it publishes page hashes)."""
    cons = ConsumerKV()
    slab = torch.from_numpy(np.random.default_rng(7).integers(1, 256, (SLOTS, SLOT), dtype=np.uint8))
    port = free_port()
    server = ProducerEndpoint(slab.data_ptr(), SLOT, SLOTS, FP, "127.0.0.1", port, key=key, limits=limits,
                              pages=cons.layout.page_bytes)
    server.set_holding(True)
    server.set_release_key(RELEASE_KEY)
    try:
        yield slab, server, port
    finally:
        server.close()


def consumer(key: bytes = KEY, trust: ProducerTrust | None = None, timeout_s: float = 2.0) -> tuple[NixlPeerTier, ConsumerKV]:
    cons = ConsumerKV()
    peer = NixlPeerTier(SLOT, FP, rank=0, read_timeout_s=timeout_s, max_blocks=BLOCKS, key=key, trust=trust)
    assert peer.wait_ready(60)  # the vetter's start is not charged to the first read
    peer.expose_blocks(cons.regions)
    return peer, cons


def chunk(port: int, slot: int, rid: str = "req-1", verify: bool = False) -> PeerChunk:
    return PeerChunk(PeerSource("127.0.0.1", port, rid, release_token=token(rid)), slot, verify=verify)


def wait_for(cond: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def run_stranger(port: int, server: ProducerEndpoint, key: bytes) -> dict:
    """The stranger process (tests/adversarial/pd_stranger.py) against the producer's slot 0."""
    out = subprocess.run([sys.executable, "-m", "tests.adversarial.pd_stranger", str(port), str(server.slab_addr),
                          str(SLOT), key.hex() if key else "-", json.dumps(FP)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def secrets_of(server: ProducerEndpoint) -> list[bytes]:
    """What a stranger must never see: agent name and metadata, addresses, fingerprint values."""
    meta = bytes(server.agent.get_agent_metadata())
    found = [server.agent_name.encode(), meta[:32], meta[-32:], str(server.slab_addr).encode(),
             server.slab_addr.to_bytes(8, "big"), int(server.tags.ctypes.data).to_bytes(8, "big")]
    return found + [str(v).encode() for k, v in FP.items() if k != "kv_dtype" and k != "chunk_tokens"]


# ------------------------------------------------------------------ strangers
def test_a_stranger_learns_nothing_and_cannot_read_or_write_the_slab() -> None:
    with producer() as (slab, server, port):
        before = slab.clone()
        stranger = run_stranger(port, server, b"")
        received = bytes.fromhex(stranger["received"])
        assert received and not [s for s in secrets_of(server) if s in received]
        assert set(stranger["answer_keys"]) <= {"ok", "error"}
        assert stranger["read"] != "ok" and stranger["wrote"] != "ok", stranger
        assert torch.equal(slab, before) and server.channel.counters["auth_failed"] == 1

        # control: the same process with the secret gets everything, READs the slab and WRITEs over it
        insider = run_stranger(port, server, KEY)
        assert {"metadata", "slab_addr", "fingerprint"} <= set(insider["answer_keys"])
        assert [s for s in secrets_of(server) if s in bytes.fromhex(insider["received"])]
        assert insider["read"] == "ok" and insider["read_sum"] == int(before[0].sum(dtype=torch.int64))
        assert insider["wrote"] == "ok" and bool((slab[0] == 0x5A).all()) and torch.equal(slab[1:], before[1:])


def raw_exchange(port: int, messages: list[bytes]) -> bytes:
    """Send raw frames; every byte the producer sends back until it closes (or stays silent)."""
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        for m in messages:
            with contextlib.suppress(OSError):
                sock.sendall(m)
        sock.settimeout(1.0)
        with contextlib.suppress(OSError):
            while part := sock.recv(65536):
                got += part
    return got


def test_nothing_but_a_nonce_before_the_proof() -> None:
    with producer() as (_slab, server, port):
        attempts = [
            [encode_message({"op": "hello", "fingerprint": FP})],  # the old, unauthenticated hello
            [encode_message({"op": "hello", "nonce": os.urandom(32)}),  # a nonce, then a wrong proof
             encode_message({"op": "prove", "proof": os.urandom(32), "fingerprint": FP})],
            [encode_message({"op": "hello", "nonce": os.urandom(32)}),  # a nonce, then skip the proof
             encode_message({"op": "read", "request_id": "req-1", "token": token("req-1")})],
            [encode_message({"op": "prove", "proof": b"", "fingerprint": FP})],
            [b"\xff\xff\xff\xff" + b"x" * 100],  # a 4 GiB length: dropped at once
        ]
        for messages in attempts:
            got = raw_exchange(port, messages)
            assert not [s for s in secrets_of(server) if s in got], messages
        assert server.counters["hellos"] == 0 and server.service() == set()


# ------------------------------------------------------------------ read notices
def test_a_hand_off_is_released_only_by_its_token_on_an_authenticated_link() -> None:
    with producer() as (_slab, server, port):
        bad_before = server.channel.counters["bad_messages"]
        # a stranger who even knows the token: not authenticated, dropped
        raw_exchange(port, [encode_message({"op": "read", "request_id": "req-1", "token": token("req-1")})])
        assert wait_for(lambda: server.channel.counters["bad_messages"] > bad_before)
        assert server.service() == set()
        agent = make_agent("consumer")
        link = PeerLink("127.0.0.1", port, FP, agent, 5.0, KEY)
        try:
            for forged in ("", "0" * 32, token("req-2"), auth.release_token(auth.new_release_key(), "req-1")):
                n = server.counters["forged_notices"]
                link.notify_read("req-1", forged)
                assert wait_for(lambda n=n: server.counters["forged_notices"] == n + 1)
                assert server.service() == set()  # still held
            link.notify_read("req-1", token("req-1"))  # control: the consumer given the hand-off
            released: set[str] = set()
            assert wait_for(lambda: bool(released.update(server.service()) or released))
            assert released == {"req-1"}
        finally:
            link.close()


# ------------------------------------------------------------------ authentication
def test_a_consumer_with_another_secret_or_none_is_refused() -> None:
    with producer() as (slab, server, port):
        server.slot_filled([b"a" * 16], [3])
        for key in (WRONG, b""):
            peer, cons = consumer(key)
            try:
                peer.expect({b"a" * 16: chunk(port, 3)})
                peer.submit_blocks(1, [b"a" * 16], into((0, 1)))
                assert not wait_result(peer).ok and cons.untouched((0, 1))
                assert peer.counters["auth_failures"] == 1  # not retried until the read timeout
            finally:
                peer.close()
        assert server.channel.counters["auth_failed"] == 2 and server.counters["hellos"] == 0
        peer, cons = consumer(KEY)  # control: the right secret
        try:
            peer.expect({b"a" * 16: chunk(port, 3)})
            peer.submit_blocks(2, [b"a" * 16], into((0, 1)))
            assert wait_result(peer).ok and cons.holds(slab[3], (0, 1))
        finally:
            peer.close()


def fake_producer(port: int, proof: Callable[[bytes, bytes], bytes], metadata: bytes) -> threading.Thread:
    """Answers one handshake as a producer would, with ``proof(consumer_nonce, producer_nonce)``."""
    listener = socket.create_server(("127.0.0.1", port))

    def serve() -> None:
        with listener, listener.accept()[0] as conn:
            theirs, ours = recv_message(conn)["nonce"], auth.new_nonce()
            send_message(conn, {"ok": True, "nonce": ours})
            recv_message(conn)
            send_message(conn, {"ok": True, "proof": proof(theirs, ours), "fingerprint": FP, "agent": "fake",
                                "metadata": metadata, "slab_addr": 4096, "slot_bytes": SLOT, "num_slots": SLOTS,
                                "tags_addr": 8192})
            with contextlib.suppress(OSError):
                conn.recv(1)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_a_producer_that_cannot_prove_the_secret_is_not_believed() -> None:
    real = make_agent("producer")  # genuine metadata: only the proof is missing
    metadata = bytes(real.get_agent_metadata())
    for proof, believed in ((lambda c, p: os.urandom(32), False), (lambda c, p: auth.producer_proof(KEY, c, p), True)):
        port = free_port()
        fake_producer(port, proof, metadata)
        agent = make_agent("consumer")
        if believed:  # control: with the secret's proof the same answer is taken
            PeerLink("127.0.0.1", port, FP, agent, 5.0, KEY).close()
        else:
            with pytest.raises(AuthError, match="did not prove"):
                PeerLink("127.0.0.1", port, FP, agent, 5.0, KEY)


# ------------------------------------------------------------------ trust
def test_a_producer_outside_the_allow_list_is_never_connected_to() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    for trust in (ProducerTrust([f"10.0.0.9:{port}"], has_secret=True), ProducerTrust([f"127.0.0.1:{port + 1}"])):
        peer, cons = consumer(KEY, trust)
        try:
            peer.expect({b"u" * 16: chunk(port, 0)})
            peer.submit_blocks(1, [b"u" * 16], into((0, 1)))
            assert not wait_result(peer).ok and peer.counters["untrusted_peers"] == 1
        finally:
            peer.close()
        with pytest.raises(socket.timeout):
            listener.accept()  # nobody connected
    listener.close()
    with producer() as (slab, server, port):  # control: the listed producer is read
        server.slot_filled([b"t" * 16], [2])
        peer, cons = consumer(KEY, ProducerTrust([f"127.0.0.1:{port}"], has_secret=True))
        try:
            peer.expect({b"t" * 16: chunk(port, 2)})
            peer.submit_blocks(1, [b"t" * 16], into((4, 5)))
            assert wait_result(peer).ok and cons.holds(slab[2], (4, 5))
        finally:
            peer.close()


def test_the_consumer_scheduler_refuses_an_untrusted_hand_off_before_the_lookup() -> None:
    """connector/pd/consumer.py: nothing offered to the manager, a counter and a log line say why."""
    pytest.importorskip("vllm")
    from tiercache.connector.pd.consumer import PeerOffers

    from tiercache.config.pd import PDConfig
    from tiercache.keys import KeySpace, Namespace
    from tiercache.manager.directory import TierSpec
    from tiercache.manager.offloading import OffloadingManager
    from tiercache.pd.handoff import Handoff, fingerprint

    keys = KeySpace(Namespace("m", "torch.float32", "NHD", 32, 64, 1, 4096, "sha256"), 2)
    chunk_keys = keys.chunk_keys([bytes([i]) * 32 for i in range(4)])  # 2 blocks a chunk: 2 keys
    for host, trusted in (("10.6.6.6", False), ("127.0.0.1", True)):  # control: loopback, no list, no secret
        manager = OffloadingManager([TierSpec("cpu", 4), TierSpec("peer", 64, "lru", "read_only", shared=True,
                                                                      direct=True)])
        counters = {"handoffs_refused": 0, "handoffs_untrusted": 0, "handoff_chunks_received": 0}
        offers = PeerOffers(keys, manager, fingerprint(keys.namespace), 1, 64, 2, counters, PDConfig(),
                            kv_in_host_memory=True)
        params = Handoff("e", host, 5700, "req-1", tuple(chunk_keys), (0, 1), fingerprint(keys.namespace),
                         release_token="ab" * 16).to_params()
        offers.learn(SimpleNamespace(request_id="r", kv_transfer_params=params), chunk_keys)  # type: ignore[arg-type]
        assert counters["handoffs_untrusted"] == (0 if trusted else 1)
        assert bool(offers._sources) == trusted


# ------------------------------------------------------------------ integrity
def test_a_chunk_that_does_not_match_its_page_hashes_is_dropped() -> None:
    with producer() as (slab, server, port):
        keys = [b"h" * 16, b"i" * 16]
        server.slot_filled(keys, [1, 2])
        slab[2][100] ^= 0xFF  # the slot's bytes change after the producer hashed them (tag still valid)
        peer, cons = consumer(KEY)
        try:
            peer.expect({k: chunk(port, s, "req-h", verify=True) for k, s in zip(keys, (1, 2))})
            peer.submit_blocks(1, keys, into((0, 1), (2, 3)))
            res = wait_result(peer)
            assert res.ok_keys == (keys[0],) and res.failed_keys == (keys[1],)
            assert peer.counters["corrupt_chunks"] == 1 and cons.holds(slab[1], (0, 1))
            # a partial chunk (its second block only) is checked block by block
            peer.expect({keys[0]: chunk(port, 1, "req-p", verify=True)})
            peer.submit_blocks(2, [keys[0]], [CopySegment(-1, 1, (9,))])
            assert wait_result(peer).ok and cons.holds(slab[1], (9,), first=1)
            # control: not verified, the same corrupted bytes are taken
            peer.expect({keys[1]: chunk(port, 2, "req-u", verify=False)})
            peer.submit_blocks(3, [keys[1]], into((6, 7)))
            assert wait_result(peer).ok and cons.holds(slab[2], (6, 7))
        finally:
            peer.close()


def test_a_chunk_to_verify_from_a_producer_without_hashes_fails() -> None:
    cons = ConsumerKV()
    slab = torch.ones((SLOTS, SLOT), dtype=torch.uint8)
    port = free_port()
    server = ProducerEndpoint(slab.data_ptr(), SLOT, SLOTS, FP, "127.0.0.1", port, key=KEY)  # no pages: no hashes
    peer, _ = consumer(KEY)
    try:
        server.slot_filled([b"n" * 16], [0])
        peer.expect({b"n" * 16: chunk(port, 0, verify=True)})
        peer.submit_blocks(1, [b"n" * 16], into((0, 1)))
        assert not wait_result(peer).ok
        peer.expect({b"n" * 16: chunk(port, 0, verify=False)})  # control
        peer.submit_blocks(2, [b"n" * 16], into((0, 1)))
        assert wait_result(peer).ok
    finally:
        peer.close()
        server.close()
    del cons


# ------------------------------------------------------------------ flood
@contextlib.contextmanager
def flooder(port: int, count: int, sources: list[str]) -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen([sys.executable, "-m", "tests.adversarial.pd_flooder", str(port), str(count),
                             ",".join(sources)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        with contextlib.suppress(OSError):
            proc.stdin.close()  # type: ignore[union-attr]
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def handshakes_under_flood(port: int, n: int) -> tuple[list[float], int]:
    """``n`` handshakes as a real consumer makes them (PeerLinks: retried until its timeout); latencies, retries."""
    agent = make_agent("consumer")
    counters = {"hello_retries": 0, "refused_peers": 0, "auth_failures": 0}
    links = PeerLinks(agent, FP, 10.0, counters, lambda link: None, KEY)
    latencies = []
    for _ in range(n):
        start = time.perf_counter()
        links.get(("127.0.0.1", port))
        latencies.append(time.perf_counter() - start)
        links.drop(("127.0.0.1", port))
    return latencies, counters["hello_retries"]


FLOOD = 1000
OTHERS = [f"127.0.0.{i}" for i in range(2, 18)]  # 16 source addresses: 16 x 64 per peer > 256 in all


@pytest.mark.parametrize("sources", [OTHERS, ["127.0.0.1"]], ids=["other-addresses", "the-consumers-address"])
def test_a_flood_of_connections_leaves_a_real_consumer_working(sources: list[str]) -> None:
    with producer() as (_slab, server, port):
        base = rss_bytes()
        with flooder(port, FLOOD, sources):
            assert wait_for(lambda: server.channel.counters["accepted"] >= 256)
            latencies, retries = handshakes_under_flood(port, 30)
            peak = server.channel.connections
            buffered = server.channel.buffered_bytes
            grown = rss_bytes() - base
        p99 = float(np.percentile(latencies, 99))
        print(f"\nflood of {FLOOD} from {len(sources)} address(es): 30 handshakes, p50 "
              f"{statistics.median(latencies) * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms, max "
              f"{max(latencies) * 1e3:.1f} ms, {retries} retries; producer: {peak} connections, "
              f"{buffered} bytes buffered, RSS +{grown / 2**20:.1f} MiB, {server.channel.counters}")
        assert p99 < 5.0  # generous: a loaded 2-core machine, the flooder spinning beside us
        assert peak <= server.channel.limits.max_connections and buffered <= 256 * (8 << 10)
        assert grown < 64 << 20
        assert server.channel.counters["evicted"] > 0 and server.counters["hellos"] == 30


def test_control_without_eviction_the_flood_locks_the_consumer_out(monkeypatch: pytest.MonkeyPatch) -> None:
    # the defence off: no connection ever makes way (admission sees them all as authenticated): full means full
    monkeypatch.setattr(side_channel, "_handshake_rank", lambda conn: None)
    limits = ChannelLimits(handshake_timeout_s=600.0)  # ... and nobody is timed out meanwhile
    with producer(limits=limits) as (_slab, server, port), flooder(port, FLOOD, OTHERS):
        assert wait_for(lambda: server.channel.connections >= 256)
        agent = make_agent("consumer")
        with pytest.raises(ChannelError):
            PeerLink("127.0.0.1", port, FP, agent, 3.0, KEY)


# ------------------------------------------------------------------ timeouts
def test_a_slow_handshake_is_cut_off_and_an_idle_link_is_shaken_hands_again() -> None:
    limits = ChannelLimits(handshake_timeout_s=1.0, idle_timeout_s=1.0)
    with producer(limits=limits) as (_slab, server, port):
        hello = encode_message({"op": "hello", "nonce": os.urandom(32)})
        with socket.create_connection(("127.0.0.1", port), timeout=5) as slow:  # a byte every 0.2 s
            closed = False
            for byte in hello:
                try:
                    slow.sendall(bytes([byte]))
                except OSError:
                    closed = True
                    break
                time.sleep(0.2)
            slow.settimeout(5)
            with contextlib.suppress(OSError):
                closed = closed or slow.recv(1024) == b""
        assert closed and server.channel.counters["timed_out"] >= 1
        # an authenticated link silent past the idle timeout is closed; the consumer shakes hands again
        counters = {"hello_retries": 0, "refused_peers": 0, "auth_failures": 0}
        links = PeerLinks(make_agent("consumer"), FP, 5.0, counters, lambda link: None, KEY)
        first = links.get(("127.0.0.1", port))
        assert wait_for(lambda: ("127.0.0.1", port) not in links, 10.0)
        second = links.get(("127.0.0.1", port))
        assert second is not first and server.counters["hellos"] == 2
        second.notify_read("req-9", token("req-9"))  # control: the new link carries notices
        released: set[str] = set()
        assert wait_for(lambda: bool(released.update(server.service()) or released))
        links.close()


def test_a_consumer_reads_again_after_the_producer_closed_its_idle_link() -> None:
    with producer(limits=ChannelLimits(idle_timeout_s=0.5)) as (slab, server, port):
        server.slot_filled([b"j" * 16], [4])
        peer, cons = consumer(KEY)
        try:
            peer.expect({b"j" * 16: chunk(port, 4, "req-j1")})
            peer.submit_blocks(1, [b"j" * 16], into((0, 1)))
            assert wait_result(peer).ok
            assert wait_for(lambda: server.channel.connections == 0)  # closed for idleness
            peer.expect({b"j" * 16: chunk(port, 4, "req-j2")})
            peer.submit_blocks(2, [b"j" * 16], into((2, 3)))
            assert wait_result(peer).ok and cons.holds(slab[4], (2, 3)) and server.counters["hellos"] == 2
            released: set[str] = set()
            assert wait_for(lambda: {"req-j1", "req-j2"} <= (released.update(server.service()) or released))
        finally:
            peer.close()
