"""Errors of the cache server's wire protocol (:mod:`tiercache.server.protocol`).

:class:`ProtocolError` and its subclasses are what this side refuses (a frame
or body it cannot accept); each has a stable ``code`` that is sent back to the
peer in an ERROR frame. :class:`RemoteError` is the other direction: the peer
answered with an ERROR frame.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """A frame or body this side refuses. ``code`` is sent back in an ERROR frame."""

    code = "protocol_error"


class BadMagic(ProtocolError):
    code = "bad_magic"


class UnsupportedVersion(ProtocolError):
    code = "unsupported_version"


class UnknownMessageType(ProtocolError):
    code = "unknown_type"


class BadFlags(ProtocolError):
    code = "bad_flags"


class MessageTooLarge(ProtocolError):
    code = "too_large"


class UnexpectedPayload(ProtocolError):
    code = "unexpected_payload"


class MalformedBody(ProtocolError):
    code = "malformed_body"


class LimitExceeded(ProtocolError):
    """A well-formed body beyond this receiver's configured limits."""

    code = "limit_exceeded"


class Truncated(ProtocolError):
    """The stream ended inside a frame."""

    code = "truncated"


class Unauthorized(ProtocolError):
    code = "unauthorized"


class HelloRequired(ProtocolError):
    code = "hello_required"


class RemoteError(Exception):
    """The other side answered with an ERROR frame."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
