"""The scheduler's store planning: which chunks of a request a step stores, with which blocks.

A mixin of :class:`tiercache.connector.scheduler.TierCacheScheduler`, called from
its ``build_connector_meta``:

* :meth:`_plan_store`: the chunks the step's forward pass completes (prompt and,
  by default, generated tokens) under their chunk keys, each only with every
  block a later hit may load (connector/kv_groups.py ``storable``), and a P/D
  producer's prompt tail;
  a request's partial chunk (connector/partial_chunks.py: the blocks its
  computed tokens fill past its last full chunk, once its prompt is computed;
  :meth:`_partial_hit` is the lookup's side of it);
* :meth:`_plan_state_stores`: a state-layer model's chunks whose end state vLLM
  offered this step, under their state keys (connector/state_chunks.py).

Both reserve host-tier slots through the manager and pin the blocks they read
until every worker copied them (connector/store_pins.py). A store that cannot
be planned is skipped: a future miss, never an error.

Threading: the scheduler thread, like the rest of the scheduler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tiercache.connector.kv_groups import KVGroup, chunk_segments, storable
from tiercache.connector.partial_chunks import PartialChunk, partial_candidates, partial_to_store
from tiercache.connector.scheduler_state import RequestState
from tiercache.connector.state_chunks import StateOffers, state_offers, with_state_blocks
from tiercache.connector.store_pins import StorePins

from tiercache.config.schema import TierCacheConfig
from tiercache.jobs import StoreJob
from tiercache.keys import KeySpace
from tiercache.manager.offloading import OffloadingManager
from tiercache.metrics import TierCacheMetrics

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

# a store's chunks: key -> (chunk index, end block, the request's block tables, first block kept per group)
StoreChunks = dict[bytes, tuple[int, int, Any, tuple[int, ...]]]


class SchedulerStores:
    """Store planning; mixed into TierCacheScheduler (whose __init__ sets these fields)."""

    config: TierCacheConfig
    keys: KeySpace
    manager: OffloadingManager
    metrics: TierCacheMetrics
    store_pins: StorePins
    block_size: int
    chunk_tokens: int
    bpc: int
    pd: Any
    _groups: tuple[KVGroup, ...]
    _state_groups: tuple[int, ...]
    _store_incomplete: bool
    _null_block: int
    _reqs: dict[str, RequestState]
    _partials: bool
    _kv_cache_manager: KVCacheManager | None

    def _new_job_id(self, direction: str, owner: str, keys: tuple[bytes, ...]) -> int:
        raise NotImplementedError

    def _count(self, name: str, value: float) -> None:
        raise NotImplementedError

    def _plan_store(self, req_id: str, st: RequestState, num_new: int) -> StoreJob | None:
        request = st.request
        computed_after = request.num_computed_tokens + num_new
        full_chunks = min(computed_after, self._store_limit(request)) // self.chunk_tokens
        first = st.next_store_chunk
        keys = self.keys.chunk_keys(request.block_hashes, start_chunk=first)[: max(full_chunks - first, 0)]
        st.next_store_chunk = max(full_chunks, first)
        tail = None
        if not st.tail_stored and computed_after >= request.num_prompt_tokens:
            # P/D producer, via_host: the prompt's partial last chunk goes with its chunks
            tail = self.pd.store_tail(request)
            st.tail_stored = True
        bpc, ct = self.bpc, self.chunk_tokens
        extent = {key: (first + i, (first + i + 1) * ct) for i, key in enumerate(keys)}  # chunk, end token
        if tail is not None:  # its blocks, the last partly filled
            extent[tail.key] = (tail.chunk, tail.chunk * ct + tail.tokens)
        if self._partials and computed_after >= request.num_prompt_tokens:  # prompt computed: every new block
            self._add_partial(st, min(computed_after, self._store_limit(request)), extent)
        if not extent:
            return None
        assert self._kv_cache_manager is not None, "bind_kv_cache_manager was not called"
        tables = self._kv_cache_manager.get_block_ids(req_id)  # one block table per KV-cache group
        # a chunk goes only with every block a later hit may load (connector/kv_groups.py)
        floors = storable(tables, self._groups, extent, bpc, self.block_size, self._null_block, self._store_incomplete)
        if len(floors) < len(extent):
            self._count("incomplete_chunks_skipped", len(extent) - len(floors))
        chunks = {key: (extent[key][0], -(-extent[key][1] // self.block_size), tables, f) for key, f in floors.items()}
        job = self._store_job(req_id, chunks)
        self._offer_refused_again(st, {key: c[0] for key, c in chunks.items() if tail is None or key != tail.key}, job)
        return job

    def _offer_refused_again(self, st: RequestState, offered: dict[bytes, int], job: StoreJob | None) -> None:
        """Offer again next step the chunks of ``offered`` (key -> chunk index) the host tier had no slot for
        this step (every slot being written: other stores, or loads staging chunks from a lower tier in this
        very step). The request's blocks stay allocated while it runs, so a later step stores what this one
        could not; dropped, they would be misses for the next turn of a conversation. Not for a P/D prompt
        tail (its request ends this step)."""
        taken = set(job.keys) if job is not None else set()
        refused = [key for key in offered if key not in taken and self.manager.state_of(key) is None]
        if not refused:
            return
        self._count("store_chunks_refused", len(refused))
        partial = st.partial_stored
        if partial is not None and partial.key in refused:
            st.partial_stored = None  # planned again by _add_partial next step (same blocks, same key)
            self.manager.cascade.drop_held_back([partial.key])
            refused.remove(partial.key)
        if refused:  # full chunks: from the first refused one on
            st.next_store_chunk = min(st.next_store_chunk, *(offered[key] for key in refused))

    def _add_partial(self, st: RequestState, computed: int, extent: dict[bytes, tuple[int, int]]) -> None:
        """Add the request's partial chunk (connector/partial_chunks.py) to a store's ``extent`` (key -> chunk,
        end token) when its computed tokens filled a block past their last full chunk since the last one;
        the partial chunk it supersedes (a prefix of it, or of a full chunk stored now) is dropped."""
        partial = partial_to_store(st.request.block_hashes, computed, self.keys, self.block_size)
        old = st.partial_stored
        if partial is not None and old is not None and partial.key == old.key:
            return  # no new block since
        if old is not None:
            self.manager.discard([old.key])  # superseded (dropped once READY; a load in flight keeps its slot)
        st.partial_stored = partial
        if partial is not None and not self.manager.lookup([partial.key]):
            end = partial.end_token(self.block_size)
            if self.config.faults.partial_chunk_short_block:
                end -= self.block_size  # negative control: the key's last block is never stored
            extent[partial.key] = (partial.chunk, end)
            if partial.end_token(self.block_size) > st.request.num_prompt_tokens:  # it holds generated tokens:
                self.manager.cascade.hold_back([partial.key])  # copied down only if the request ends with it
            self._count("partial_chunks_planned", 1)

    def _partial_hit(self, request: Request, chunk: int) -> PartialChunk | None:
        """The longest partial chunk of ``request`` inside chunk ``chunk`` (where its hit stops) that a tier
        holds (connector/partial_chunks.py)."""
        return next((p for p in partial_candidates(request.block_hashes, self.keys, chunk)
                     if self.manager.lookup([p.key])), None)

    def _store_job(self, req_id: str, chunks: StoreChunks) -> StoreJob | None:
        """A store job for ``chunks`` (key -> its chunk, end block, block tables and kept floors), the host
        tier's slots reserved and the blocks pinned; None when none needs or gets a slot."""
        plan = self.manager.prepare_store(list(chunks)) if chunks else None
        if plan is None:
            return None
        if plan.evicted:
            self.metrics.label(self.metrics.evictions, plan.tier).inc(len(plan.evicted))
            self._count("evicted_chunks", len(plan.evicted))
        segments = []
        for key, slot in zip(plan.keys, plan.slots):
            c, end, tables, floors = chunks[key]
            # every group's blocks a later hit may load (a window group's older ones left out)
            segments.extend(chunk_segments(slot, tables, c, c * self.bpc, end, self.bpc, self._null_block, floors))
        self._count("store_jobs", 1)
        job = StoreJob(self._new_job_id("store", req_id, plan.keys), req_id, plan.keys, tuple(segments))
        self.store_pins.hold(job.job_id, job.block_ids())  # connector/store_pins.py
        return job

    def _store_limit(self, request: Request) -> int:
        """The tokens of ``request`` a store may cover: its prompt, and its generated tokens where decode
        tokens are offloaded (not for state-layer models)."""
        limit = len(request.block_hashes) * self.block_size
        if self.config.offload_decode_tokens and not self._state_groups:
            return limit
        # A state-layer model's decode tokens are not stored: vLLM 0.32 offers no state while decoding,
        # so their chunks could only be the inside of a later hit ending at a later prompt's state, and
        # that prompt's prefill stores them itself (decode-computed KV differs in its last bits from
        # prefill-computed KV, and this model class is sensitive to it: connector/state_chunks.py).
        return min(limit, request.num_prompt_tokens)

    def _state_offers(self, scheduler_output: SchedulerOutput) -> StateOffers:
        """This step's offered states at chunk ends of the requests tiercache stores (state_chunks.py)."""
        def limit(req_id: str) -> int | None:  # only for the requests with offers, not every request
            st = self._reqs.get(req_id)
            return None if st is None else self._store_limit(st.request)

        return state_offers(scheduler_output, self.chunk_tokens, self._state_groups, limit)

    def _plan_state_stores(self, offers: StateOffers) -> list[StoreJob]:
        """Store jobs for the chunks whose end state vLLM offered this step (:meth:`_state_offers`), under
        their state keys (connector/state_chunks.py): the chunk's attention blocks and the offered state blocks."""
        jobs: list[StoreJob] = []
        assert self._kv_cache_manager is not None, "bind_kv_cache_manager was not called"
        for req_id, offered in offers.items():
            chunk_keys = self.keys.chunk_keys(self._reqs[req_id].request.block_hashes)
            tables = self._kv_cache_manager.get_block_ids(req_id)
            chunks: StoreChunks = {}
            for chunk, blocks in offered.items():
                key = self.keys.state_key(chunk_keys[chunk]) if chunk < len(chunk_keys) else None
                if key is None or self.manager.lookup([key]):
                    continue  # beyond the hashed blocks, or already stored (the same prefix offered before)
                with_state = with_state_blocks(tables, chunk, self.bpc, blocks)
                taken = storable(with_state, self._groups, {key: (chunk, (chunk + 1) * self.chunk_tokens)},
                                 self.bpc, self.block_size, self._null_block, with_state=True)
                if key in taken:
                    chunks[key] = (chunk, (chunk + 1) * self.bpc, with_state, taken[key])
            job = self._store_job(req_id, chunks)
            if job is not None:
                self._count("state_store_jobs", 1)
                jobs.append(job)
        return jobs
