"""The frame MAC's key: derived from a tier's ``mac_key`` secret, never shown.

A remote tier (the cache-server tier, the Redis tier) given a ``mac_key``
authenticates every frame it writes with a keyed BLAKE2b MAC and refuses, on
load, every frame that does not carry a valid one (:mod:`tiercache.integrity`
says what is covered and why 64 bits). This module holds what turns the
configured secret into that key:

* :class:`MacKey`: the derived key (PBKDF2-SHA256 of the secret, once per tier
  at start-up), with a ``repr`` that shows nothing and no pickling;
* :func:`mac_key_default` and :func:`check_mac_secret`: the option's default
  (the ``TIERCACHE_MAC_KEY`` environment variable) and its bounds, for the
  tiers' settings models.

The secret should be random (``python -c "import secrets;
print(secrets.token_urlsafe(32))"``): whoever can read a stored frame can test
guesses offline, slowed only by the derivation. Every engine that shares a
tier's chunks must use the same secret (one per tenant); rotating it turns
every stored chunk into a miss.

Threading: a MacKey is immutable; any thread.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from pydantic import SecretStr

#: Environment variable that sets ``mac_key`` for every tier that does not set it itself.
MAC_KEY_ENV = "TIERCACHE_MAC_KEY"
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 1024

_KDF_SALT = b"tiercache frame MAC key v1"
_KDF_ROUNDS = 200_000
_MAC_PERSON = b"tiercache-frame1"  # BLAKE2b personalisation: these tags are for frames only


class MacKey:
    """The key of ``ALGO_BLAKE2B_MAC`` frames, derived from a secret of 16 to 1024 bytes."""

    __slots__ = ("_key",)

    def __init__(self, secret: str | bytes) -> None:
        raw = secret.encode() if isinstance(secret, str) else bytes(secret)
        _check_length(len(raw))
        self._key = hashlib.pbkdf2_hmac("sha256", raw, _KDF_SALT, _KDF_ROUNDS, dklen=32)

    @classmethod
    def from_secret(cls, secret: SecretStr | None) -> MacKey | None:
        """The key of a configured ``mac_key`` option; None when it is unset."""
        return None if secret is None else cls(secret.get_secret_value())

    def hasher(self) -> Any:
        """A fresh keyed BLAKE2b with an 8-byte output, to feed a frame's covered bytes to."""
        return hashlib.blake2b(key=self._key, digest_size=8, person=_MAC_PERSON)

    def __repr__(self) -> str:
        return "MacKey(<hidden>)"

    def __reduce__(self) -> Any:
        raise TypeError("a MacKey is not pickled (it would carry the key)")


def mac_key_default() -> SecretStr | None:
    """The ``mac_key`` option's default: ``TIERCACHE_MAC_KEY`` if it is set (empty included)."""
    value = os.environ.get(MAC_KEY_ENV)
    return None if value is None else SecretStr(value)


def check_mac_secret(secret: SecretStr | None) -> SecretStr | None:
    """A ``mac_key`` option's bounds (16 to 1024 bytes); ValueError that shows no part of it.

    An empty secret is an error, not "no MAC": a key that was meant to be set
    must not silently turn authentication off.
    """
    if secret is not None:
        _check_length(len(secret.get_secret_value().encode()))
    return secret


def _check_length(n: int) -> None:
    if not MIN_SECRET_BYTES <= n <= MAX_SECRET_BYTES:
        raise ValueError(
            f"a MAC secret is {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} bytes long, got {n} "
            f"(option mac_key, or env {MAC_KEY_ENV})"
        )
