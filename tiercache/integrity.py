"""Chunk framing and checksums: what a lower tier stores, and the check on every load.

Every chunk a lower tier holds (disk, LMDB, a remote store) is stored as a
*frame*: a small header, then the payload (the chunk's bytes)::

    offset  size  field
    0       4     magic          b"TCKF"
    4       1     version        FORMAT_VERSION (1)
    5       1     algo           ALGO_XXH3_64 (1) or ALGO_BLAKE2B_MAC (2)
    6       2     flags          0 (reserved)
    8       8     checksum       xxh3_64, or the keyed MAC; see below
    16      8     namespace      the 8-byte namespace digest of the engine that wrote it
    24      8     payload_len    bytes of payload
    32      2     key_len        bytes of key
    34      2     header_len     where the payload starts (>= 40 + key_len)
    36      4     reserved       zero
    40      k     key            the chunk key
    40+k    ...   zero padding up to header_len
    header_len    payload        payload_len bytes (a medium may pad after it)

All integers are little endian. The checksum covers bytes ``[0, 8)`` and
``[16, 40 + key_len)`` of the header (everything but the checksum field and
the padding) followed by the payload, digested incrementally: no copy of the
payload is made to checksum it. :class:`FrameDigest` is that digest fed piece by
piece, for a medium that checksums a payload while copying it (writing:
:func:`open_header`, then ``seal``; reading: :func:`check_header`, then :func:`check_checksum`).

Keyed MAC (``ALGO_BLAKE2B_MAC``). A tier given a secret (``mac_key``) writes
frames whose checksum field holds a MAC of the same bytes: keyed BLAKE2b with
an 8-byte output (BLAKE2b's own keyed mode and output length, not a truncated
hash), under a key derived from the secret (:class:`~tiercache.mac.MacKey`).
The algorithm byte, the namespace and the key are covered too, so a valid
frame cannot be replayed under another key or passed off as an xxh3 frame.
Such a tier refuses every frame that is not a valid MAC frame under its key
(an xxh3 frame included: anyone can compute xxh3), and a tier without a key
refuses MAC frames (it cannot check them); both are :class:`MacError`. Tags
are compared in constant time and never appear in an error message. 64 bits
suffice because a forger cannot test a guess offline: each guess must be
stored and then loaded by a holder of the key, and passes with probability
2^-64. Cost: keyed BLAKE2b runs at about 1 GB/s per core against xxh3's tens of
GB/s (``python -m bench integrity``), so a MAC is for stores others can write.

Two shapes of frame share the format: a *compact* frame (``header_len = 40 +
key_len``, :func:`encode_frame`), for key-value media that store one value
per chunk, and an *aligned* frame (``header_len = ALIGN``, payload padded to a
multiple of ``ALIGN``) that the disk tier uses so that O_DIRECT I/O can go
straight to and from page-aligned memory.

A load that fails verification raises :class:`IntegrityError`
(:class:`ChecksumMismatch` when the bytes are damaged, :class:`FrameFormatError`
when the frame is not what was asked for: wrong magic, version, namespace,
key or length; :class:`MacError` when a MAC is missing, unexpected or wrong).
A backend turns it into a failed key plus a counter, never into bytes handed
to the engine: :func:`decode_frame` copies a payload into the caller's buffer
only after it verified. A backend that verifies while it copies (the LMDB
tier) writes the buffer first and must then treat it by the contract of
:meth:`tiercache.backend.Backend.submit_get`: its bytes mean nothing unless the
key is reported ok.

Buffers: every function here works on caller-owned buffers and keeps no
reference to them after returning. Nothing here holds state but a
:class:`MacKey` (immutable); any thread may call any function.
"""

from __future__ import annotations

import hmac
import struct
from dataclasses import dataclass

import xxhash

from tiercache.mac import MacKey

__all__ = [
    "ALGO_BLAKE2B_MAC", "ALGO_XXH3_64", "ALIGN", "FIXED_HEADER_BYTES", "FORMAT_VERSION",
    "FRAME_MAGIC", "MAX_KEY_BYTES", "ChecksumMismatch", "FrameDigest", "FrameFormatError",
    "FrameHeader", "IntegrityError", "MacError", "MacKey", "aligned_frame_bytes", "check_checksum",
    "check_header", "compact_header_len", "compact_payload", "decode_frame", "encode_frame",
    "frame_checksum", "frame_header", "open_header", "pack_header", "read_header", "round_up",
    "verify_frame",
]

FRAME_MAGIC = b"TCKF"
FORMAT_VERSION = 1
ALGO_XXH3_64 = 1
ALGO_BLAKE2B_MAC = 2
_ALGO_NAMES = {ALGO_XXH3_64: "xxh3_64", ALGO_BLAKE2B_MAC: "blake2b-mac"}
ALIGN = 4096  # page size: O_DIRECT buffers, offsets and lengths are multiples of it

_FIXED = struct.Struct("<4sBBHQ8sQHH4x")
FIXED_HEADER_BYTES = _FIXED.size  # 40
_CHECKSUM_AT = 8  # the checksum field is bytes [8, 16)
_CHECKSUM = struct.Struct("<Q")
MAX_KEY_BYTES = ALIGN - FIXED_HEADER_BYTES  # a key always fits in one aligned header block
_ZEROS = memoryview(bytes(ALIGN))


class IntegrityError(ValueError):
    """A stored frame failed verification; the chunk must be treated as a miss."""


class ChecksumMismatch(IntegrityError):
    """The frame is well formed but its bytes do not match their checksum (corruption)."""


class FrameFormatError(IntegrityError):
    """The bytes are not a frame of this format, or not the frame that was asked for."""


class MacError(IntegrityError):
    """The frame is not authenticated by this reader's key: no MAC where one is required,
    a MAC where the reader has no key, or a MAC that does not verify (forged, another
    key, or damaged bytes)."""


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """The decoded header of a frame (as stored; :func:`verify_frame` checks it)."""

    version: int
    algo: int
    flags: int
    checksum: int
    namespace: bytes
    payload_len: int
    key: bytes
    header_len: int


# ---------------------------------------------------------------------------- sizes
def round_up(n: int, align: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``align``."""
    return -(-n // align) * align


def compact_header_len(key_len: int) -> int:
    """Header length of a compact frame (payload right after the key)."""
    _check_key_len(key_len)
    return FIXED_HEADER_BYTES + key_len


def aligned_frame_bytes(payload_len: int) -> int:
    """Size of an aligned frame: one ``ALIGN`` header block + the payload padded to ``ALIGN``."""
    return ALIGN + round_up(payload_len)


# ---------------------------------------------------------------------------- writing
def pack_header(
    into: memoryview | bytearray,
    namespace: bytes,
    key: bytes,
    payload: memoryview | bytes,
    header_len: int | None = None,
    *,
    mac: MacKey | None = None,
) -> int:
    """Write the header for ``payload`` into ``into[:header_len]``; return the checksum.

    ``header_len`` defaults to the compact length; pass ``ALIGN`` for an aligned
    frame. ``into`` must be writable and at least ``header_len`` bytes; the
    padding between the key and ``header_len`` is zero-filled. With ``mac`` the
    frame is a MAC frame (``ALGO_BLAKE2B_MAC``) and the value returned its tag.
    """
    digest = open_header(into, namespace, key, _nbytes(payload), header_len, mac=mac)
    digest.update(payload)
    return digest.seal(into)


def open_header(
    into: memoryview | bytearray, namespace: bytes, key: bytes, payload_len: int,
    header_len: int | None = None, *, mac: MacKey | None = None,
) -> FrameDigest:
    """Write every header field but the checksum; return the digest to feed the payload to.

    The streaming form of :func:`pack_header`: ``update`` the digest with the
    payload's bytes in order (in pieces of any size), then ``seal(into)``.
    """
    if len(namespace) != 8:
        raise ValueError(f"namespace digest must be 8 bytes, got {len(namespace)}")
    key_len = len(key)
    min_len = compact_header_len(key_len)
    header_len = min_len if header_len is None else header_len
    if not min_len <= header_len <= 0xFFFF:
        raise ValueError(f"header_len {header_len} outside [{min_len}, 65535]")
    algo = ALGO_XXH3_64 if mac is None else ALGO_BLAKE2B_MAC
    _FIXED.pack_into(into, 0, FRAME_MAGIC, FORMAT_VERSION, algo, 0, 0, namespace, payload_len,
                     key_len, header_len)
    into[FIXED_HEADER_BYTES:min_len] = key
    _zero_fill(into, min_len, header_len)
    return FrameDigest(into, key_len, mac=mac)


def frame_header(
    namespace: bytes,
    key: bytes,
    payload: memoryview | bytes,
    header_len: int | None = None,
    *,
    mac: MacKey | None = None,
) -> bytearray:
    """A new header (``header_len`` bytes) for ``payload``; see :func:`pack_header`."""
    out = bytearray(compact_header_len(len(key)) if header_len is None else header_len)
    pack_header(out, namespace, key, payload, header_len, mac=mac)
    return out


def encode_frame(
    namespace: bytes, key: bytes, payload: memoryview | bytes, *, mac: MacKey | None = None
) -> bytes:
    """A compact frame (header + payload) as one ``bytes`` value, for key-value media."""
    header = frame_header(namespace, key, payload, mac=mac)
    return b"".join((header, payload))


# ---------------------------------------------------------------------------- checking
def frame_checksum(
    header: memoryview | bytes | bytearray,
    key_len: int,
    payload: memoryview | bytes,
    *,
    mac: MacKey | None = None,
) -> int:
    """xxh3_64 (or, with ``mac``, the keyed MAC) over the header minus checksum field and
    padding, then the payload; as the u64 the checksum field holds."""
    digest = FrameDigest(header, key_len, mac=mac)
    digest.update(payload)
    return digest.value()


class FrameDigest:
    """A frame's checksum (:func:`frame_checksum`) fed its payload piece by piece.

    Built on a header (its covered fields digested at once); ``update`` with the payload's
    bytes in order, then ``value()`` or ``seal``. The one place the checksum is computed.
    """

    __slots__ = ("_hasher", "_mac", "update")

    def __init__(self, header: memoryview | bytes | bytearray, key_len: int, *,
                 mac: MacKey | None = None) -> None:
        hv = memoryview(header)
        self._mac = mac
        self._hasher = xxhash.xxh3_64() if mac is None else mac.hasher()
        self.update = self._hasher.update  # the hasher's own (no call layer; xxh3 frees the GIL)
        self.update(hv[:_CHECKSUM_AT])
        self.update(hv[_CHECKSUM_AT + 8 : FIXED_HEADER_BYTES + key_len])

    def value(self) -> int:
        """The checksum as the u64 the checksum field holds."""
        if self._mac is None:
            return int(self._hasher.intdigest())
        return int.from_bytes(self._hasher.digest(), "little")

    def seal(self, into: memoryview | bytearray) -> int:
        """Write the checksum into the header ``into`` (see :func:`open_header`); return it."""
        checksum = self.value()
        _CHECKSUM.pack_into(into, _CHECKSUM_AT, checksum)
        return checksum


def read_header(header: memoryview | bytes | bytearray) -> FrameHeader:
    """Decode a header; FrameFormatError if it is not one of this format."""
    if len(header) < FIXED_HEADER_BYTES:
        raise FrameFormatError(f"frame shorter than its fixed header ({len(header)} bytes)")
    magic, version, algo, flags, checksum, namespace, payload_len, key_len, header_len = (
        _FIXED.unpack_from(header, 0)
    )
    if magic != FRAME_MAGIC:
        raise FrameFormatError(f"bad magic {bytes(magic)!r}")
    if version != FORMAT_VERSION:
        raise FrameFormatError(f"unsupported frame version {version}")
    if algo not in _ALGO_NAMES:
        raise FrameFormatError(f"unknown checksum algorithm {algo}")
    if key_len > MAX_KEY_BYTES or header_len < FIXED_HEADER_BYTES + key_len:
        raise FrameFormatError(f"inconsistent lengths (key {key_len}, header {header_len})")
    if len(header) < FIXED_HEADER_BYTES + key_len:
        raise FrameFormatError("frame shorter than its key")
    key = bytes(memoryview(header)[FIXED_HEADER_BYTES : FIXED_HEADER_BYTES + key_len])
    return FrameHeader(version, algo, flags, checksum, namespace, payload_len, key, header_len)


def verify_frame(
    header: memoryview | bytes | bytearray,
    payload: memoryview | bytes,
    namespace: bytes,
    key: bytes,
    *,
    mac: MacKey | None = None,
) -> FrameHeader:
    """Check that ``header`` + ``payload`` is the intact frame of ``key`` in ``namespace``.

    ``payload`` must be exactly the stored payload (its length is checked
    against the header). With ``mac`` the frame must be a MAC frame whose tag
    verifies under it; without, an xxh3 frame. Raises FrameFormatError,
    ChecksumMismatch or MacError.
    """
    head = check_header(header, namespace, key, _nbytes(payload), mac=mac)
    check_checksum(head, frame_checksum(header, len(key), payload, mac=mac), key, mac=mac)
    return head


def check_header(
    header: memoryview | bytes | bytearray, namespace: bytes, key: bytes, payload_len: int,
    *, mac: MacKey | None = None,
) -> FrameHeader:
    """:func:`verify_frame` but the checksum: format, algorithm, namespace, key and length.

    For a reader that checksums the payload while copying it: feed it to
    ``FrameDigest(header, len(key), mac=mac)``, then :func:`check_checksum`.
    """
    head = read_header(header)
    _check_algo(head.algo, mac)
    if head.namespace != namespace:
        raise FrameFormatError(
            f"frame of namespace {head.namespace.hex()}, expected {namespace.hex()}"
        )
    if head.key != key:
        raise FrameFormatError(f"frame of key {head.key.hex()}, expected {key.hex()}")
    if head.payload_len != payload_len:
        raise FrameFormatError(f"payload of {head.payload_len} bytes, expected {payload_len}")
    return head


def check_checksum(head: FrameHeader, actual: int, key: bytes, *, mac: MacKey | None = None) -> None:
    """Compare the checksum computed over a frame with its header's (constant time)."""
    if not hmac.compare_digest(_CHECKSUM.pack(actual), _CHECKSUM.pack(head.checksum)):
        if mac is not None:  # never show a tag: it would tell a forger the right one
            raise MacError(f"MAC of key {key.hex()} does not verify under this tier's key")
        raise ChecksumMismatch(
            f"checksum mismatch for key {key.hex()}: stored {head.checksum:016x}, "
            f"computed {actual:016x}"
        )


def compact_payload(
    frame: memoryview, namespace: bytes, key: bytes, *, mac: MacKey | None = None
) -> memoryview:
    """The payload of ``frame``, a whole compact frame verified as ``key``'s in ``namespace``.

    A view into ``frame`` (no copy). Raises FrameFormatError or ChecksumMismatch
    or MacError (all IntegrityError), as :func:`verify_frame` does; a value too
    short to hold the header is a FrameFormatError too.
    """
    header_len = compact_header_len(len(key))
    if frame.nbytes < header_len:
        raise FrameFormatError(f"a value of {frame.nbytes} bytes is no frame")
    payload = frame[header_len:]
    verify_frame(frame[:header_len], payload, namespace, key, mac=mac)
    return payload


def decode_frame(
    frame: memoryview | bytes | bytearray,
    namespace: bytes,
    key: bytes,
    out: memoryview,
    *,
    mac: MacKey | None = None,
) -> None:
    """Verify a frame (compact or aligned) and copy its payload into ``out``.

    ``out`` is written only if the frame verifies, and must be as long as the
    payload. Raises IntegrityError otherwise, leaving ``out`` untouched.
    """
    fv = memoryview(frame).cast("B")
    head = read_header(fv)
    end = head.header_len + head.payload_len
    if end > len(fv):
        raise FrameFormatError(f"truncated frame: {len(fv)} bytes, header says {end}")
    payload = fv[head.header_len : end]
    verify_frame(fv[: head.header_len], payload, namespace, key, mac=mac)
    dst = out.cast("B") if out.format != "B" or out.ndim != 1 else out
    if len(dst) != head.payload_len:
        raise FrameFormatError(f"output of {len(dst)} bytes for a {head.payload_len}-byte payload")
    dst[:] = payload


# ---------------------------------------------------------------------------- helpers
def _check_algo(algo: int, mac: MacKey | None) -> None:
    if mac is not None and algo != ALGO_BLAKE2B_MAC:
        raise MacError(f"frame has no MAC ({_ALGO_NAMES[algo]}); this tier requires one")
    if mac is None and algo != ALGO_XXH3_64:
        raise MacError(f"frame carries a MAC ({_ALGO_NAMES[algo]}); this tier has no key to check it")


def _nbytes(buf: memoryview | bytes | bytearray) -> int:
    return buf.nbytes if isinstance(buf, memoryview) else len(buf)


def _check_key_len(key_len: int) -> None:
    if not 0 < key_len <= MAX_KEY_BYTES:
        raise ValueError(f"key of {key_len} bytes; keys are 1..{MAX_KEY_BYTES} bytes")


def _zero_fill(buf: memoryview | bytearray, start: int, end: int) -> None:
    while start < end:
        n = min(end - start, len(_ZEROS))
        buf[start : start + n] = _ZEROS[:n]
        start += n
