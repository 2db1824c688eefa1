"""The consumer's end of the P/D side channel: one link per producer rank, and the set of them.

:class:`PeerLink` shakes hands with one producer rank (the messages:
:mod:`tiercache.pd.channel`): it sends our fingerprint, checks the producer's
answer (:func:`tiercache.pd.heads.tp_mismatches`), keeps the addresses the
answer names (host slab and its tags, a planes slab's planes, mode direct's KV
blocks and their tags, the pages by KV head) and loads the producer's NIXL
agent into ours, once a throwaway process loaded it and survived
(:mod:`tiercache.nixl_vetting`: malformed metadata can abort the process that
loads it; such a producer is refused like an incompatible one). Its socket
stays open for the one-way read notices (:meth:`PeerLink.notify_read`).

:class:`PeerLinks` holds a consumer's links by producer address: a handshake
is retried in short attempts until the read timeout (a producer answers
between its engine steps, or may be restarting), a refusal is remembered (the
producer is never asked again), and a link that failed is dropped (its agent
removed from ours) so the next read shakes hands afresh.

Threads: a link, and the :class:`PeerLinks` holding it, are used by one
thread at a time (the consumer reader's, under its ``_io_lock``).
"""

from __future__ import annotations

import logging
import select
import socket
import time
from collections.abc import Callable
from typing import Any

from tiercache.nixl_vetting import MetadataRefused, MetadataVetter
from tiercache.pd import auth
from tiercache.pd.blocks import BlockRegions
from tiercache.pd.channel import REPLY_TIMEOUT_S, ChannelError, recv_message, send_message
from tiercache.pd.heads import PageHeads, tp_mismatches

logger = logging.getLogger(__name__)

HELLO_ATTEMPT_S = 1.0  # one handshake attempt's timeout; attempts repeat until the read timeout

Address = tuple[str, int]  # a producer rank's side channel: (host, port)


class AuthError(ChannelError):
    """The producer did not prove it holds our secret, or refused our proof (not retried within a read)."""


class PeerLink:
    """Consumer: the handshake with one producer rank (its agent added to ours).

    ``key``: the shared secret (empty: none configured; a producer with one refuses us).
    ``vetter``: loads the producer's metadata in a throwaway process first (None: loaded unvetted).
    """

    def __init__(self, host: str, port: int, fingerprint: dict[str, Any], agent: Any, timeout_s: float,
                 key: bytes = b"", vetter: MetadataVetter | None = None) -> None:
        self.address = f"{host}:{port}"
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as exc:
            raise ChannelError(f"producer {self.address} unreachable: {exc}") from exc
        self._sock = sock  # kept open: read notices go over it
        try:
            metadata = self._hello(fingerprint, key)
            if vetter is not None:
                vetter.vet(metadata)
        except ChannelError:
            sock.close()
            raise
        except MetadataRefused as exc:
            sock.close()
            if exc.transient:  # retried, then this read fails
                raise ChannelError(f"producer {self.address}: its NIXL metadata: {exc}") from None
            raise ChannelError(f"producer {self.address} is incompatible: its NIXL metadata cannot be loaded: {exc}") from None
        name = agent.add_remote_agent(metadata)
        self.agent_name = name.decode() if isinstance(name, bytes) else str(name)

    def _exchange(self, message: dict[str, Any]) -> dict[str, Any]:
        try:
            send_message(self._sock, message)
            return recv_message(self._sock)
        except (OSError, ChannelError) as exc:
            raise ChannelError(f"producer {self.address}: handshake: {exc}") from exc

    def _hello(self, fingerprint: dict[str, Any], key: bytes) -> bytes:
        """The handshake: mutual proofs, then the producer's answer checked; its agent metadata."""
        ours = auth.new_nonce()
        challenge = self._exchange({"op": "hello", "nonce": ours})
        theirs = challenge.get("nonce")
        if not challenge.get("ok") or not auth.valid_nonce(theirs):
            raise ChannelError(f"producer {self.address}: handshake: no challenge ({challenge.get('error')!r:.200})")
        reply = self._exchange({"op": "prove", "proof": auth.consumer_proof(key, ours, theirs),
                                "fingerprint": fingerprint})
        if "proof" not in reply and not reply.get("ok"):
            raise AuthError(f"producer {self.address} refused our proof: {str(reply.get('error'))[:200]} "
                            "(pd.secret differs, or only one side has one)")
        if not auth.proof_matches(auth.producer_proof(key, ours, theirs), reply.get("proof")):
            raise AuthError(f"producer {self.address} did not prove it holds our pd.secret: not read from")
        if not reply.get("ok"):
            error = str(reply.get("error"))[:500]
            fields = error.rpartition("differing fields: ")[2].split(", ") if "differing fields" in error else []
            mine = "; ".join(f"{f} (ours: {fingerprint.get(f, '<absent>')!r})" for f in fields if f)
            raise ChannelError(f"producer {self.address} refused us: {error}" + (f"; {mine}" if mine else ""))
        diff = tp_mismatches(fingerprint, reply.get("fingerprint") or {})
        if diff:
            raise ChannelError(f"producer {self.address} is incompatible: " + "; ".join(diff))
        try:
            self.slab_addr = int(reply["slab_addr"])
            self.slot_bytes = int(reply["slot_bytes"])
            self.num_slots = int(reply["num_slots"])
            self.tags_addr = int(reply["tags_addr"])
            # a planes slab: where each region's plane of host blocks lies (absent: slots)
            self.slot_planes = BlockRegions.from_wire(reply["slot_planes"]) if "slot_planes" in reply else None
            # mode direct: the producer's KV blocks and their tags (absent when it exposes none)
            self.blocks = BlockRegions.from_wire(reply["blocks"]) if "blocks" in reply else None
            self.block_tags_addr = int(reply.get("block_tags_addr", 0))
            # one xxh3-64 per slot position (tiercache.pd.page_hashes); 0: none published
            self.hashes_addr = int(reply.get("hashes_addr", 0))
            self.hash_positions = int(reply.get("hash_positions", 0))
            # its pages by KV head (a consumer of another TP size reads head sub-runs; absent: unknown)
            self.page_heads = PageHeads.from_wire(reply["page_heads"]) if "page_heads" in reply else None
            return bytes(reply["metadata"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ChannelError(f"producer {self.address}: malformed hello answer: {exc!r}") from exc

    def notify_read(self, request_id: str, token: str, rank: int = 0, readers: int = 1) -> None:
        """Tell the producer its hand-off ``request_id`` was read (one-way; it releases the chunks).

        ``token``: the hand-off's release token (from its params); the producer ignores a notice
        without the right one. ``readers`` > 1 (a consumer of another TP size): that many consumer
        ranks read this producer rank; it counts the hand-off read once each (``rank``) has said so.
        """
        message: dict[str, Any] = {"op": "read", "request_id": request_id, "token": token}
        if readers > 1:
            message.update(rank=rank, readers=readers)
        try:
            self._sock.settimeout(REPLY_TIMEOUT_S)
            send_message(self._sock, message)
        except OSError as exc:
            raise ChannelError(f"producer {self.address}: read notification: {exc}") from exc

    def alive(self) -> bool:
        """The producer has not closed the link (its idle timeout, a restart): nothing to read on it."""
        try:
            readable, _, _ = select.select([self._sock], [], [], 0)
            return not readable or bool(self._sock.recv(1, socket.MSG_PEEK))
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        self._sock.close()


class PeerLinks:
    """A consumer's links by producer address: handshakes retried, refusals remembered, failed links dropped.

    ``counters`` is the reader's: ``hello_retries``, ``refused_peers`` and
    ``auth_failures`` are counted in it. ``on_drop`` runs before a dropped link
    closes (the reader forgets what it holds for that producer's agent).
    ``key``: the shared secret (empty: none). A producer's agent metadata is
    vetted in a throwaway process (started here) before our agent loads it.
    """

    def __init__(self, agent: Any, fingerprint: dict[str, Any], timeout_s: float, counters: dict[str, int],
                 on_drop: Callable[[PeerLink], None], key: bytes = b"") -> None:
        self.agent = agent
        self._vetter = MetadataVetter(timeout_s=max(1.0, timeout_s))
        self._vetter.start()
        self._key = key
        self.fingerprint = fingerprint
        self.timeout_s = timeout_s
        self.counters = counters
        self._on_drop = on_drop
        self._links: dict[Address, PeerLink] = {}
        self._refused: dict[Address, str] = {}

    def __contains__(self, addr: Address) -> bool:
        """Shaken hands with already, and still open (a read from it need not wait for the producer's answer)."""
        link = self._links.get(addr)
        return link is not None and link.alive()

    def get(self, addr: Address) -> PeerLink:
        """The link to ``addr``, shaking hands first if there is none (ChannelError if refused or unreachable)."""
        if addr in self._refused:
            raise ChannelError(self._refused[addr])
        link = self._links.get(addr)
        if link is not None and not link.alive():  # the producer closed it: shake hands again
            self.drop(addr)
            link = None
        if link is None:
            link = self._connect(addr)
            self._links[addr] = link
        return link

    def _connect(self, addr: Address) -> PeerLink:
        """Handshake with a producer, retrying short attempts until ``timeout_s``.

        A producer answers between its engine steps, so a handshake that lands
        in a long forward pass waits for it; a dead producer is retried until
        the deadline (it may be restarting).
        """
        deadline = time.monotonic() + self.timeout_s
        self._vetter.ready(self.timeout_s)  # started before the handshake: the link is not left idle
        while True:
            attempt_s = min(HELLO_ATTEMPT_S, max(0.05, deadline - time.monotonic()))
            try:
                return self._attempt(addr, attempt_s)
            except AuthError:
                raise
            except ChannelError:
                if addr in self._refused or time.monotonic() >= deadline:
                    raise
            self.counters["hello_retries"] += 1
            time.sleep(0.05)

    def _attempt(self, addr: Address, attempt_s: float) -> PeerLink:
        """One handshake attempt; a refusal is remembered and an authentication failure counted."""
        try:
            return PeerLink(addr[0], addr[1], self.fingerprint, self.agent, attempt_s, self._key, self._vetter)
        except AuthError as exc:
            self.counters["auth_failures"] += 1
            logger.error("tiercache P/D: %s", exc)
            raise
        except ChannelError as exc:
            if "refused us" in str(exc) or "incompatible" in str(exc):
                self.refuse(addr, str(exc))
            raise

    def warm(self, addr: Address) -> PeerLink | None:
        """One handshake attempt with ``addr`` before any hand-off names it (start-up warm-up).

        The link, kept as :meth:`get` keeps it; None: not yet (the producer is not reachable, or
        the vetting process has not started): try again later. ChannelError: never (it refused
        us, remembered as in :meth:`get`, or the authentication failed, counted and logged).
        """
        if addr in self:
            return self._links[addr]
        if addr in self._refused:
            raise ChannelError(self._refused[addr])
        if addr in self._links:  # the producer closed it: shake hands again, as get() would
            self.drop(addr)
        if not self._vetter.ready(self.timeout_s):
            return None
        try:
            link = self._attempt(addr, HELLO_ATTEMPT_S)
        except AuthError:
            raise
        except ChannelError:
            if addr in self._refused:
                raise
            return None
        self._links[addr] = link
        return link

    def refuse(self, addr: Address, why: str) -> None:
        """Never read from ``addr`` again (an incompatible producer): ``why`` is the error each read gets."""
        self._refused[addr] = why
        self.counters["refused_peers"] += 1
        logger.error("tiercache P/D: %s", why)

    def drop(self, addr: Address) -> None:
        """Forget the link to ``addr`` (after a failed read): the next read shakes hands again."""
        link = self._links.pop(addr, None)
        if link is not None:
            self._on_drop(link)
            link.close()
            try:
                self.agent.remove_remote_agent(link.agent_name)
            except Exception:
                logger.debug("tiercache P/D: removing agent %s failed", link.agent_name, exc_info=True)

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the vetting process to have started; whether it has.

        A first handshake waits for it within its own deadline (so a read right after
        start-up can time out on a loaded machine); callers that must not, wait here first.
        """
        return self._vetter.ready(timeout_s)

    def close(self) -> None:
        """Close every link's socket and the vetting process (the reader is closing)."""
        for link in self._links.values():
            link.close()
        self._vetter.close()
