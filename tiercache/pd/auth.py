"""The P/D side channel's cryptography: the mutual-authentication proofs and the hand-offs' release tokens.

**Handshake proofs.** Producer and consumer share ``pd.secret``; each proves
it holds the secret by an HMAC-SHA256 over both sides' fresh nonces, under a
label naming the prover, so a proof is never valid for the other direction nor
for another connection. The consumer proves first, after it heard the
producer's nonce: a stranger who connects to a producer learns nothing but
that random nonce (no MAC it could test guessed secrets against). The
producer's proof goes back with its answer, and the consumer checks it before
it uses or believes anything in that answer (the messages:
:mod:`tiercache.pd.channel`). Without a secret (loopback only) the same
handshake runs with an empty key: it proves nothing, but the code path is one.

**Release tokens.** A producer hands off request ``r`` with the token
``release_token(release_key, r)`` in its ``kv_transfer_params``; only a read
notice that echoes it releases the hand-off. ``release_key`` is random per
producer engine, made by its scheduler and sent to its workers in each step's
metadata (:class:`tiercache.connector.pd.step.PDStepMeta`), never to a
consumer: a consumer can release only the hand-offs it was given.

Every comparison of a proof or a token is :func:`hmac.compare_digest`.
Pure functions and constants; no state, no I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import os

NONCE_BYTES = 32
MAC_BYTES = 32
RELEASE_KEY_BYTES = 32
TOKEN_BYTES = 16  # a release token: 128 bits of HMAC-SHA256, hex on the wire
PROTOCOL = b"tiercache-pd-auth-v1"
_CONSUMER = b"consumer"
_PRODUCER = b"producer"
_RELEASE = b"tiercache-pd-release-v1"


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def _mac(key: bytes, who: bytes, consumer_nonce: bytes, producer_nonce: bytes) -> bytes:
    message = b"|".join((PROTOCOL, who, consumer_nonce, producer_nonce))
    return hmac.new(key, message, hashlib.sha256).digest()


def consumer_proof(key: bytes, consumer_nonce: bytes, producer_nonce: bytes) -> bytes:
    """The consumer's proof that it holds ``key``, bound to this connection's two nonces."""
    return _mac(key, _CONSUMER, consumer_nonce, producer_nonce)


def producer_proof(key: bytes, consumer_nonce: bytes, producer_nonce: bytes) -> bytes:
    """The producer's proof (another label: the consumer's proof replayed back is not one)."""
    return _mac(key, _PRODUCER, consumer_nonce, producer_nonce)


def valid_nonce(nonce: object) -> bool:
    return isinstance(nonce, bytes) and len(nonce) == NONCE_BYTES


def proof_matches(expected: bytes, got: object) -> bool:
    """``got`` is ``expected`` (constant time; anything but bytes of the right length is not)."""
    return isinstance(got, bytes) and len(got) == MAC_BYTES and hmac.compare_digest(expected, got)


def new_release_key() -> bytes:
    return os.urandom(RELEASE_KEY_BYTES)


def release_token(release_key: bytes, request_id: str) -> str:
    """The token that releases the hand-off of ``request_id`` (hex)."""
    digest = hmac.new(release_key, _RELEASE + b"|" + request_id.encode(), hashlib.sha256).digest()
    return digest[:TOKEN_BYTES].hex()


def token_matches(release_key: bytes | None, request_id: str, token: object) -> bool:
    """``token`` releases ``request_id`` (constant time; False without a key or with a malformed token)."""
    if not release_key or not isinstance(token, str) or len(token) != 2 * TOKEN_BYTES:
        return False
    return hmac.compare_digest(release_token(release_key, request_id).encode(), token.encode())

