"""Client authentication: the shared token every HELLO must carry when one is configured.

The comparison is constant-time (:func:`hmac.compare_digest` over the UTF-8
bytes), so the time a refusal takes says nothing about how much of the token
was right. With no token configured every HELLO is accepted (the server binds
to loopback by default for that reason). Called on the event loop thread by
the connection handler; holds no state.
"""

from __future__ import annotations

import hmac

from tiercache.server.protocol import Hello, Unauthorized


def check_token(expected: str | None, hello: Hello) -> None:
    """Raise :class:`Unauthorized` unless ``hello`` carries ``expected`` (or none is required)."""
    if expected is None:
        return
    if not hmac.compare_digest(expected.encode("utf-8"), hello.token.encode("utf-8")):
        raise Unauthorized("missing or wrong auth token")
