"""Prefill/decode hand-off, scheduler side: the producer's holds and the consumer's peer tier.

Runs inside :class:`tiercache.connector.scheduler.TierCacheScheduler` (vLLM's
scheduler thread), on the same manager and the same store/load pipeline as
offloading (DESIGN.md section 6):

* **Producer** (kv_role ``kv_producer``, or ``kv_both`` with a ``pd`` section):
  a request sent with ``kv_transfer_params={"do_remote_decode": True}`` stores
  its prompt chunks through the normal store path into the host tier. When it
  finishes, :meth:`PDScheduler.request_finished` pins (holds) those chunks and
  returns the hand-off parameters (vLLM NixlConnector's shape, see
  tiercache.handoff), naming the host slot of each chunk. The device blocks
  are freed at once (mode ``via_host``). A hold ends when the worker reports
  the consumer's read notification, or after ``pd.handoff_timeout_s``
  (expired; counted): the chunks then stay as ordinary, evictable cache.
  While anything is held, :meth:`PDScheduler.has_pending` keeps the engine
  stepping (vLLM's ``has_pending_push_work``), because the worker serves
  handshakes and collects notifications between steps (vLLM's NixlConnector
  keeps its producer stepping the same way, through delayed block frees).
* **Consumer** (kv_role ``kv_consumer``, or ``kv_both`` with ``pd``): a
  request carrying a tiercache hand-off teaches the manager that the ``peer``
  tier (read-only, shared) holds its chunks, after checking the producer's
  fingerprint against its own (a mismatch is refused with an error naming the
  fields, and counted). Lookup, prepare_load and staging then treat the
  producer like any lower tier; :meth:`sources_for` tells the worker which
  producer holds each key it loads. After the load the knowledge is dropped
  (the producer releases the chunks); a failed load is recomputed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tiercache.backends.nixl_peer import PEER_TIER, PeerChunk, PeerSource
from tiercache.config import PDConfig
from tiercache.handoff import Handoff, HandoffError, fingerprint, mismatches
from tiercache.keys import KeySpace
from tiercache.manager import OffloadingManager

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

PRODUCER_ROLES = ("kv_producer", "kv_both")
CONSUMER_ROLES = ("kv_consumer", "kv_both")


def pd_settings(kv_role: str, pd: PDConfig | None) -> PDConfig | None:
    """The P/D settings in force for this role (None: no P/D at all)."""
    if kv_role in ("kv_producer", "kv_consumer"):
        return pd or PDConfig()
    return pd  # kv_both: only when configured


@dataclass
class _Hold:
    keys: list[bytes]
    deadline: float


class PDScheduler:
    def __init__(self, settings: PDConfig, kv_role: str, keys: KeySpace, manager: OffloadingManager,
                 chunk_tokens: int, engine_id: str, tp_size: int) -> None:
        self.settings = settings
        self.chunk_tokens = chunk_tokens
        self.is_producer = kv_role in PRODUCER_ROLES
        self.is_consumer = kv_role in CONSUMER_ROLES
        self.keys = keys
        self.manager = manager
        self.engine_id = engine_id
        self.tp_size = tp_size
        self.fingerprint = fingerprint(keys.namespace)
        self._holds: dict[str, _Hold] = {}
        self._sources: dict[bytes, PeerChunk] = {}
        self._asked: set[str] = set()  # consumer requests whose hand-off was looked at
        self.counters: dict[str, int] = {
            "handoffs_offered": 0, "handoffs_read": 0, "handoffs_expired": 0,
            "handoffs_refused": 0, "handoff_chunks_received": 0,
        }

    @property
    def held_chunks(self) -> int:
        return sum(len(h.keys) for h in self._holds.values())

    def has_pending(self) -> bool:
        """Hand-offs are held: the engine must keep stepping to hear of their reads."""
        return bool(self._holds)

    # ------------------------------------------------------------------ producer
    def request_finished(self, request: Request) -> dict[str, Any] | None:
        params = request.kv_transfer_params or {}
        if not self.is_producer or not params.get("do_remote_decode"):
            return None
        keys = self.keys.chunk_keys(request.block_hashes)
        prompt_chunks = request.num_prompt_tokens // self.chunk_tokens
        held = self.manager.hold(keys[:prompt_chunks])
        slots = self.manager.host_slots(held)
        if held:
            self._holds[request.request_id] = _Hold(held, time.monotonic() + self.settings.handoff_timeout_s)
        self.counters["handoffs_offered"] += 1
        return Handoff(
            engine_id=self.engine_id, host=self.settings.host, port=self.settings.port,
            request_id=request.request_id, keys=tuple(held), slots=tuple(slots), fingerprint=self.fingerprint,
            tp_size=self.tp_size,
        ).to_params()

    def handoffs_read(self, request_ids: set[str]) -> None:
        """The worker saw the consumers' read notifications: release those holds."""
        for rid in request_ids:
            hold = self._holds.pop(rid, None)
            if hold is not None:
                self.manager.complete_load(hold.keys)
                self.counters["handoffs_read"] += 1

    def expire(self, now: float | None = None) -> None:
        """Release holds nobody read in time (called every step)."""
        now = time.monotonic() if now is None else now
        for rid in [r for r, h in self._holds.items() if h.deadline <= now]:
            hold = self._holds.pop(rid)
            self.manager.complete_load(hold.keys)
            self.counters["handoffs_expired"] += 1
            logger.info("tiercache P/D: hand-off of %s (%d chunks) expired unread", rid, len(hold.keys))

    # ------------------------------------------------------------------ consumer
    def learn(self, request: Request, keys: list[bytes]) -> None:
        """Before the lookup: teach the manager what the request's producer holds."""
        if not self.is_consumer or request.request_id in self._asked:
            return
        self._asked.add(request.request_id)
        try:
            handoff = Handoff.from_params(request.kv_transfer_params or {})
        except HandoffError as exc:
            logger.error("tiercache P/D: request %s: %s; recomputing", request.request_id, exc)
            self.counters["handoffs_refused"] += 1
            return
        if handoff is None:
            return
        diff = mismatches(self.fingerprint, handoff.fingerprint)
        if diff:
            logger.error("tiercache P/D: refusing the hand-off of request %s from %s (%s:%d): "
                         "incompatible peer: %s; recomputing", request.request_id, handoff.engine_id,
                         handoff.host, handoff.port, "; ".join(diff))
            self.counters["handoffs_refused"] += 1
            return
        n = len(handoff.keys)
        if tuple(keys[:n]) != handoff.keys:
            logger.error("tiercache P/D: request %s: the producer's chunk keys do not match this "
                         "prompt (different tokens?); recomputing", request.request_id)
            self.counters["handoffs_refused"] += 1
            return
        src = PeerSource(handoff.host, handoff.port, handoff.request_id)
        self.manager.learn(PEER_TIER, list(handoff.keys))
        for key, slot in zip(handoff.keys, handoff.slots):
            self._sources[key] = PeerChunk(src, slot)

    def sources_for(self, tiers: tuple[str, ...], keys: tuple[bytes, ...]) -> dict[bytes, PeerChunk]:
        """Where the producers hold the keys a load plan reads from the peer tier."""
        return {k: self._sources[k] for k, t in zip(keys, tiers) if t == PEER_TIER and k in self._sources}

    def load_finished(self, keys: tuple[bytes, ...], failed: set[bytes]) -> None:
        """A load ended: forget what the producer held (it releases the chunks now)."""
        peer_keys = [k for k in keys if self._sources.pop(k, None) is not None]
        if peer_keys:
            self.manager.forget(PEER_TIER, peer_keys)
            self.counters["handoff_chunks_received"] += sum(1 for k in peer_keys if k not in failed)

    def forget_request(self, request_id: str) -> None:
        self._asked.discard(request_id)
