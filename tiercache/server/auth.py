"""Client authentication: the token of every HELLO names its tenant (or is refused).

:class:`TokenTable` holds a SHA-256 digest of every configured token with the
:class:`~tiercache.server.tenants.Tenant` it names. :meth:`TokenTable.authenticate`
compares the presented token's digest with *every* configured digest using
:func:`hmac.compare_digest` and never stops at a match, so neither the time a
refusal takes nor the time an acceptance takes says which tenant matched or
how much of a token was right (digests also hide the tokens' lengths). An
empty token is never accepted. With ``auth: none`` (loopback only, see
:mod:`tiercache.server.config_auth`) the table is *open*: every HELLO is the
one implicit tenant with an empty key space.

Called on the event loop thread by the connection handler; the table is
immutable after construction.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from typing import TYPE_CHECKING

from tiercache.server.protocol import Unauthorized
from tiercache.server.tenants import Tenant, open_tenant, space_of

if TYPE_CHECKING:
    from tiercache.server.config import ServerConfig


def token_digest(token: str) -> bytes:
    """The digest a token is stored and compared as (constant length whatever the token)."""
    return hashlib.sha256(b"tiercache-token\0" + token.encode("utf-8")).digest()


class TokenTable:
    """Configured tokens -> tenants; ``open`` (auth: none): everyone is the implicit tenant."""

    def __init__(self, entries: Iterable[tuple[str, Tenant]], open_access: bool = False) -> None:
        self._entries = [(token_digest(token), tenant) for token, tenant in entries]
        self.open = open_access
        self._open_tenant = open_tenant()
        if not self.open and not self._entries:
            raise ValueError("a token table needs at least one token (or open access)")

    @classmethod
    def from_config(cls, config: ServerConfig) -> TokenTable:
        """The table of a validated server config (its tokens read here, never logged)."""
        if config.auth == "none":
            return cls((), open_access=True)
        return cls(
            (t.token.get_secret_value(), Tenant(t.name, space_of(t.space_name), t.admin))
            for t in config.tenant_list()
        )

    @property
    def tenants(self) -> list[Tenant]:
        """Every tenant a token names (the implicit one when open)."""
        return [self._open_tenant] if self.open else [tenant for _, tenant in self._entries]

    def authenticate(self, token: str) -> Tenant:
        """The tenant ``token`` names; :class:`Unauthorized` if none (same message whatever was wrong)."""
        if self.open:
            return self._open_tenant
        presented = token_digest(token)
        found: Tenant | None = None
        for digest, tenant in self._entries:  # every entry, always: no early exit on a match
            if hmac.compare_digest(digest, presented) and found is None:
                found = tenant
        if found is None or not token:
            raise Unauthorized("missing or wrong auth token")
        return found
