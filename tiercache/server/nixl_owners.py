"""Which tenant a remote NIXL agent belongs to, so one tenant cannot take over another's agent.

The server loads each NIXL client's agent metadata (its name, UCX address and
registered memory) and later READs from / WRITEs to that agent by *name*.
Loading metadata under a name that is loaded already replaces it. Without a
check, a client could send metadata carrying another client's agent name (in
HELLO or AGENT_META) and have the server WRITE that client's GET_REMOTE values
into its own memory, or READ its own bytes into the victim's PUT_REMOTE.

:class:`AgentOwners` binds every loaded agent name to the tenant whose
connection loaded it, for as long as a connection uses it: metadata naming an
agent held by another tenant is refused before it is loaded; AGENT_META may
only update the connection's own agent. Connections of one tenant may share
an agent (an engine's I/O threads do). :func:`agent_name` reads the name
from the metadata's header without loading it; metadata it cannot read is
refused. Metadata is loaded only after the endpoint's vetter loaded it in a
throwaway process (:meth:`NixlEndpoint.vet`); a refusal there is an
:class:`AgentRefused` too.

Threading: event loop thread only.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

from tiercache.nixl_vetting import MetadataRefused

if TYPE_CHECKING:
    from tiercache.server.nixl_path import NixlEndpoint

_HEADER = b"nixlSerDes|Agent"
_MAX_NAME = 1024


class AgentRefused(ValueError):
    """Metadata this connection may not load (unreadable, or another tenant's agent)."""


def agent_name(metadata: bytes) -> str:
    """The agent name serialized at the head of NIXL agent metadata; AgentRefused if unreadable."""
    head = len(_HEADER)
    if not metadata.startswith(_HEADER) or len(metadata) < head + 8:
        raise AgentRefused("not NIXL agent metadata")
    (size,) = struct.unpack_from("<Q", metadata, head)
    if not 0 < size <= _MAX_NAME or len(metadata) < head + 8 + size:
        raise AgentRefused("NIXL agent metadata with a bad name length")
    try:
        return metadata[head + 8 : head + 8 + size].decode("utf-8")
    except UnicodeDecodeError:
        raise AgentRefused("NIXL agent name is not UTF-8") from None


class AgentOwners:
    """Loaded agent name -> (owning tenant, connections using it)."""

    def __init__(self) -> None:
        self._owners: dict[str, tuple[str, int]] = {}

    def owner(self, name: str) -> str | None:
        entry = self._owners.get(name)
        return entry[0] if entry is not None else None

    async def add(self, nixl: NixlEndpoint, tenant: str, metadata: bytes) -> str:
        """Load a connection's agent for ``tenant``; its name. AgentRefused if another tenant holds it."""
        name = agent_name(metadata)
        self._check(name, tenant)
        await _vet(nixl, metadata, name)
        self._check(name, tenant)  # again: another connection may have loaded it meanwhile
        loaded = nixl.add_peer(metadata)
        if loaded != name:  # the header and NIXL disagree: trust neither
            nixl.drop_peer(loaded)
            raise AgentRefused("NIXL agent metadata names another agent than its header")
        owner, count = self._owners.get(loaded, (tenant, 0))
        self._owners[loaded] = (owner, count + 1)
        return loaded

    async def update(self, nixl: NixlEndpoint, own: str, tenant: str, metadata: bytes) -> None:
        """AGENT_META: reload the connection's own agent ``own``; AgentRefused for any other name."""
        name = agent_name(metadata)
        if name != own:
            raise AgentRefused("AGENT_META names another agent than this connection's")
        await _vet(nixl, metadata, name)
        self._check(name, tenant)
        nixl.update_peer(metadata)

    def drop(self, nixl: NixlEndpoint, name: str) -> None:
        """A connection using ``name`` closed (the agent is unloaded with its last connection)."""
        nixl.drop_peer(name)
        owner, count = self._owners.get(name, ("", 1))
        if count > 1:
            self._owners[name] = (owner, count - 1)
        else:
            self._owners.pop(name, None)

    def _check(self, name: str, tenant: str) -> None:
        owner = self.owner(name)
        if owner is not None and owner != tenant:
            raise AgentRefused("that NIXL agent name is in use by another client")


async def _vet(nixl: NixlEndpoint, metadata: bytes, name: str) -> None:
    try:
        vetted = await nixl.vet(metadata)
    except MetadataRefused as exc:
        raise AgentRefused(str(exc)) from None
    if vetted != name:
        raise AgentRefused("NIXL agent metadata names another agent than its header")
