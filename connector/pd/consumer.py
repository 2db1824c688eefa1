"""P/D consumer, scheduler side: the hand-offs its requests bring, checked and offered to the manager as the peer tier.

A request carrying a tiercache hand-off (``kv_transfer_params``, the shape of
tiercache.pd.handoff) teaches the manager that the ``peer`` tier (read-only,
shared, and direct: its load plans take no host slot, the worker READs straight
into the blocks, from the producer's host slots or KV blocks per its mode)
holds its chunks, after checking the producer's fingerprint against its own (a
mismatch is refused with an error naming the fields, and counted). Lookup and
prepare_load then treat the producer like any lower tier; :meth:`PeerOffers.reader_source`
puts into each load chunk which producer memory holds it. After the load the
knowledge is dropped (the producer releases the chunks); a failed load is
recomputed. The prompt's tail (connector/prompt_tail.py) is loaded when this
engine's own tokens give the producer's tail key (:meth:`PeerOffers.tail_key`);
a state-layer model's hand-off ends with a state key (connector/pd/state_handoff.py),
offered only when it is the state key of this engine's own chunk there.

Trust: a hand-off whose producer this consumer does not trust
(:class:`tiercache.pd.trust.ProducerTrust`: ``pd.trusted_producers``,
``pd.secret``, else loopback only) is refused before anything connects: the
prompt is computed here, and ``handoffs_untrusted`` counts it (a log line names
the address). Integrity: a via_host hand-off of our TP size, on an engine whose
KV blocks are in host memory, is read with page hashes checked
(``PeerChunk.verify``) when what it receives is to be stored (``keep_received``
and not ``store_unverified``: the hashing costs CPU on the read path, spent
only where it guards a store); a load whose hand-off chunks were not all
verified is not stored again (:meth:`PeerOffers.all_verified`) unless
``pd.store_unverified``.

Threading: vLLM's scheduler thread (the PDScheduler that holds it).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tiercache.connector.prompt_tail import prompt_tail

from tiercache.config.schema import PDConfig
from tiercache.jobs import FromReader, LoadChunk
from tiercache.keys import KeySpace
from tiercache.manager.offloading import OffloadingManager
from tiercache.pd.channel import key_tag
from tiercache.pd.handoff import Handoff, HandoffError, group_count
from tiercache.pd.heads import tp_mismatches
from tiercache.pd.peer_tier import PEER_TIER, PeerChunk, PeerSource
from tiercache.pd.trust import ProducerTrust

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class PeerOffers:
    """What producers offered this consumer, per key, until the load that reads it ends."""

    def __init__(self, keys: KeySpace, manager: OffloadingManager, fingerprint: dict, tp_size: int,
                 chunk_tokens: int, blocks_per_chunk: int, counters: dict[str, int],
                 settings: PDConfig | None = None, kv_in_host_memory: bool | None = None) -> None:
        settings = settings or PDConfig()
        self.trust = ProducerTrust(settings.trusted_producers, has_secret=bool(settings.secret_key()))
        # page hashes (tiercache.pd.page_hashes) are checked where they guard a store (keep_received,
        # not store_unverified) and our KV blocks are host memory (hashed in place)
        in_host = _kv_in_host_memory() if kv_in_host_memory is None else kv_in_host_memory
        self.can_verify = in_host and settings.keep_received and not settings.store_unverified
        self.keys = keys
        self.manager = manager
        self.fingerprint = fingerprint
        self.tp_size = tp_size
        self.chunk_tokens = chunk_tokens
        self.blocks_per_chunk = blocks_per_chunk
        self.block_size = chunk_tokens // blocks_per_chunk
        self.counters = counters  # the PDScheduler's (handoffs_refused, handoffs_untrusted, handoff_chunks_received)
        self._sources: dict[bytes, PeerChunk] = {}
        self._tails: dict[str, bytes] = {}  # request -> the tail key it may load (checked)
        self._asked: set[str] = set()  # requests whose hand-off was looked at

    def learn(self, request: Request, keys: list[bytes]) -> None:
        """Before the lookup: teach the manager what the request's producer holds."""
        if request.request_id in self._asked:
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
        untrusted = self.trust.why_not(handoff.host, handoff.port)
        if untrusted:
            logger.error("tiercache P/D: refusing the hand-off of request %s: %s; recomputing",
                         request.request_id, untrusted)
            self.counters["handoffs_untrusted"] += 1
            return
        # another TP size is accepted when only it differs (tiercache.pd.heads: head-split reads)
        diff = tp_mismatches(self.fingerprint, handoff.fingerprint)
        if handoff.tp_size != self.tp_size and not diff and handoff.fingerprint.get("tp_size") != handoff.tp_size:
            diff = [f"tp_size: params {handoff.tp_size}, fingerprint {handoff.fingerprint.get('tp_size')!r}"]
        if diff:
            logger.error("tiercache P/D: refusing the hand-off of request %s from %s (%s:%d): "
                         "incompatible peer: %s; recomputing", request.request_id, handoff.engine_id,
                         handoff.host, handoff.port, "; ".join(diff))
            self.counters["handoffs_refused"] += 1
            return
        full = handoff.full_keys
        if tuple(keys[:len(full)]) != full:
            logger.error("tiercache P/D: request %s: the producer's chunk keys do not match this "
                         "prompt (different tokens?); recomputing", request.request_id)
            self.counters["handoffs_refused"] += 1
            return
        state_key = handoff.state_key  # a state-layer model's: the next chunk with its end state
        if state_key is not None and (len(keys) <= len(full) or state_key != self.keys.state_key(keys[len(full)])):
            logger.error("tiercache P/D: request %s: the producer's state key does not match this prompt's "
                         "chunk %d; recomputing", request.request_id, len(full))
            self.counters["handoffs_refused"] += 1
            return
        offered = list(handoff.keys)
        if handoff.tail_key is not None:
            ours = prompt_tail(request, self.keys, self.chunk_tokens, self.block_size)
            if ours is not None and (ours.key, ours.chunk, ours.tokens) == (handoff.tail_key, len(full),
                                                                            handoff.tail_tokens):
                self._tails[request.request_id] = ours.key
            else:  # the chunks are still good; this engine computes the tail
                logger.warning("tiercache P/D: request %s: the producer's prompt tail does not match this "
                               "prompt's; its %d tokens are recomputed", request.request_id, handoff.tail_tokens)
                offered.pop()
        hetero = handoff.tp_size != self.tp_size
        src = PeerSource(handoff.host, handoff.port, handoff.request_id, handoff.tp_size if hetero else 0,
                         handoff.release_token)
        self.manager.cascade.learn(PEER_TIER, offered)
        if handoff.mode == "direct":  # no page hashes (tiercache.pd.page_hashes): tags only
            # a hybrid model's key names every group's blocks (connector/pd/direct_blocks.py); the
            # fingerprints matched, so the producer's groups are ours
            per_key = self.blocks_per_chunk * group_count(self.keys.namespace.kv_groups)
            for key, blocks in zip(offered, handoff.blocks_of(per_key)):
                self._sources[key] = PeerChunk(src, -1, blocks, key_tag(key))
        else:
            verify = self.can_verify and not hetero
            for key, slot in zip(offered, handoff.slots):
                self._sources[key] = PeerChunk(src, slot, tag=key_tag(key), verify=verify)

    def tail_key(self, request: Request, chunks: int) -> bytes | None:
        """Consumer: the checked tail key of ``request``'s hand-off, when the tail is chunk ``chunks`` (else None)."""
        key = self._tails.get(request.request_id)
        if key is None or chunks != request.num_prompt_tokens // self.chunk_tokens:
            return None
        return key

    def reader_source(self, key: bytes, source: FromReader) -> FromReader:
        """A load's peer chunk with the producer memory that holds it (where=None: unknown, the read fails)."""
        if source.tier != PEER_TIER:
            return source
        return FromReader(source.tier, self._sources.get(key))

    def all_verified(self, chunks: Sequence[LoadChunk]) -> bool:
        """Every hand-off chunk of a load is read with its page hashes checked (storing it is safe)."""
        return all(c.source.where.verify for c in chunks
                   if isinstance(c.source, FromReader) and isinstance(c.source.where, PeerChunk))

    def load_finished(self, keys: tuple[bytes, ...], failed: set[bytes]) -> None:
        """A load ended: forget what the producer held (it releases the chunks now)."""
        peer_keys = [k for k in keys if self._sources.pop(k, None) is not None]
        if peer_keys:
            self.manager.cascade.forget(PEER_TIER, peer_keys)
            self.counters["handoff_chunks_received"] += sum(1 for k in peer_keys if k not in failed)

    def forget(self, request_id: str) -> None:
        self._asked.discard(request_id)
        self._tails.pop(request_id, None)


def _kv_in_host_memory() -> bool:
    """This engine's KV cache is host memory (vLLM's CPU platform): received blocks can be hashed in place."""
    from vllm.platforms import current_platform

    return current_platform.device_type == "cpu"
