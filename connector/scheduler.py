"""Scheduler half of the connector: requests -> chunk keys -> manager calls -> metadata.

Runs in vLLM's scheduler process, on its one thread. Per request it keeps how
far its chunks have been offered for storing; per step it collects the load
jobs planned in ``update_state_after_alloc`` and plans the stores for chunks
that the step's forward pass completes (prompt and, by default, generated
tokens). Worker reports come back through ``update_connector_output``
(scheduler_reports.py) and close the jobs in the manager (unpin loaded chunks,
mark stored chunks ready or drop failed ones) and release a store's engine
blocks (store_pins.py).

A load is planned into one :class:`~tiercache.jobs.LoadJob` whose chunks each
name their source (host slot, lower tier staged through a host slot, or a P/D
producer's memory) and their blocks; the workers run that same object.
Prefill/decode steps come through ``self.pd`` (tiercache.connector.pd.roles; a null object without P/D).

Nothing here blocks or raises into vLLM for a storage problem: a store that
cannot be planned is skipped (a future miss), a failed load is recomputed.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from tiercache.connector.engine_info import ChunkGeometry
from tiercache.connector.kv_groups import load_segments, null_block_id, state_group_indices
from tiercache.connector.lookup_hold import hold_for_busy_chunk, hold_for_staging_room
from tiercache.connector.lower_tiers import ask_shared_tiers, lower_tier_specs, make_backends, recover_lower_tiers
from tiercache.connector.metadata import TierCacheConnectorMetadata
from tiercache.connector.partial_chunks import partial_keys_from
from tiercache.connector.pd.roles import GroupBlockIds, SchedulerPD, pd_settings
from tiercache.connector.pd.scheduler_role import PDScheduler, peer_tier_specs
from tiercache.connector.scheduler_faults import SchedulerFaults
from tiercache.connector.scheduler_reports import SchedulerReports
from tiercache.connector.scheduler_stores import SchedulerStores
from tiercache.connector.scheduler_state import JobRecord, RequestState
from tiercache.connector.state_chunks import state_hit_chunks, state_keys_to_ask
from tiercache.connector.store_pins import StorePins

from tiercache import faults
from tiercache.config.schema import TierCacheConfig
from tiercache.events import ChunkEvent
from tiercache.jobs import DemoteJob, FromReader, LoadChunk, LoadJob, StoreJob
from tiercache.manager.offloading import OffloadingManager, TierSpec
from tiercache.metrics import TierCacheMetrics
from tiercache.tiers.shared_lookup import SharedLookup

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class TierCacheScheduler(SchedulerStores, SchedulerReports, SchedulerFaults):
    def __init__(
        self,
        config: TierCacheConfig,
        geometry: ChunkGeometry,
        metrics: TierCacheMetrics | None = None,
        kv_role: str = "kv_both",
        engine_id: str = "0",
    ) -> None:
        self.config = config
        self.geometry = geometry
        self.block_size = geometry.engine.block_size
        self.chunk_tokens = geometry.chunk_tokens
        self.bpc = geometry.blocks_per_chunk
        self.keys = geometry.keyspace(config)
        host = config.host_tier
        pd = pd_settings(kv_role, config.pd)
        specs = [TierSpec(host.name, geometry.host_slots, host.policy), *lower_tier_specs(config, geometry),
                 *peer_tier_specs(pd, kv_role)]
        self.manager = OffloadingManager(specs)
        self.metrics = metrics or TierCacheMetrics()
        # P/D's role (tiercache.connector.pd.roles): a null object when P/D is off
        self.pd: SchedulerPD = SchedulerPD() if pd is None else PDScheduler(
            pd, kv_role, self.keys, self.manager, geometry.chunk_tokens, engine_id, geometry.engine.tp_size,
            geometry.blocks_per_chunk, self.metrics, state_group_indices(geometry.engine.kv_groups))
        self._step_deletes: dict[str, list[bytes]] = {}
        for tier_name, extra in recover_lower_tiers(config, geometry, self.keys.digest, self.manager).items():
            self._step_deletes.setdefault(tier_name, []).extend(extra)
        # a chunk counts as held by a shared tier when every head's store shard is there
        shared = make_backends(config, geometry, self.keys.digest, rank=0, shared_only=True,
                               shards=geometry.engine.group_shard_set())
        self._shared: SharedLookup | None = \
            SharedLookup(shared, timeout_s=config.deadlines.lookup_s,
                         first_wait_s=config.deadlines.lookup_wait_s) if shared else None
        self.metrics.label(self.metrics.capacity_bytes, host.name).set(geometry.host_slots * geometry.slot_bytes)
        self._world_size = geometry.engine.world_size
        # a hybrid model's failed loads go to vLLM per request (failed_recving), which vLLM 0.32
        # takes for async loads only (connector/kv_groups.py): hybrid models load async
        self._by_request = len(geometry.engine.kv_groups) > 1
        self._groups = geometry.engine.kv_groups
        # state-layer groups (connector/state_chunks.py): a hit ends at a chunk stored with its state
        self._state_groups = state_group_indices(self._groups)
        self._store_incomplete = config.faults.store_incomplete_chunks  # negative control only
        self._partials = config.partial_chunks and pd is None and not self._state_groups  # partial_chunks.py
        self._async_loads = config.load_mode == "async" or self._by_request
        self._step_failed_loads: list[str] = []
        self._reqs: dict[str, RequestState] = {}
        self._jobs: dict[int, JobRecord] = {}
        self._next_job_id = 0
        self._step_loads: list[LoadJob] = []
        self._step_invalid: list[int] = []
        self._step_failed_recvs: list[str] = []  # see SchedulerFaults
        self._kv_cache_manager: KVCacheManager | None = None
        self._null_block = 0  # vLLM's null block id (a window group's freed positions), set at bind
        self.store_pins = StorePins()  # a store's engine blocks, until every worker copied them
        self._counters: dict[str, float] = {}
        self._refused_reported: dict[str, int] = {}  # see SchedulerReports._sync_tier_metrics

    # ------------------------------------------------------------ plumbing
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        self._kv_cache_manager = kv_cache_manager
        self._null_block = null_block_id(kv_cache_manager)
        self.pd.bind(kv_cache_manager)
        self.store_pins.bind_manager(kv_cache_manager)

    def _state(self, request: Request) -> RequestState:
        st = self._reqs.get(request.request_id)
        if st is None or st.request is not request:
            st = RequestState(request)
            self._reqs[request.request_id] = st
        return st

    def _new_job_id(self, direction: str, owner: str, keys: tuple[bytes, ...]) -> int:
        """An id for a job of any kind (unique in this engine), and its record until every worker reported."""
        job_id = self._next_job_id
        self._next_job_id += 1
        self._jobs[job_id] = JobRecord(direction, owner, keys, self._world_size)
        return job_id

    def _count(self, name: str, value: float) -> None:
        self._counters[name] = self._counters.get(name, 0) + value

    def _wait_a_step(self, reason: str, counter: str) -> tuple[None, bool]:
        """The lookup's answer "ask again next step", counted (``reason``: tiercache_lookup_waits)."""
        self._count(counter, 1)
        self.metrics.label(self.metrics.lookup_waits, reason).inc()
        return None, False

    # ------------------------------------------------------------- lookups
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._state(request).lookup_tokens = request.num_tokens - num_computed_tokens  # counted once allocated
        keys = self.keys.chunk_keys(request.block_hashes)
        if not keys and not (self._partials and request.block_hashes):
            return 0, False
        tail = self.pd.lookup(request, keys)  # a P/D hand-off's prompt tail (connector/prompt_tail.py)
        hits = self.manager.lookup(keys) or 0
        state_keys = state_keys_to_ask(keys, request.num_tokens - 1, self.chunk_tokens, self.keys.state_key) \
            if self._state_groups else []
        partial_keys = partial_keys_from(request.block_hashes, self.keys, hits) \
            if self._partials and self._shared is not None else []  # (only a shared tier is asked them)
        if self._shared is not None and (hits < len(keys) or state_keys or partial_keys):
            asked = ask_shared_tiers(self._shared, self._state(request), request.request_id, keys, hits,
                                     self.manager, [*state_keys, *partial_keys])
            if asked is None:  # a shared tier still thinking: vLLM asks again on a later step
                return self._wait_a_step("shared_tier_pending", "lookups_deferred")  # (at most lookup_wait_s)
            hits = asked
        if hold_for_busy_chunk(self.manager, self._state(request), keys, hits,
                               num_computed_tokens // self.chunk_tokens, self.config.deadlines.lookup_s):
            return self._wait_a_step("chunk_being_written", "lookups_held")  # into the host tier, after the hit
        if self._state_groups:  # a hit ends where a chunk's end state is stored
            hits = state_hit_chunks(keys, hits, request.num_tokens - 1, self.chunk_tokens, self.keys.state_key,
                                    lambda key: bool(self.manager.lookup([key])))
        local_chunks = min(hits, num_computed_tokens // self.chunk_tokens)
        if local_chunks:
            # The engine's own cache serves these: keep our copies warm too, so they
            # outlive the engine's copy (it evicts under pressure first).
            self.manager.touch(keys[:local_chunks])
        covered = hits * self.chunk_tokens
        if tail is not None and hits == len(keys) and self.manager.lookup([tail]):
            covered = request.num_prompt_tokens  # a P/D hand-off's prompt tail (connector/prompt_tail.py)
        partial = self._partial_hit(request, hits) if self._partials else None
        if partial is not None:  # the blocks after the hit's last full chunk, from a request that ended there
            covered = partial.end_token(self.block_size)
        if hold_for_staging_room(self.manager, self._state(request), keys[local_chunks:hits],
                                 partial if covered > num_computed_tokens else None, self.config.deadlines.lookup_s):
            return self._wait_a_step("no_staging_room", "lookups_held_for_staging")  # this step's loads and stores
        # vLLM must compute at least the last prompt token itself. When every chunk of the
        # prompt hits (its length is a multiple of the chunk, or a hand-off brought its tail),
        # the last chunk loads whole and vLLM computes that one token, as after NixlConnector's
        # hand-off; its KV slot is written again by the forward pass. Otherwise the partial tail
        # is computed.
        hit_tokens = min(covered, request.num_tokens - 1)
        if hit_tokens <= num_computed_tokens:
            return 0, False
        st = self._state(request)
        st.lookup_local_tokens = num_computed_tokens
        st.lookup_hit_tokens = hit_tokens
        st.partial = partial
        return hit_tokens - num_computed_tokens, self._async_loads

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        st = self._state(request)
        self.metrics.label(self.metrics.lookup_tokens).inc(st.lookup_tokens)  # the hit rate's denominator
        st.lookup_tokens = 0
        if num_external_tokens <= 0:
            return
        if st.lookup_local_tokens is None:
            raise RuntimeError(
                f"tiercache: load of {num_external_tokens} tokens for {request.request_id} "
                "without a preceding lookup"
            )
        start = st.lookup_local_tokens
        end = start + num_external_tokens
        st.lookup_local_tokens = None
        ct, bs, bpc = self.chunk_tokens, self.block_size, self.bpc
        tables = blocks.get_block_ids()  # one block table per KV-cache group
        first_chunk, last_chunk = start // ct, (end - 1) // ct
        chunk_keys = self.keys.chunk_keys(request.block_hashes)
        keys = tuple(chunk_keys[first_chunk : last_chunk + 1])
        with_state = bool(self._state_groups)  # the last chunk loads with its end state
        if with_state:
            keys = keys[:-1] + (self.keys.state_key(keys[-1]),)
        partial, st.partial, tail_end = st.partial, None, 0  # tail_end: after a partial last chunk's tokens
        if partial is not None and partial.chunk == last_chunk:  # in place of the chunk's key
            keys, tail_end = keys[: last_chunk - first_chunk] + (partial.key,), partial.end_token(bs)
            st.partial_stored = partial  # superseded by the request's own next one (_add_partial)
        elif last_chunk == len(chunk_keys):
            tail = self.pd.load_tail(request, len(chunk_keys))
            if tail is None:
                raise RuntimeError(f"tiercache: load of {request.request_id} up to token {end} without its prompt tail")
            keys, tail_end = keys + (tail,), request.num_prompt_tokens
        plan = self.manager.prepare_load(keys)
        chunks: list[LoadChunk] = []
        tokens_by_tier: dict[str, int] = {}
        for i, chunk in enumerate(range(first_chunk, last_chunk + 1)):
            lo = max(start, chunk * ct) // bs
            hi = -(-min(end, (chunk + 1) * ct) // bs)  # a partial last block loads whole
            runs, kept_all = load_segments(tables, self._groups, chunk, lo, hi, bpc, bs, self._null_block,
                                           with_state=with_state and chunk == last_chunk,
                                           end_token=tail_end if chunk == last_chunk and tail_end else None)
            if not (kept_all or self._store_incomplete):
                # vLLM allocated a window block before what a store keeps: recomputed, never stale
                faults.record(faults.WINDOW_BLOCK_NOT_STORED, f"chunk {chunk} of {request.request_id}", where="load")
                self._step_failed_loads.append(request.request_id)
            if i >= len(plan.keys):
                # No host slot could be freed to stage this chunk: a failed load, recomputed.
                if i == len(plan.keys):  # once per load
                    faults.record(faults.STAGING_NO_SLOT, f"{len(keys) - i} of {len(keys)} chunks of "
                                  f"{request.request_id}: recomputed", where="load")
                if self._by_request:
                    self._step_failed_loads.append(request.request_id)
                else:
                    self._step_invalid.extend(b for run in runs for b in run.block_ids)
                continue
            key, source = plan.keys[i], plan.sources[i]
            if isinstance(source, FromReader):  # a direct tier: its reader writes the blocks
                source = self.pd.reader_source(key, source)
            # every group's allocated blocks (a window group's null blocks skipped: connector/kv_groups.py)
            # (none at all: a lone window group whose blocks for this chunk all left the window)
            first, ids = (runs[0].first_block, runs[0].block_ids) if runs else (0, ())
            chunks.append(LoadChunk(key, source, first, ids, tuple((r.first_block, r.block_ids) for r in runs[1:])))
            tier = source.tier
            tokens_by_tier[tier] = tokens_by_tier.get(tier, 0) + min(end, (chunk + 1) * ct) - max(start, chunk * ct)
        job = LoadJob(self._new_job_id("load", request.request_id, plan.keys), request.request_id, tuple(chunks))
        self._step_loads.append(job)
        if not self.pd.keeps(chunks) and any(isinstance(c.source, FromReader) for c in chunks):
            # A pure decode engine: the hand-off's chunks are not copied out again into the host tier.
            st.next_store_chunk = max(st.next_store_chunk, min(first_chunk + len(plan.keys), len(chunk_keys)))
        for tier, tokens in tokens_by_tier.items():
            self.metrics.label(self.metrics.hit_tokens, tier).inc(tokens)
            self._count(f"hit_tokens_{tier}", tokens)
        self._count("hit_tokens", num_external_tokens)
        self._count("load_jobs", 1)

    # ---------------------------------------------------------- per step
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> TierCacheConnectorMetadata:
        self.store_pins.withdraw_unsent(self._jobs, self._finish_job)  # from a step that raised
        stores: list[StoreJob] = []
        offers = self._state_offers(scheduler_output) if self._state_groups else {}
        if offers:  # before scheduled(): a P/D producer's hand-off may end at one (connector/pd/state_handoff.py)
            self.pd.states_offered(offers, lambda rid: st.request if (st := self._reqs.get(rid)) else None)
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(req_id)
            if st is not None and num_new > 0:
                job = self._plan_store(req_id, st, num_new)
                if job is not None:
                    stores.append(job)
                self.pd.scheduled(st.request, num_new)
        if offers:
            stores.extend(self._plan_state_stores(offers))
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            st = self._reqs.get(req_id)
            if st is not None:
                st.next_store_chunk = 0  # re-offer on resume; present chunks are skipped
                st.tail_stored = False
            self.pd.preempted(req_id)
        for req_id in scheduler_output.finished_req_ids:
            self._reqs.pop(req_id, None)
        demotes = [
            DemoteJob(self._new_job_id("demote", p.tier, p.keys), p.tier, p.keys, p.host_slots)
            for p in self.manager.cascade.prepare_demotions()
        ]
        for tier_name, keys in self.manager.deletes.take().items():
            self._step_deletes.setdefault(tier_name, []).extend(keys)
        meta = TierCacheConnectorMetadata(
            loads=self._step_loads,
            stores=stores,
            loads_are_sync=not self._async_loads,
            invalid_block_ids=self._step_invalid,
            demotes=demotes,
            deletes=self._step_deletes,
            pd=self.pd.step_meta(),
            failed_recvs=self._step_failed_recvs,
            failed_loads=self._step_failed_loads,
        )
        self._step_failed_loads = []
        self._step_failed_recvs = []
        self.metrics.count_faults(faults.take())  # this process's faults (the workers' come in their reports)
        self._step_loads, self._step_invalid, self._step_deletes = [], [], {}
        self._sync_tier_metrics()
        self.store_pins.sent()
        return meta

    # ------------------------------------------------------------ the rest
    def request_finished(self, request: Request, tables: GroupBlockIds | None = None) -> tuple[bool, dict[str, Any] | None]:
        """``tables``: the request's block ids per KV-cache group (vLLM's ``request_finished_all_groups``)."""
        # Stores planned for the request pin their blocks until every worker copied them
        # (connector/store_pins.py), as a P/D hand-off in mode direct does (connector/pd/
        # scheduler_role.py): vLLM may free the request's blocks at once, nothing to delay.
        st = self._reqs.pop(request.request_id, None)
        if st is not None and st.partial_stored is not None:  # the partial chunk it ends with goes down
            self.manager.cascade.release_held_back([st.partial_stored.key])
        if self._shared is not None:
            self._shared.forget(request.request_id)
        return self.pd.finished(request, tables)

    def has_pending_work(self) -> bool:
        """Step on for store pins, copies down to plan or hear of (else their host copies stay pinned, unsent), P/D."""
        demoting = any(r.direction == "demote" for r in self._jobs.values())
        return bool(self.store_pins) or demoting or self.manager.cascade.copies_queued() or self.pd.has_pending()

    def take_events(self) -> list[ChunkEvent]:
        return self.manager.events.take()

    def take_counters(self) -> dict[str, float]:
        counters, self._counters = self._counters, {}
        return counters

    def reset(self) -> bool:
        dropped = self.manager.reset()
        logger.info("tiercache: reset dropped %d chunks", dropped)
        return True

    def shutdown(self) -> None:
        self.store_pins.release_all()
        if self._shared is not None:
            self._shared.close()
        self.manager.shutdown()
