"""Prefill/decode hand-off, scheduler side: the producer's holds and the consumer's peer tier.

Runs inside :class:`tiercache.connector.scheduler.TierCacheScheduler` (vLLM's
scheduler thread), on the same manager and the same store/load pipeline as
offloading: a producer's hand-off is chunks its host tier holds (or blocks it
pins), a consumer's is a load from one more tier. It is the connector's
scheduler-side P/D role (tiercache.connector.pd.roles: the hooks).

* **Producer** (kv_role ``kv_producer``, or ``kv_both`` with a ``pd`` section):
  a request sent with ``kv_transfer_params={"do_remote_decode": True}``
  finishes with :meth:`PDScheduler.request_finished` returning the hand-off
  parameters (vLLM NixlConnector's shape, see tiercache.pd.handoff).
  Mode ``via_host``: its prompt chunks were stored through the normal store
  path into the host tier; they are pinned (held) and the params name the host
  slot of each; the device blocks are freed at once. Mode ``direct``: the
  request's device blocks are pinned (connector/block_pins.py: our own
  reference in vLLM's block pool, so vLLM frees the request at once and need
  not keep stepping, as it does for NixlConnector's delayed frees) and the
  params name them; the worker marks them held (their tags) right after the
  forward pass that completes the prompt (:meth:`PDScheduler.mark_prefill`, so
  no later step is needed before a consumer may read). A hold ends when the
  worker reports the consumer's read notification, or after
  ``pd.handoff_timeout_s`` (expired; counted): via_host chunks then stay as
  ordinary, evictable cache; direct blocks are unpinned once every worker
  (TP rank) reported their tags cleared (:meth:`PDScheduler.blocks_released`).
  Reads need no producer step (one-sided transports, handshakes answered by
  the side-channel thread): :meth:`PDScheduler.has_pending` keeps an idle
  producer stepping only to deliver marks and releases, and, with
  ``nixl_error_handling: peer`` (tcp), while anything is held.
* **Consumer** (kv_role ``kv_consumer``, or ``kv_both`` with ``pd``): the
  hand-offs its requests bring are checked and offered to the manager as the
  read-only ``peer`` tier (tiercache.connector.pd.consumer).
* **The prompt's tail** (its partial last chunk, connector/prompt_tail.py) goes
  with the chunks in both modes, last, under a tail key: the producer stores it
  (via_host, :meth:`PDScheduler.tail_to_store`) or holds its blocks (direct);
  the consumer loads it when its own tokens give the same key
  (:meth:`PDScheduler.tail_key`), so its engine computes only the prompt's last
  token. A via_host tail is dropped from the host tier when its hold ends.
* **State-layer models** hand off up to a chunk's end state, no tail
  (connector/pd/state_handoff.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tiercache.connector.block_pins import BlockPins, VllmBlockPins
from tiercache.connector.kv_groups import null_block_id
from tiercache.connector.pd.consumer import PeerOffers
from tiercache.connector.pd.direct_blocks import NO_BLOCK, key_blocks
from tiercache.connector.pd.holds import Hold, Pinned, take_reported
from tiercache.connector.pd.roles import CONSUMER_ROLES, PRODUCER_ROLES, GroupBlockIds, SchedulerPD
from tiercache.connector.pd.state_handoff import (OfferedStates, direct_state_hold, handed_off_prompt,
                                                  via_host_state_keys)
from tiercache.connector.pd.step import DirectHold, PDStepMeta, PDWorkerReport
from tiercache.connector.prompt_tail import PromptTail, prompt_tail
from tiercache.connector.state_chunks import StateOffers

from tiercache.config.schema import PDConfig
from tiercache.jobs import FromReader, LoadChunk
from tiercache.keys import KeySpace
from tiercache.manager.directory import TierSpec
from tiercache.manager.offloading import OffloadingManager
from tiercache.metrics import TierCacheMetrics
from tiercache.pd.auth import new_release_key, release_token
from tiercache.pd.handoff import Handoff, fingerprint
from tiercache.pd.peer_tier import PEER_TIER

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def peer_tier_specs(settings: PDConfig | None, kv_role: str) -> list[TierSpec]:
    """A consumer's producers, seen as one read-only shared tier (what they announced); direct:
    the worker READs its chunks straight into the blocks, no host slot."""
    if settings is None or kv_role not in CONSUMER_ROLES:
        return []
    return [TierSpec(PEER_TIER, settings.max_peer_chunks, "lru", "read_only", shared=True, direct=True)]


class PDScheduler(SchedulerPD):
    """The scheduler's P/D role: the producer's holds here, the consumer's offers in :class:`PeerOffers`."""

    def __init__(self, settings: PDConfig, kv_role: str, keys: KeySpace, manager: OffloadingManager,
                 chunk_tokens: int, engine_id: str, tp_size: int, blocks_per_chunk: int = 1,
                 metrics: TierCacheMetrics | None = None, state_groups: tuple[int, ...] = ()) -> None:
        self.settings = settings
        # a state-layer model's groups: a hand-off ends at a chunk's state (connector/pd/state_handoff.py)
        self.state_groups = state_groups
        self._offered: OfferedStates | None = None  # mode direct: offered states, pinned (bind_pins)
        self.chunk_tokens = chunk_tokens
        self.blocks_per_chunk = blocks_per_chunk
        self.block_size = chunk_tokens // blocks_per_chunk
        self.is_producer = kv_role in PRODUCER_ROLES
        self.is_consumer = kv_role in CONSUMER_ROLES
        self.keys = keys
        self.manager = manager
        self.engine_id = engine_id
        self.tp_size = tp_size
        self.fingerprint = fingerprint(keys.namespace)
        self.metrics = metrics
        self._published: dict[str, int] = {}
        self._kv_cache_manager: KVCacheManager | None = None
        self._null_block = 0  # vLLM's null block id, set at bind
        self._holds: dict[str, Hold] = {}
        # mode direct: the blocks marked on the worker, per request; for the next step's
        # metadata: marks to set, marks to clear (no hand-off after all: preempted, stopped,
        # aborted) and hand-offs whose tags every worker clears (expired, or a missed notice)
        self._marked: dict[str, DirectHold] = {}
        self._new_direct: dict[str, DirectHold] = {}
        self._unmark_direct: list[str] = []
        self._released_direct: list[str] = []
        self._pinned: dict[str, Pinned] = {}
        self.pins: BlockPins | None = None  # vLLM's block pool (bind_pins), for mode direct
        # producer: each hand-off's release token is derived from it; the workers get it each step
        self._release_key = new_release_key() if self.is_producer else b""
        self.counters: dict[str, int] = {
            "handoffs_offered": 0, "handoffs_read": 0, "handoffs_expired": 0,
            "handoffs_refused": 0, "handoffs_untrusted": 0, "handoff_chunks_received": 0,
        }
        self.peers: PeerOffers | None = PeerOffers(keys, manager, self.fingerprint, tp_size, chunk_tokens,
                                                   blocks_per_chunk, self.counters, settings) \
            if self.is_consumer else None

    # ------------------------------------------------------------ hooks (roles.SchedulerPD)
    @property
    def keeps_received(self) -> bool:  # type: ignore[override]
        return self.settings.keep_received

    def keeps(self, chunks: Sequence[LoadChunk]) -> bool:
        """keep_received, and every hand-off chunk of the load is verified (or pd.store_unverified)."""
        if not self.settings.keep_received:
            return False
        return self.peers is None or self.settings.store_unverified or self.peers.all_verified(chunks)

    def bind(self, kv_cache_manager: KVCacheManager) -> None:
        self._kv_cache_manager = kv_cache_manager
        self._null_block = null_block_id(kv_cache_manager)  # a window group's freed blocks
        if self.marks_prefills:
            self.bind_pins(VllmBlockPins.of(kv_cache_manager))  # mode direct pins hand-off blocks

    def lookup(self, request: Request, keys: list[bytes]) -> bytes | None:
        if self.peers is None:
            return None
        self.peers.learn(request, keys)
        return self.peers.tail_key(request, len(keys))

    def load_tail(self, request: Request, chunks: int) -> bytes | None:
        return self.peers.tail_key(request, chunks) if self.peers is not None else None

    def reader_source(self, key: bytes, source: FromReader) -> FromReader:
        return self.peers.reader_source(key, source) if self.peers is not None else source

    def store_tail(self, request: Request) -> PromptTail | None:
        return self.tail_to_store(request)

    def scheduled(self, request: Request, num_new: int) -> None:
        if self.marks_prefills and request.num_computed_tokens + num_new >= request.num_prompt_tokens:
            assert self._kv_cache_manager is not None, "bind_kv_cache_manager was not called"
            self.mark_prefill(request, self._kv_cache_manager.get_block_ids(request.request_id))

    def states_offered(self, offers: StateOffers, request_of: Callable[[str], Request | None]) -> None:
        if self._offered is not None:
            self._offered.offered(offers, lambda rid: handed_off_prompt(request_of(rid)))

    def step_meta(self) -> PDStepMeta:
        self.expire()
        self._publish()
        holds, unmarks, released = self.take_direct()
        return PDStepMeta(self.held_chunks > 0, holds, unmarks, released, self._release_key)

    def report(self, report: PDWorkerReport) -> None:
        if report.handoffs_read:
            self.handoffs_read(report.handoffs_read)
            self._publish()  # the engine may go idle now: no later step would
        if report.blocks_released:
            self.blocks_released(report.blocks_released)  # mode direct: unpinned, vLLM's again
        if self.metrics is not None:
            for path, num_bytes, secs in report.transfers:
                self.metrics.observe_transfer(path, num_bytes, secs)  # consumer: the NIXL READs alone

    def load_finished(self, keys: tuple[bytes, ...], failed: set[bytes]) -> None:
        if self.peers is not None:
            self.peers.load_finished(keys, failed)

    def finished(self, request: Request, tables: GroupBlockIds | None) -> tuple[bool, dict[str, Any] | None]:
        if self.peers is not None:
            self.peers.forget(request.request_id)
        return self.request_finished(request, tables)

    def _publish(self) -> None:
        """The P/D counters and held chunks, to the metrics."""
        if self.metrics is None:
            return
        for name, value in self.counters.items():
            if name.startswith("handoffs_"):
                metric = self.metrics.label(self.metrics.pd_handoffs, name.removeprefix("handoffs_"))
                metric.inc(value - self._published.get(name, 0))  # type: ignore[union-attr]
                self._published[name] = value
        self.metrics.label(self.metrics.pd_held_chunks).set(self.held_chunks)  # type: ignore[union-attr]

    # ------------------------------------------------------------ producer
    def bind_pins(self, pins: BlockPins) -> None:
        self.pins = pins
        if self.state_groups:
            self._offered = OfferedStates(pins, self.chunk_tokens)

    @property
    def pinned_blocks(self) -> int:
        """Mode direct: blocks pinned for hand-offs (read or not) whose tags are not all cleared yet."""
        return sum(len(p.blocks) for p in self._pinned.values())

    @property
    def held_chunks(self) -> int:
        return sum(len(h.keys) for h in self._holds.values())

    @property
    def marks_prefills(self) -> bool:
        """A producer in mode direct: prompts completed in a step get their blocks marked."""
        return self.is_producer and self.settings.mode == "direct"

    def has_pending(self) -> bool:
        """The engine must run another step: marks or releases to deliver, or tcp reads to progress."""
        if self._new_direct or self._unmark_direct or self._released_direct:
            return True
        return self.settings.nixl_error_handling == "peer" and bool(self._holds)

    def _direct_hold(self, request: Request, tables: GroupBlockIds) -> DirectHold | None:
        """The prompt's full chunks and tail, and their blocks (None: not a mode-direct hand-off);
        ``tables``: the request's blocks per group, each key names every group's (direct_blocks.py)."""
        params = request.kv_transfer_params or {}
        if not (self.marks_prefills and params.get("do_remote_decode")):
            return None
        keys = self.keys.chunk_keys(request.block_hashes)
        if self.state_groups:  # up to the offered state it resumes from, no tail
            state = self._offered.get(request.request_id) if self._offered is not None else None
            return direct_state_hold(keys, tables, state, self.blocks_per_chunk, self.state_groups,
                                     self._null_block, self.keys.state_key)
        whole = request.num_prompt_tokens // self.chunk_tokens
        tail = self._tail(request) if len(keys) >= whole else None
        blocks, with_tail = key_blocks(tables, min(whole, len(keys)), self.blocks_per_chunk,
                                       tail.blocks(self.block_size) if tail else 0, self._null_block)
        held_keys = keys[:len(blocks) - with_tail] + ([tail.key] if tail is not None and with_tail else [])
        if not held_keys:
            return None
        return DirectHold(tuple(held_keys), tuple(blocks), tail.tokens if tail is not None and with_tail else 0)

    def _tail(self, request: Request) -> PromptTail | None:
        """The prompt's tail (none for a state-layer model: vLLM keeps no state after its last token)."""
        return None if self.state_groups else prompt_tail(request, self.keys, self.chunk_tokens, self.block_size)

    def tail_to_store(self, request: Request) -> PromptTail | None:
        """Producer, mode via_host: the tail to store with the prompt's chunks (None: no hand-off, or no tail)."""
        params = request.kv_transfer_params or {}
        if not (self.is_producer and self.settings.mode == "via_host" and params.get("do_remote_decode")):
            return None
        return self._tail(request)

    def mark_prefill(self, request: Request, tables: GroupBlockIds) -> None:
        """Mode direct: this step's forward pass completes the prompt; the worker marks its blocks after it."""
        if request.request_id in self._marked:
            return
        hold = self._direct_hold(request, tables)
        if hold is not None:
            self._marked[request.request_id] = hold
            self._new_direct[request.request_id] = hold

    def preempted(self, request_id: str) -> None:
        """Its blocks go back to vLLM: clear their marks before anything overwrites them."""
        if self._offered is not None:
            self._offered.drop(request_id)  # recomputed: vLLM offers its states again
        if self._marked.pop(request_id, None) is not None:
            self._new_direct.pop(request_id, None)
            self._unmark_direct.append(request_id)

    def request_finished(self, request: Request, tables: GroupBlockIds | None = None
                         ) -> tuple[bool, dict[str, Any] | None]:
        """(delay freeing the blocks?, hand-off params) for a finished request; ``tables``: its blocks per group."""
        params = request.kv_transfer_params or {}
        if not self.is_producer or not params.get("do_remote_decode"):
            return False, None
        deadline = time.monotonic() + self.settings.handoff_timeout_s
        tail_tokens = 0
        if self.settings.mode == "direct":
            rid = request.request_id
            marked = self._marked.pop(rid, None)
            hold = self._direct_hold(request, tables or ()) if _length_capped(request) else None
            if hold is None:
                held, where = [], []
                if marked is not None:  # stopped or aborted: no decode to hand off to
                    self._new_direct.pop(rid, None)
                    self._unmark_direct.append(rid)
            else:
                if self.pins is None:
                    raise RuntimeError("tiercache P/D: mode direct needs vLLM's block pool "
                                       "(bind_kv_cache_manager was not called)")
                held, where = list(hold.keys), [b for blocks in hold.blocks for b in blocks]
                tail_tokens = hold.tail_tokens
                if hold != marked:  # not marked at its prefill step (or other blocks since): mark now
                    self._new_direct[rid] = hold
                self._holds[rid] = Hold(held, deadline, direct=True)
                # our own reference: vLLM frees the request now and the blocks stay allocated
                pinned = [b for b in where if b != NO_BLOCK]
                self.pins.pin(pinned)
                self._pinned[rid] = Pinned(pinned, deadline)
            if self._offered is not None:
                self._offered.drop(rid)  # the hold's pins keep the state block now
        else:
            prompt_chunks = request.num_prompt_tokens // self.chunk_tokens
            keys = self.keys.chunk_keys(request.block_hashes)[:prompt_chunks]
            tail = self._tail(request) if len(keys) == prompt_chunks else None
            if self.state_groups:  # up to a chunk whose state is stored (connector/pd/state_handoff.py)
                keys = via_host_state_keys(keys, request.num_prompt_tokens, self.chunk_tokens,
                                           self.manager.host, self.keys.state_key)
            held = self.manager.holds.hold_host_prefix(keys + ([tail.key] if tail else []))  # a prefix of them
            where = self.manager.host.slots_of(held)
            if tail is not None and len(held) == len(keys) + 1:
                tail_tokens = tail.tokens
            elif tail is not None:
                self.manager.discard([tail.key])  # stored, but a chunk before it is missing: useless
            if held:
                self._holds[request.request_id] = Hold(held, deadline, tail=tail.key if tail_tokens else None)
        self.counters["handoffs_offered"] += 1
        return False, Handoff(
            engine_id=self.engine_id, host=self.settings.host, port=self.settings.port,
            request_id=request.request_id, keys=tuple(held), slots=tuple(where), fingerprint=self.fingerprint,
            tp_size=self.tp_size, mode=self.settings.mode, tail_tokens=tail_tokens,
            release_token=release_token(self._release_key, request.request_id),
            ends_with_state=bool(self.state_groups and held),
        ).to_params()

    def take_direct(self) -> tuple[dict[str, DirectHold], list[str], list[str]]:
        """For the step's metadata: marks to set, marks to clear, expired hand-offs to release."""
        new, self._new_direct = self._new_direct, {}
        unmark, self._unmark_direct = self._unmark_direct, []
        released, self._released_direct = self._released_direct, []
        return new, unmark, released

    def _end_hold(self, rid: str, hold: Hold, outcome: str) -> None:
        if hold.direct:
            if outcome == "expired":
                self._force_release(rid)
            # read: the workers that heard the notice cleared the tags already and report it
        else:
            self.manager.holds.release(hold.keys)
            if hold.tail is not None:
                self.manager.discard([hold.tail])  # only a hand-off looks a tail up: free its slot now
        self.counters[f"handoffs_{outcome}"] += 1

    def _force_release(self, rid: str) -> None:
        """Every worker clears the hand-off's tags at the next step and reports it (then: unpin)."""
        pinned = self._pinned.get(rid)
        if pinned is not None and not pinned.forced:
            pinned.forced = True
            self._released_direct.append(rid)

    def blocks_released(self, ranks: Mapping[str, set[int]]) -> None:
        """Workers (TP ranks) cleared these hand-offs' tags: unpin the blocks once all have."""
        for _, pinned in take_reported(self._pinned, ranks, self.tp_size):
            assert self.pins is not None
            self.pins.unpin(pinned.blocks)

    def handoffs_read(self, ranks: Mapping[str, set[int]]) -> None:
        """Workers (TP ranks) saw their consumers' read notifications: a hold ends once every rank has.

        With TP > 1 each consumer rank READs its own shard from the producer rank of the
        same number and notifies that rank; ending the hold on the first notice would
        let a via_host slot be reused while another rank still reads it (the tags would
        catch it, and that rank's request would be recomputed).
        """
        for rid, hold in take_reported(self._holds, ranks, self.tp_size):
            self._end_hold(rid, hold, "read")

    def expire(self, now: float | None = None) -> None:
        """Release holds nobody read in time (called every step)."""
        now = time.monotonic() if now is None else now
        for rid in [r for r, h in self._holds.items() if h.deadline <= now]:
            hold = self._holds.pop(rid)
            self._end_hold(rid, hold, "expired")
            logger.info("tiercache P/D: hand-off of %s (%d chunks) expired unread", rid, len(hold.keys))
        for rid in [r for r, p in self._pinned.items() if p.deadline <= now and not p.forced]:
            # read, but some worker never heard (another TP rank's consumer failed): clear it anyway
            self._force_release(rid)

def _length_capped(request: Request) -> bool:
    """The prefill ended on max_tokens (a P/D proxy's max_tokens=1), not on a stop or an abort.

    Mode direct keeps the device blocks only then, as vLLM's NixlConnector does:
    a request that stopped or was aborted has no decode to hand off to.
    """
    from vllm.v1.request import RequestStatus

    return getattr(request, "status", None) == RequestStatus.FINISHED_LENGTH_CAPPED
