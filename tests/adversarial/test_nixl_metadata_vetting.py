"""NIXL agent metadata that aborts the process loading it: vetted in a throwaway process, never loaded.

One flipped nibble in the UCX worker address inside a NIXL agent's metadata
makes UCX *assert* (``address.c: Assertion `*addr_version ==
UCP_OBJECT_VERSION_V2' failed``) and abort the process: no exception to catch.
Control first: loading those bytes into a fresh agent really kills a process.
Then the vetter (:mod:`tiercache.nixl_vetting`) refuses them, says why, and
still accepts real metadata afterwards (from a fresh child); a stalled child
is a transient refusal; the cache server answers HELLO and AGENT_META carrying
them with a typed refusal and keeps serving; a P/D consumer whose producer
hands them over refuses that producer and stays alive. Real NIXL agents
(UCX over loopback), a real server subprocess.
"""

from __future__ import annotations

import collections
import pathlib
import struct
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest

pytest.importorskip("nixl._api")

from tests.server.harness import ServerProcess
from tiercache.nixl_vetting import MetadataRefused, MetadataVetter
from tiercache.pd import auth
from tiercache.pd.channel import ChannelError, make_agent
from tiercache.pd.link import PeerLinks
from tiercache.server import protocol as p
from tiercache.server.client import ServerClient
from tiercache.server.nixl_client import NixlClientSide
from tiercache.testing.ports import free_port

TOKEN = "vetting-secret"


def ucx_version_flipped(metadata: bytes) -> bytes:
    """``metadata`` with the UCX worker address's version nibble set to 3 (UCX knows 1 and 2)."""
    tag = metadata.index(b"UCX|c") + len(b"UCX|c")
    (size,) = struct.unpack_from("<Q", metadata, tag)
    at = tag + 8
    assert size > 0 and metadata[at] & 0x0F != 3
    out = bytearray(metadata)
    out[at] = (out[at] & 0xF0) | 3
    return bytes(out)


@pytest.fixture(scope="module")
def live_agent() -> Iterator[tuple[str, bytes]]:
    """A live agent with 1 MiB registered: (its name, its metadata)."""
    buffer = np.zeros(1 << 20, dtype=np.uint8)
    agent = make_agent("vetting-client")
    agent.register_memory([(buffer.ctypes.data, buffer.nbytes, 0, "")], "DRAM")
    yield agent.name, bytes(agent.get_agent_metadata())


def test_control_the_flipped_metadata_aborts_a_process_that_loads_it(live_agent: tuple[str, bytes],
                                                                      tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "bad.bin"
    bad.write_bytes(ucx_version_flipped(live_agent[1]))
    script = ("import sys; from tiercache.pd.channel import make_agent; "
              f"make_agent('victim').add_remote_agent(open({str(bad)!r}, 'rb').read()); print('survived')")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode < 0 and "survived" not in done.stdout, (done.returncode, done.stderr[-2000:])
    assert "Assertion" in done.stderr


def test_the_vetter_refuses_what_kills_and_what_nixl_refuses_and_keeps_working(live_agent: tuple[str, bytes]) -> None:
    name, real = live_agent
    vetter = MetadataVetter(timeout_s=30.0)
    try:
        assert vetter.vet(real) == name
        with pytest.raises(MetadataRefused, match="killed the vetting process.*Assertion") as killed:
            vetter.vet(ucx_version_flipped(real))
        assert not killed.value.transient
        with pytest.raises(MetadataRefused, match="NIXL refused") as refused:
            vetter.vet(real[: len(real) // 2])  # NIXL's own refusal: an answer, the child lives
        assert not refused.value.transient
        other = make_agent("vetting-other")
        assert vetter.vet(bytes(other.get_agent_metadata())) == other.name  # a fresh child answers
        assert vetter.children_started == 2
        for size in (0, (1 << 20) + 1):
            with pytest.raises(MetadataRefused, match="bytes"):
                vetter.vet(b"x" * size)
    finally:
        vetter.close()


def test_a_stalled_vetting_process_is_a_transient_refusal(live_agent: tuple[str, bytes]) -> None:
    ready_then_stall = "import sys, time; sys.stdout.buffer.write(b'R'); sys.stdout.flush(); time.sleep(120)"
    for script, why in ((ready_then_stall, "took over 1.0 s"), ("import time; time.sleep(120)", "did not start")):
        vetter = MetadataVetter(timeout_s=1.0, command=[sys.executable, "-c", script], start_timeout_s=3.0)
        try:
            with pytest.raises(MetadataRefused, match=why) as stalled:
                vetter.vet(live_agent[1])
            assert stalled.value.transient
        finally:
            vetter.close()


def _frames(data: bytes) -> list[p.Frame]:
    return list(p.FrameDecoder(p.Limits(max_body_bytes=1 << 24, max_payload_bytes=1 << 30), replies=True).feed(data))


def _exchange(port: int, data: bytes) -> list[p.Frame]:
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
    return _frames(out)


def test_the_cache_server_refuses_the_flipped_metadata_and_keeps_serving(tmp_path: pathlib.Path) -> None:
    server = ServerProcess(tmp_path / "server", auth_token=TOKEN, nixl="on", nixl_timeout_s=5.0, max_value_bytes=4096,
                           tiers=[{"name": "cpu", "backend": "cpu", "capacity": "4MiB"}]).start()
    side = NixlClientSide(1 << 20, 1)
    try:
        agent, real = side.agent_name, side.metadata()[1]
        bad = ucx_version_flipped(real)
        hello = p.frame(p.MsgType.HELLO, 1, p.Hello(token=TOKEN, client="bad", nixl_agent=agent, nixl_metadata=bad))
        frames = _exchange(server.port, hello)
        assert frames[0].header.type == p.reply_type(p.MsgType.HELLO) and not frames[0].body.nixl  # type: ignore[union-attr]
        good_hello = p.frame(p.MsgType.HELLO, 1, p.Hello(token=TOKEN, client="meta", nixl_agent=agent, nixl_metadata=real))
        update = p.frame(p.MsgType.AGENT_META, 2, p.AgentMeta(bad))
        frames = _exchange(server.port, good_hello + update)
        assert frames[0].body.nixl  # type: ignore[union-attr]  # the real metadata is loaded
        assert frames[1].header.type == p.MsgType.ERROR and frames[1].body.code == "unauthorized"  # type: ignore[union-attr]
        with ServerClient(server.address, token=TOKEN, client_name="good") as good:
            assert good.put([b"k"], [b"v" * 64], overwrite=True) == [p.Status.OK]
        assert server.proc is not None and server.proc.poll() is None
        assert server.log().count("killed the vetting process") == 2
    finally:
        side.close()
        server.kill()


def test_a_p_d_consumer_refuses_a_producer_whose_metadata_kills(live_agent: tuple[str, bytes]) -> None:
    from tests.adversarial.test_pd_side_channel import FP, KEY, fake_producer

    port = free_port()
    fake_producer(port, lambda theirs, ours: auth.producer_proof(KEY, theirs, ours), ucx_version_flipped(live_agent[1]))
    counters: collections.Counter[str] = collections.Counter()
    links = PeerLinks(make_agent("consumer"), FP, 10.0, counters, on_drop=lambda link: None, key=KEY)
    try:
        with pytest.raises(ChannelError, match="incompatible: its NIXL metadata cannot be loaded.*Assertion"):
            links.get(("127.0.0.1", port))
        assert counters["refused_peers"] == 1
        with pytest.raises(ChannelError, match="incompatible"):  # remembered: never asked again
            links.get(("127.0.0.1", port))
    finally:
        links.close()
