"""Fuzzing the server's decoder: whatever the bytes, a typed refusal or a valid message, never a crash.

Two levels. The decoder itself (``unpack_header`` / ``decode_body`` /
``check_request``, driven through :class:`FrameDecoder` as the server drives
them): random bytes, mutated and truncated valid frames, oversized and
out-of-range headers, fed in random pieces - every outcome is a frame or a
:class:`ProtocolError` subclass. Then a live server (a subprocess, with an
auth token): hypothesis-generated garbage on one connection - unauthenticated,
malformed, truncated, oversized - is refused with an ERROR frame or a closed
socket, while a well-behaved client on another connection keeps storing and
reading back exact bytes between every example.
"""

from __future__ import annotations

import itertools
import pathlib
import socket
import struct
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tests.server.harness import ServerProcess
from tiercache.server import protocol as p
from tiercache.server.client import ServerClient

LIMITS = p.Limits(max_body_bytes=1 << 16, max_payload_bytes=1 << 20, max_keys=64, max_key_bytes=100,
                  max_value_bytes=1 << 16)
TOKEN = "fuzz-secret"

keys_st = st.lists(st.binary(min_size=1, max_size=100), min_size=0, max_size=16)


@st.composite
def valid_requests(draw: st.DrawFn) -> tuple[p.MsgType, p._Body, bytes]:
    """A request this decoder must accept, with its payload."""
    kind = draw(st.sampled_from([p.MsgType.HELLO, p.MsgType.EXISTS, p.MsgType.PUT, p.MsgType.GET,
                                 p.MsgType.DELETE, p.MsgType.STATS, p.MsgType.HEALTH, p.MsgType.PUT_REMOTE]))
    keys = draw(keys_st)
    if kind is p.MsgType.HELLO:
        return kind, p.Hello(token=draw(st.text(max_size=20)), client=draw(st.text(max_size=20))), b""
    if kind is p.MsgType.PUT:
        values = [draw(st.binary(max_size=64)) for _ in keys]
        return kind, p.Put(keys, [len(v) for v in values], draw(st.booleans())), b"".join(values)
    if kind is p.MsgType.PUT_REMOTE:
        sizes = [draw(st.integers(0, 1 << 20)) for _ in keys]
        addrs = [draw(st.integers(0, (1 << 63) - 1)) for _ in keys]
        return kind, p.PutRemote(keys, sizes, addrs), b""
    if kind is p.MsgType.GET:
        return kind, p.Get(keys, [draw(st.integers(0, 1 << 20)) for _ in keys]), b""
    body = {p.MsgType.EXISTS: p.Exists(keys), p.MsgType.DELETE: p.Delete(keys),
            p.MsgType.STATS: p.Stats(), p.MsgType.HEALTH: p.Health()}[kind]
    return kind, body, b""


def encode(kind: p.MsgType, body: p._Body, payload: bytes, request_id: int = 7) -> bytes:
    return p.frame(kind, request_id, body, len(payload)) + payload


def decode_all(data: bytes, cuts: list[int]) -> list[p.Frame]:
    """Feed ``data`` in pieces split at ``cuts``; the frames, then close()."""
    decoder = p.FrameDecoder(LIMITS)
    frames: list[p.Frame] = []
    edges = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    for a, b in itertools.pairwise(edges):
        frames.extend(decoder.feed(data[a:b]))
    decoder.close()
    return frames


# ------------------------------------------------------------------------------ the decoder
@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=512), cuts=st.lists(st.integers(0, 512), max_size=6))
def test_random_bytes_are_refused_with_a_typed_error(data: bytes, cuts: list[int]) -> None:
    try:
        decode_all(data, cuts)
    except p.ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=256), header_fields=st.tuples(
    st.sampled_from([int(t) for t in p.MsgType] + [0, 11, 0x85, 0x7F]), st.integers(0, 300),
    st.integers(0, 300)))
def test_random_bodies_behind_a_valid_header(data: bytes, header_fields: tuple[int, int, int]) -> None:
    """A correct magic/version but random type, lengths and body: typed errors only."""
    msg_type, body_len, payload_len = header_fields
    frame_ = p.pack_header(msg_type, 1, body_len, payload_len) + data
    try:
        decode_all(frame_, [])
    except p.ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(request=valid_requests(), cuts=st.lists(st.integers(0, 4096), max_size=8))
def test_valid_requests_round_trip_in_any_pieces(request: tuple[p.MsgType, p._Body, bytes], cuts: list[int]) -> None:
    kind, body, payload = request
    data = encode(kind, body, payload) * 2  # two frames back to back
    frames = decode_all(data, cuts)
    assert len(frames) == 2
    for frame_ in frames:
        assert frame_.header.type == kind and frame_.header.request_id == 7
        assert frame_.body == body and frame_.payload == payload


@settings(max_examples=400, deadline=None)
@given(request=valid_requests(), flips=st.lists(st.tuples(st.integers(0, 4096), st.integers(1, 255)),
                                                 min_size=1, max_size=4))
def test_mutated_frames_decode_or_are_refused(request: tuple[p.MsgType, p._Body, bytes],
                                              flips: list[tuple[int, int]]) -> None:
    kind, body, payload = request
    data = bytearray(encode(kind, body, payload))
    for at, mask in flips:
        data[at % len(data)] ^= mask
    try:
        frames = decode_all(bytes(data), [])
    except p.ProtocolError:
        return
    for frame_ in frames:  # what got through is a well-formed, in-bounds request
        assert frame_.header.body_len <= LIMITS.max_body_bytes
        keys = getattr(frame_.body, "keys", [])
        assert len(keys) <= LIMITS.max_keys and all(0 < len(k) <= LIMITS.max_key_bytes for k in keys)


@settings(max_examples=200, deadline=None)
@given(request=valid_requests(), cut=st.integers(1, 4096))
def test_truncated_frames_raise_truncated(request: tuple[p.MsgType, p._Body, bytes], cut: int) -> None:
    kind, body, payload = request
    data = encode(kind, body, payload)
    cut = cut % len(data)
    assume(cut > 0)
    decoder = p.FrameDecoder(LIMITS)
    assert list(decoder.feed(data[:cut])) == []
    with pytest.raises(p.Truncated):
        decoder.close()


@settings(max_examples=200, deadline=None)
@given(body_len=st.integers(LIMITS.max_body_bytes + 1, 2**32 - 1),
       payload_len=st.integers(LIMITS.max_payload_bytes + 1, 2**64 - 1))
def test_oversized_messages_are_refused_from_the_header_alone(body_len: int, payload_len: int) -> None:
    for header in (p.pack_header(p.MsgType.GET, 1, body_len, 0), p.pack_header(p.MsgType.PUT, 1, 10, payload_len)):
        decoder = p.FrameDecoder(LIMITS)
        with pytest.raises(p.MessageTooLarge):
            list(decoder.feed(header))  # refused before a single body byte is buffered
        with pytest.raises(p.MessageTooLarge):
            list(decoder.feed(b"more"))  # and the stream stays refused


@pytest.mark.parametrize(
    ("header", "error"),
    [
        (b"XXXX" + p.pack_header(p.MsgType.HEALTH, 1, 1)[4:], p.BadMagic),
        (struct.pack("<4sBBHIIQ", p.MAGIC, 2, p.MsgType.HEALTH, 0, 1, 1, 0), p.UnsupportedVersion),
        (struct.pack("<4sBBHIIQ", p.MAGIC, 1, p.MsgType.HEALTH, 1, 1, 1, 0), p.BadFlags),
        (struct.pack("<4sBBHIIQ", p.MAGIC, 1, 0x42, 0, 1, 1, 0), p.UnknownMessageType),
        (struct.pack("<4sBBHIIQ", p.MAGIC, 1, p.MsgType.ERROR, 0, 1, 1, 0), p.UnknownMessageType),
        (struct.pack("<4sBBHIIQ", p.MAGIC, 1, p.MsgType.GET | 0x80, 0, 1, 1, 0), p.UnknownMessageType),
        (struct.pack("<4sBBHIIQ", p.MAGIC, 1, p.MsgType.GET, 0, 1, 1, 5), p.UnexpectedPayload),
    ],
)
def test_each_header_check_has_its_error(header: bytes, error: type[p.ProtocolError]) -> None:
    with pytest.raises(error):
        p.unpack_header(header, LIMITS, replies=False)


def test_configured_limits_are_enforced_after_decoding() -> None:
    many = p.Exists([b"k%d" % i for i in range(LIMITS.max_keys + 1)])
    with pytest.raises(p.LimitExceeded):
        decode_all(encode(p.MsgType.EXISTS, many, b""), [])
    with pytest.raises(p.LimitExceeded):
        decode_all(encode(p.MsgType.DELETE, p.Delete([b"x" * 101]), b""), [])
    with pytest.raises(p.MalformedBody, match="sizes add up"):
        decode_all(p.frame(p.MsgType.PUT, 1, p.Put([b"a"], [5]), 4) + b"abcd", [])
    with pytest.raises(p.MalformedBody, match="2 keys but 1 capacities"):
        decode_all(encode(p.MsgType.GET, p.Get([b"a", b"b"], [1]), b""), [])
    with pytest.raises(p.MalformedBody):  # a key of zero bytes is not a key
        decode_all(encode(p.MsgType.EXISTS, p.Exists([b""]), b""), [])


# ------------------------------------------------------------------------------ a live server
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        tmp_path_factory.mktemp("fuzz-server"), auth_token=TOKEN, max_value_bytes=4096,
        max_body_bytes=65536, max_message_bytes=1 << 20, max_keys_per_message=64,
        hello_timeout_s=2.0, tiers=[{"name": "cpu", "backend": "cpu", "capacity": "4MiB"}],
    ).start()
    yield proc
    proc.kill()


def _hello(token: str = TOKEN) -> bytes:
    return p.frame(p.MsgType.HELLO, 1, p.Hello(token=token, client="fuzz"))


def _send_and_collect(address: tuple[str, int], data: bytes) -> bytes:
    """Send ``data`` on a fresh connection, half-close, and read until the server closes."""
    with socket.create_connection(address, timeout=10) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server may refuse and close before it has read everything
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    return out


def _frames_from_server(data: bytes) -> list[p.Frame]:
    decoder = p.FrameDecoder(p.Limits(max_body_bytes=1 << 24, max_payload_bytes=1 << 30), replies=True)
    return list(decoder.feed(data))


garbage_st = st.one_of(
    st.binary(min_size=1, max_size=300),  # noise
    valid_requests().map(lambda r: encode(*r)),  # a valid request, never authenticated
    st.tuples(valid_requests(), st.integers(1, 10**6)).map(  # a truncated frame after a good HELLO
        lambda t: _hello() + encode(*t[0])[: max(1, t[1] % len(encode(*t[0])))]),
    st.integers(65537, 2**32 - 1).map(  # oversized body after a good HELLO
        lambda n: _hello() + p.pack_header(p.MsgType.GET, 2, n) + b"\0" * 64),
    st.binary(min_size=1, max_size=200).map(lambda b: _hello() + p.pack_header(p.MsgType.PUT, 2, len(b), 0) + b),
    st.text(max_size=12).filter(lambda t: t != TOKEN).map(lambda t: _hello(t) + encode(p.MsgType.STATS, p.Stats(), b"")),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(garbage=garbage_st)
def test_live_server_refuses_garbage_and_keeps_serving(server: ServerProcess, garbage: bytes,
                                                       tmp_path: pathlib.Path) -> None:
    with ServerClient(server.address, token=TOKEN, client_name="good") as good:
        key = b"good-key-" + bytes(garbage[:8]).hex().encode()
        value = (garbage * (4096 // len(garbage) + 1))[:4096]
        reply = _send_and_collect(("127.0.0.1", server.port), garbage)
        frames = _frames_from_server(reply)
        authed = garbage.startswith(_hello())
        # Never served without the token: at most a Welcome (when the HELLO was right) and ERRORs.
        for frame_ in frames:
            assert frame_.header.type in (p.MsgType.ERROR, p.reply_type(p.MsgType.HELLO)) or authed
        if not authed:
            assert all(f.header.type == p.MsgType.ERROR for f in frames)
        assert good.put([key], [value]) == [p.Status.OK]
        view = memoryview(bytearray(4096))
        statuses, sizes = good.get([key], [view])
        assert statuses == [p.Status.OK] and bytes(view[: sizes[0]]) == value
        assert good.health().status == "ok"


def test_live_server_names_the_refusals(server: ServerProcess) -> None:
    address = ("127.0.0.1", server.port)

    def error_code(data: bytes) -> str:
        frames = _frames_from_server(_send_and_collect(address, data))
        assert frames and frames[-1].header.type == p.MsgType.ERROR
        body = frames[-1].body
        assert isinstance(body, p.ErrorReply)
        return body.code

    assert error_code(encode(p.MsgType.STATS, p.Stats(), b"")) == "hello_required"
    assert error_code(_hello("wrong") + encode(p.MsgType.STATS, p.Stats(), b"")) == "unauthorized"
    assert error_code(_hello("")) == "unauthorized"
    assert error_code(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n") == "bad_magic"
    assert error_code(_hello() + p.pack_header(p.MsgType.GET, 2, 1 << 20)) == "too_large"
    assert error_code(_hello() + p.pack_header(p.MsgType.PUT, 2, 4, 2 << 20)) == "too_large"
    big = p.Exists([b"k%d" % i for i in range(65)])
    assert error_code(_hello() + encode(p.MsgType.EXISTS, big, b"")) == "limit_exceeded"
    assert error_code(_hello() + p.pack_header(p.MsgType.EXISTS, 2, 3) + b"\xc1\xc1\xc1") == "malformed_body"
    with socket.create_connection(address, timeout=10) as sock:  # silent: closed after hello_timeout_s
        sock.settimeout(10)
        frames = _frames_from_server(sock.recv(65536))
        assert frames[0].body == p.ErrorReply(code="timeout", message="timed out")
