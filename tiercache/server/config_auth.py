"""The server config's authentication rules: ``auth``, ``auth_token`` and ``tenants``.

:class:`TenantConfig` is one entry of ``tenants:`` (name, token, space,
admin); :func:`check_auth` is the cross-field check :class:`~tiercache.server.config.ServerConfig`
runs once every field is valid. The rules (each a config error naming the
key, never echoing a token):

* ``auth: token`` (the default) needs tokens: ``auth_token`` (shorthand for
  one admin tenant named ``default``) or ``tenants``, not both;
* an empty token (``auth_token: ""``, an empty ``TIERCACHE_SERVER_AUTH_TOKEN``,
  a tenant's ``token: ""``) is an error, never "no authentication";
* ``auth: none`` only on a loopback ``host`` (and then with no tokens): a
  server other machines can reach always authenticates;
* tenant names are unique, and so are tokens (a token names one tenant; two
  tenants share chunks by naming the same ``space``);
* ``max_key_bytes`` leaves room for keys after the tenant's space prefix.

Threading: immutable models and pure functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SecretStr

from tiercache.config.hosts import is_loopback
from tiercache.server.tenants import SPACE_BYTES, space_of

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
#: The tenant ``auth_token`` stands for.
SHORTHAND_TENANT = "default"
#: Shortest key a tenant may send (so ``max_key_bytes`` must be at least this plus the prefix).
MIN_TENANT_KEY_BYTES = 8


def require_token(value: SecretStr | None) -> SecretStr | None:
    """An empty (or blank) token is an error, never a way to switch authentication off."""
    if value is not None and not value.get_secret_value().strip():
        raise ValueError("an empty token is not allowed (it would let anyone in); set a secret or "
                         "remove the key")
    return value


class TenantConfig(BaseModel):
    """One entry of ``tenants:``: a token and the tenant it names."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=NAME_PATTERN, description="Shown in STATS; per-tenant limits key on it.")
    token: Annotated[SecretStr, AfterValidator(require_token)] = Field(
        description="The secret this tenant's clients present in HELLO."
    )
    space: str | None = Field(
        default=None, pattern=NAME_PATTERN,
        description="Key space (default: the name). Tenants naming the same space share chunks.",
    )
    admin: bool = Field(default=False, description="Sees every tenant's clients in STATS (tiercache inspect).")

    @property
    def space_name(self) -> str:
        return self.space if self.space is not None else self.name



def shorthand_tenants(auth_token: SecretStr | None) -> tuple[TenantConfig, ...]:
    """``auth_token`` as the one tenant it stands for (admin: it is the only one)."""
    if auth_token is None:
        return ()
    return (TenantConfig(name=SHORTHAND_TENANT, token=auth_token, admin=True),)


def check_auth(auth: str, host: str, auth_token: SecretStr | None, tenants: Sequence[TenantConfig],
               max_key_bytes: int) -> None:
    """The cross-field rules above; ValueError whose message starts with the offending key."""
    if auth == "none":
        if auth_token is not None or tenants:
            raise ValueError("auth: 'none' but auth_token or tenants are set: use auth: token, or remove them")
        if not is_loopback(host):
            raise ValueError(
                f"host: {host} is not a loopback address and auth is 'none': a server other machines "
                "can reach must authenticate (set auth: token with auth_token or tenants)"
            )
        return
    if auth_token is not None and tenants:
        raise ValueError("auth_token: set either auth_token (one tenant, 'default') or tenants, not both")
    if auth_token is None and not tenants:
        raise ValueError(
            "auth_token: auth is 'token' (the default) but no token is configured: set auth_token "
            "(or TIERCACHE_SERVER_TOKEN) or list tenants; auth: none is allowed on a loopback host only"
        )
    _check_unique(tenants)
    if max_key_bytes < SPACE_BYTES + MIN_TENANT_KEY_BYTES:
        raise ValueError(
            f"max_key_bytes: {max_key_bytes} leaves too little room after the {SPACE_BYTES}-byte tenant "
            f"prefix (at least {SPACE_BYTES + MIN_TENANT_KEY_BYTES} with auth: token)"
        )


def _check_unique(tenants: Sequence[TenantConfig]) -> None:
    names: dict[str, int] = {}
    tokens: dict[str, int] = {}
    spaces: dict[bytes, str] = {}
    for i, tenant in enumerate(tenants):
        if tenant.name in names:
            raise ValueError(f"tenants.{i}.name: '{tenant.name}' is listed twice (tenants.{names[tenant.name]})")
        names[tenant.name] = i
        secret = tenant.token.get_secret_value()
        if secret in tokens:  # config time, not a network-facing compare
            raise ValueError(
                f"tenants.{i}.token: the same token as tenants.{tokens[secret]} (a token names one "
                "tenant; to share chunks give both tenants the same space)"
            )
        tokens[secret] = i
        digest = space_of(tenant.space_name)
        if spaces.setdefault(digest, tenant.space_name) != tenant.space_name:
            raise ValueError(f"tenants.{i}.space: its digest collides with space '{spaces[digest]}'; rename it")
