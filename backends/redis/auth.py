"""How the Redis tier proves who it is to Redis: credentials, TLS, and words for their failures.

:class:`Credentials` is the redis-py credential provider of every connection:
it reads the password (``password``, ``password_env`` or ``password_file`` of
:class:`~tiercache.backends.redis.settings.RedisSettings`) each time a
connection authenticates, so a rewritten ``password_file`` is used from the
next (re)connection on, and the secret is never copied into redis-py's
connection options. :func:`tls_context` builds the one ``ssl.SSLContext`` of a
client (verification required, TLS 1.2 or later, the CA and client
certificate of the settings). :func:`explain` turns a failed connection
attempt into :class:`RedisAuthError` ("authentication failed for user alice at
10.0.0.5:6379: ...") or :class:`RedisTLSError` (a TLS port spoken to in plain
TCP, or the reverse; a certificate not accepted), or leaves it as it was.

Secrets: no message made here contains a password; :func:`redact` takes the
password out of any text taken from an exception, in case a server or a
library ever echoes it.

Threads: whichever thread opens a connection (the reconnect thread, an I/O
lane's thread) calls :meth:`Credentials.get_credentials`; it keeps no state.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Iterator

import redis
from redis.credentials import CredentialProvider
from redis.exceptions import AuthenticationWrongNumberOfArgsError, NoPermissionError
from tiercache.backends.redis.settings import RedisSettings

#: ACL rules of the least-privilege Redis user for this tier (``ACL SETUSER tiercache on
#: >PASSWORD`` and these); add ``+select`` for a database other than 0.
TIER_ACL = ("~tc:*", "+ping", "+hello", "+auth", "+client|setname", "+get", "+set", "+exists",
            "+unlink")
#: The same for a Redis Cluster (slot map, command key positions, ASK redirects).
CLUSTER_ACL = (*TIER_ACL, "+cluster|slots", "+command", "+asking")
#: Longest password_file read (a password is far shorter; a wrong path may name a huge file).
MAX_PASSWORD_FILE_BYTES = 4096
#: Words of servers and redis-py that mean "these credentials were refused".
_AUTH_WORDS = ("WRONGPASS", "NOAUTH", "invalid username-password", "Authentication required",
               "without any password configured", "HELLO must be called")
#: Words of a peer that closed a connection at once (no Redis reply at all).
_CLOSED_WORDS = ("reset by peer", "Connection closed by server", "EOF occurred", "Broken pipe",
                 "Connection aborted", "UNEXPECTED_EOF")


class RedisAuthError(redis.AuthenticationError):
    """Redis refused the tier's credentials, or the user lacks a permission the tier needs."""


class RedisTLSError(redis.ConnectionError):
    """TLS failed: a certificate not accepted, or one side speaking TLS and the other not."""


# --------------------------------------------------------------------------- credentials
def read_password(settings: RedisSettings) -> str | None:
    """The password from the one source the settings name (None: no password).

    Raises RedisAuthError (naming the option, never the secret) when the
    environment variable or the file cannot give one.
    """
    if settings.password is not None:
        return settings.password.get_secret_value()
    if settings.password_env is not None:
        value = os.environ.get(settings.password_env)
        if not value:
            raise RedisAuthError(f"password_env: environment variable {settings.password_env} "
                                 "is not set or empty")
        return value
    if settings.password_file is not None:
        try:
            with open(settings.password_file, "rb") as f:
                raw = f.read(MAX_PASSWORD_FILE_BYTES + 1)
        except OSError as exc:
            raise RedisAuthError(f"password_file: cannot read {settings.password_file}: "
                                 f"{exc.strerror}") from None
        if len(raw) > MAX_PASSWORD_FILE_BYTES:
            raise RedisAuthError(f"password_file: {settings.password_file} is longer than "
                                 f"{MAX_PASSWORD_FILE_BYTES} bytes")
        text = raw.decode("utf-8", errors="strict").removesuffix("\n").removesuffix("\r")
        if not text:
            raise RedisAuthError(f"password_file: {settings.password_file} is empty")
        return text
    return None


def has_credentials(settings: RedisSettings) -> bool:
    """Whether the settings name a user or a password (else the default user, no AUTH)."""
    return settings.username is not None or any(
        getattr(settings, k) is not None for k in ("password", "password_env", "password_file")
    )


class Credentials(CredentialProvider):
    """redis-py's credential provider for the tier: the password is read at every AUTH."""

    def __init__(self, settings: RedisSettings) -> None:
        self._settings = settings

    def get_credentials(self) -> tuple[str] | tuple[str, str]:
        password = read_password(self._settings)
        if self._settings.username is None:
            return (password or "",)
        return (self._settings.username, password or "")  # "": a nopass user

    def __repr__(self) -> str:
        return f"<redis credentials of user {self._settings.username or 'default'}>"


# ----------------------------------------------------------------------------------- TLS
def tls_context(settings: RedisSettings) -> ssl.SSLContext | None:
    """The TLS context of a client of ``settings`` (None: plain TCP). Reads the files now."""
    if not settings.uses_tls:
        return None
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=settings.ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = settings.check_hostname
    context.verify_mode = ssl.CERT_REQUIRED
    if settings.cert_file is not None:
        context.load_cert_chain(settings.cert_file, settings.key_file)
    return context


# ------------------------------------------------------------------------------ failures
def explain(exc: BaseException, settings: RedisSettings) -> BaseException:
    """``exc`` (a failed connect) in words that name the cause and no secret.

    Credentials refused: :class:`RedisAuthError` "authentication failed for
    user U at WHERE: <the server's words>". A missing permission: a
    RedisAuthError saying so. TLS trouble: :class:`RedisTLSError` with a hint
    (plain TCP to a TLS port, TLS to a plain port, a certificate not accepted,
    a client certificate wanted). Anything else: ``exc`` itself.
    """
    if isinstance(exc, (RedisAuthError, RedisTLSError)):
        return exc
    chain = list(_chain(exc))
    said = redact("; ".join(dict.fromkeys(str(e) for e in chain if str(e))), _password(settings))
    where, user = settings.address(), settings.username or "default"
    if any(isinstance(e, (redis.AuthenticationError, AuthenticationWrongNumberOfArgsError))
           for e in chain) or any(word in said for word in _AUTH_WORDS):
        if not has_credentials(settings):
            said = ("the server wants a password and none is configured (password, "
                    "password_env or password_file)")
        return RedisAuthError(f"authentication failed for user {user} at {where}: {said}")
    if any(isinstance(e, NoPermissionError) for e in chain) or "NOPERM" in said:
        rules = " ".join(CLUSTER_ACL if settings.cluster else TIER_ACL)
        return RedisAuthError(f"user {user} at {where} lacks a permission the tier needs "
                              f"(its ACL rules: {rules}): {said}")
    hint = _tls_hint(chain, said, settings.uses_tls)
    if hint:
        return RedisTLSError(f"cannot connect to {where}: {hint} ({said})")
    return exc


def _tls_hint(chain: list[BaseException], said: str, tls: bool) -> str:
    closed = any(word in said for word in _CLOSED_WORDS)
    if not tls:
        return ("the server closed the connection at once; if that port speaks TLS, use a "
                "rediss:// url or tls: true") if closed else ""
    if "CERTIFICATE_VERIFY_FAILED" in said or any(
        isinstance(e, ssl.SSLCertVerificationError) for e in chain
    ):
        return "the server's certificate was not accepted (check ca_file, server_name)"
    if "WRONG_VERSION_NUMBER" in said or "record layer" in said or "packet length" in said or (
        any(isinstance(e, (redis.TimeoutError, TimeoutError)) for e in chain)
    ):
        return ("no TLS answer: if that port speaks plain TCP, use a redis:// url and "
                "tls: false (or the host is unreachable)")
    if closed or "certificate required" in said or "alert" in said:
        return ("the server ended the TLS handshake; it may want a client certificate "
                "(cert_file, key_file) signed by a CA it trusts")
    return ""


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and its causes and contexts (each once, at most 16)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < 16:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _password(settings: RedisSettings) -> str | None:
    try:
        return read_password(settings)
    except RedisAuthError:
        return None


def redact(text: str, secret: str | None) -> str:
    """``text`` with every occurrence of ``secret`` replaced by ``***``."""
    return text.replace(secret, "***") if secret else text
