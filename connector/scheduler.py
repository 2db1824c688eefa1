"""Scheduler half of the connector: requests -> chunk keys -> manager calls -> metadata.

Runs in vLLM's scheduler process, on its one thread. Per request it keeps how
far its chunks have been offered for storing; per step it collects the load
jobs planned in ``update_state_after_alloc`` and plans the stores for chunks
that the step's forward pass completes (prompt and, by default, generated
tokens). Worker reports come back through ``update_connector_output`` and
close the jobs in the manager (unpin loaded chunks, mark stored chunks ready
or drop failed ones).

Nothing here blocks or raises into vLLM for a storage problem: a store that
cannot be planned is skipped (a future miss), a failed load is recomputed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tiercache import faults
from tiercache.config.schema import TierCacheConfig
from tiercache.transfer.device import CopySegment
from tiercache.events import ChunkEvent
from tiercache.manager.offloading import OffloadingManager, TierSpec
from tiercache.metrics import TierCacheMetrics
from tiercache.transfer.pipeline import DemoteJobSpec
from tiercache.tiers.shared_lookup import SharedLookup
from tiercache.transfer.engine import TransferJobSpec

from tiercache.connector.lower_tiers import lower_tier_specs, make_backends, recover_lower_tiers

from tiercache.pd.peer_tier import PEER_TIER, PeerChunk
from tiercache.connector.block_pins import VllmBlockPins
from tiercache.connector.engine_info import ChunkGeometry
from tiercache.connector.metadata import TierCacheConnectorMetadata, TierCacheWorkerMetadata
from tiercache.connector.pd.scheduler_role import CONSUMER_ROLES, PDScheduler, pd_settings
from tiercache.connector.scheduler_faults import SchedulerFaults

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


@dataclass
class _RequestState:
    request: "Request"
    next_store_chunk: int = 0  # chunks below this were offered to the manager already
    lookup_local_tokens: int | None = None  # vLLM's own hit, from get_num_new_matched_tokens
    lookup_hit_tokens: int = 0
    shared_asked: bool = False  # the shared tiers answered for this request already
    tail_stored: bool = False  # P/D producer, via_host: the prompt's tail was offered to the host tier


@dataclass
class _JobRecord:
    direction: str  # load | store | demote
    req_id: str  # the request, or the lower tier's name for a demotion
    keys: tuple[bytes, ...]
    reports_left: int
    failed: set[bytes] = field(default_factory=set)


class TierCacheScheduler(SchedulerFaults):
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
        specs = [TierSpec(host.name, geometry.host_slots, host.policy), *lower_tier_specs(config, geometry)]
        if pd is not None and kv_role in CONSUMER_ROLES:
            # The producers, seen as one read-only shared tier (what they announced); direct:
            # the worker READs its chunks straight into the blocks, no host slot.
            specs.append(TierSpec(PEER_TIER, pd.max_peer_chunks, "lru", "read_only", shared=True, direct=True))
        self.manager = OffloadingManager(specs)
        self.pd: PDScheduler | None = None
        if pd is not None:
            self.pd = PDScheduler(pd, kv_role, self.keys, self.manager, geometry.chunk_tokens,
                                  engine_id, geometry.engine.tp_size, geometry.blocks_per_chunk)
        self._step_peer_sources: dict[bytes, PeerChunk] = {}
        self._chunk_bytes_by_tier = {t.name: geometry.slot_bytes for t in config.tiers}
        self._step_deletes: dict[str, list[bytes]] = {}
        for tier_name, extra in recover_lower_tiers(config, geometry, self.keys.digest, self.manager).items():
            self._step_deletes.setdefault(tier_name, []).extend(extra)
        # a chunk counts as held by a shared tier when every head's store shard is there
        shared = make_backends(config, geometry, self.keys.digest, rank=0, shared_only=True,
                               shards=geometry.engine.group_shard_set())
        self._shared: SharedLookup | None = \
            SharedLookup(shared, timeout_s=config.deadlines.lookup_s) if shared else None
        self.metrics = metrics or TierCacheMetrics()
        self.metrics.label(self.metrics.capacity_bytes, host.name).set(
            geometry.host_slots * geometry.slot_bytes
        )
        self._world_size = geometry.engine.world_size
        self._async_loads = config.load_mode == "async"
        self._reqs: dict[str, _RequestState] = {}
        self._jobs: dict[int, _JobRecord] = {}
        self._next_job_id = 0
        self._step_loads: list[TransferJobSpec] = []
        self._step_staging: dict[int, tuple[str | None, ...]] = {}
        self._step_invalid: list[int] = []
        self._step_failed_recvs: list[str] = []  # see SchedulerFaults
        self._kv_cache_manager: KVCacheManager | None = None
        self._counters: dict[str, float] = {}
        self._last_evictions = 0
        self._pd_published: dict[str, int] = {}

    # ------------------------------------------------------------ plumbing
    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        self._kv_cache_manager = kv_cache_manager
        if self.pd is not None and self.pd.marks_prefills:
            self.pd.bind_pins(VllmBlockPins.of(kv_cache_manager))  # mode direct pins hand-off blocks

    def _state(self, request: "Request") -> _RequestState:
        st = self._reqs.get(request.request_id)
        if st is None or st.request is not request:
            st = _RequestState(request)
            self._reqs[request.request_id] = st
        return st

    def _new_job(
        self, direction: str, req_id: str, keys: tuple[bytes, ...], segments: tuple[CopySegment, ...]
    ) -> TransferJobSpec:
        job_id = self._next_job_id
        self._next_job_id += 1
        self._jobs[job_id] = _JobRecord(direction, req_id, keys, self._world_size)
        return TransferJobSpec(job_id, req_id, direction, keys, segments)  # type: ignore[arg-type]

    def _count(self, name: str, value: float) -> None:
        self._counters[name] = self._counters.get(name, 0) + value

    # ------------------------------------------------------------- lookups
    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        keys = self.keys.chunk_keys(request.block_hashes)
        if not keys:
            return 0, False
        if self.pd is not None:
            self.pd.learn(request, keys)
        hits = self.manager.lookup(keys) or 0
        if self._shared is not None and hits < len(keys):
            asked = self._ask_shared_tiers(request, keys, hits)
            if asked is None:
                return None, False  # vLLM asks again on a later step; the scheduler never waits
            hits = asked
        local_chunks = min(hits, num_computed_tokens // self.chunk_tokens)
        if local_chunks:
            # The engine's own cache serves these: keep our copies warm too, so they
            # outlive the engine's copy (it evicts under pressure first).
            self.manager.touch(keys[:local_chunks])
        covered = hits * self.chunk_tokens
        tail = self.pd.tail_key(request, len(keys)) if self.pd is not None else None
        if tail is not None and hits == len(keys) and self.manager.lookup([tail]):
            covered = request.num_prompt_tokens  # a P/D hand-off's prompt tail (connector/prompt_tail.py)
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
        return hit_tokens - num_computed_tokens, self._async_loads

    def _ask_shared_tiers(self, request: "Request", keys: list[bytes], hits: int) -> int | None:
        """Extend the local hit with what the shared tiers hold; None while they are asked."""
        st = self._state(request)
        if st.shared_asked:
            return hits
        assert self._shared is not None
        token = request.request_id
        if not self._shared.asking(token):
            self._shared.ask(token, keys[hits:])
            return None
        answer = self._shared.answer(token)
        if answer is None:
            return None
        st.shared_asked = True
        for tier, present in answer.items():
            if present:
                self.manager.learn(tier, present)
        return self.manager.lookup(keys) or 0

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        st = self._state(request)
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
        block_ids = blocks.get_block_ids()[0]
        first_chunk, last_chunk = start // ct, (end - 1) // ct
        chunk_keys = self.keys.chunk_keys(request.block_hashes)
        keys = tuple(chunk_keys[first_chunk : last_chunk + 1])
        if last_chunk == len(chunk_keys) and self.pd is not None:
            tail = self.pd.tail_key(request, len(chunk_keys))
            if tail is None:
                raise RuntimeError(f"tiercache: load of {request.request_id} up to token {end} without its prompt tail")
            keys += (tail,)
        plan = self.manager.prepare_load(keys)
        segments: list[CopySegment] = []
        tokens_by_tier: dict[str, int] = {}
        for i, chunk in enumerate(range(first_chunk, last_chunk + 1)):
            lo = max(start, chunk * ct) // bs
            hi = -(-min(end, (chunk + 1) * ct) // bs)  # a partial last block loads whole
            if i >= len(plan.keys):
                # No host slot could be freed to stage this chunk: a failed load, recomputed.
                self._step_invalid.extend(block_ids[lo:hi])
                continue
            segments.append(CopySegment(plan.slots[i], lo - chunk * bpc, tuple(block_ids[lo:hi])))
            tier = plan.tiers[i]
            tokens_by_tier[tier] = tokens_by_tier.get(tier, 0) + min(end, (chunk + 1) * ct) - max(start, chunk * ct)
        job = self._new_job("load", request.request_id, plan.keys, tuple(segments))
        self._step_loads.append(job)
        if self.pd is not None and not self.pd.settings.keep_received and PEER_TIER in plan.tiers:
            # A pure decode engine: the hand-off's chunks are not copied out again into the host tier.
            st.next_store_chunk = max(st.next_store_chunk, min(first_chunk + len(plan.keys), len(chunk_keys)))
        if self.pd is not None:
            self._step_peer_sources.update(self.pd.sources_for(plan.tiers, plan.keys))
        if any(plan.staged) or any(s < 0 for s in plan.slots):
            # per key: the tier to read first (staged into its host slot, or a direct
            # tier's reader straight into the blocks), None for a host-tier chunk
            self._step_staging[job.job_id] = tuple(
                t if staged or slot < 0 else None for t, staged, slot in zip(plan.tiers, plan.staged, plan.slots)
            )
        for tier, tokens in tokens_by_tier.items():
            self.metrics.label(self.metrics.hit_tokens, tier).inc(tokens)
            self._count(f"hit_tokens_{tier}", tokens)
        self._count("hit_tokens", num_external_tokens)
        self._count("load_jobs", 1)

    # ---------------------------------------------------------- per step
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> TierCacheConnectorMetadata:
        stores: list[TransferJobSpec] = []
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(req_id)
            if st is not None and num_new > 0:
                job = self._plan_store(req_id, st, num_new)
                if job is not None:
                    stores.append(job)
                if (self.pd is not None and self.pd.marks_prefills
                        and st.request.num_computed_tokens + num_new >= st.request.num_prompt_tokens):
                    assert self._kv_cache_manager is not None, "bind_kv_cache_manager was not called"
                    self.pd.mark_prefill(st.request, self._kv_cache_manager.get_block_ids(req_id)[0])
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            st = self._reqs.get(req_id)
            if st is not None:
                st.next_store_chunk = 0  # re-offer on resume; present chunks are skipped
                st.tail_stored = False
            if self.pd is not None:
                self.pd.preempted(req_id)
        for req_id in scheduler_output.finished_req_ids:
            self._reqs.pop(req_id, None)
        demotes = [
            DemoteJobSpec(self._new_job("demote", p.tier, p.keys, ()).job_id, p.tier, p.keys, p.host_slots)
            for p in self.manager.prepare_demotions()
        ]
        for tier_name, keys in self.manager.take_deletes().items():
            self._step_deletes.setdefault(tier_name, []).extend(keys)
        direct_holds: dict[str, Any] = {}
        direct_unmarks: list[str] = []
        direct_released: list[str] = []
        if self.pd is not None:
            self._pd_step()
            direct_holds, direct_unmarks, direct_released = self.pd.take_direct()
        meta = TierCacheConnectorMetadata(
            loads=self._step_loads,
            stores=stores,
            loads_are_sync=not self._async_loads,
            staging=self._step_staging,
            invalid_block_ids=self._step_invalid,
            demotes=demotes,
            deletes=self._step_deletes,
            peer_sources=self._step_peer_sources,
            handoffs_held=self.pd is not None and self.pd.held_chunks > 0,
            direct_holds=direct_holds,
            direct_unmarks=direct_unmarks,
            direct_released=direct_released,
            failed_recvs=self._step_failed_recvs,
        )
        self._step_failed_recvs = []
        self.metrics.count_faults(faults.take())  # this process's faults (the workers' come in their reports)
        self._step_loads, self._step_staging, self._step_invalid, self._step_deletes = [], {}, [], {}
        self._step_peer_sources = {}
        self._sync_tier_metrics()
        return meta

    def _plan_store(self, req_id: str, st: _RequestState, num_new: int) -> TransferJobSpec | None:
        request = st.request
        computed_after = request.num_computed_tokens + num_new
        limit = len(request.block_hashes) * self.block_size
        if not self.config.offload_decode_tokens:
            limit = min(limit, request.num_prompt_tokens)
        full_chunks = min(computed_after, limit) // self.chunk_tokens
        first = st.next_store_chunk
        keys = self.keys.chunk_keys(request.block_hashes, start_chunk=first)[: max(full_chunks - first, 0)]
        st.next_store_chunk = max(full_chunks, first)
        tail = None
        if self.pd is not None and not st.tail_stored and computed_after >= request.num_prompt_tokens:
            # P/D producer, via_host: the prompt's partial last chunk goes with its chunks
            tail = self.pd.tail_to_store(request)
            st.tail_stored = True
        if tail is not None:
            keys.append(tail.key)
        if not keys:
            return None
        plan = self.manager.prepare_store(keys)
        if plan is None:
            return None
        if plan.evicted:
            self.metrics.label(self.metrics.evictions, plan.tier).inc(len(plan.evicted))
            self._count("evicted_chunks", len(plan.evicted))
        assert self._kv_cache_manager is not None, "bind_kv_cache_manager was not called"
        block_ids = self._kv_cache_manager.get_block_ids(req_id)[0]
        chunk_of = {key: first + i for i, key in enumerate(keys)}
        bpc = self.bpc
        segments = []
        for key, slot in zip(plan.keys, plan.slots):
            if tail is not None and key == tail.key:  # its blocks, the last partly filled
                c, end = tail.chunk, tail.chunk * bpc + tail.blocks(self.block_size)
            else:
                c = chunk_of[key]
                end = (c + 1) * bpc
            segments.append(CopySegment(slot, 0, tuple(block_ids[c * bpc : end])))
        self._count("store_jobs", 1)
        return self._new_job("store", req_id, plan.keys, tuple(segments))

    def _pd_step(self) -> None:
        """Expire unread hand-offs; publish the P/D counters."""
        assert self.pd is not None
        self.pd.expire()
        self._publish_pd_metrics()

    def _publish_pd_metrics(self) -> None:
        assert self.pd is not None
        for name, value in self.pd.counters.items():
            if name.startswith("handoffs_"):
                outcome = name.removeprefix("handoffs_")
                metric = self.metrics.label(self.metrics.pd_handoffs, outcome)
                metric.inc(value - self._pd_published.get(name, 0))  # type: ignore[union-attr]
                self._pd_published[name] = value
        self.metrics.label(self.metrics.pd_held_chunks).set(self.pd.held_chunks)  # type: ignore[union-attr]

    def update_connector_output(self, worker_meta: TierCacheWorkerMetadata | None) -> None:
        if worker_meta is None:
            return
        self.metrics.count_faults(worker_meta.faults)
        if self.pd is not None and worker_meta.handoffs_read:
            self.pd.handoffs_read(worker_meta.handoffs_read)
            self._publish_pd_metrics()  # the engine may go idle now: no later step would
        if self.pd is not None and worker_meta.blocks_released:
            self.pd.blocks_released(worker_meta.blocks_released)  # mode direct: unpinned, vLLM's again
        for path, num_bytes, secs in worker_meta.transfers:
            self.metrics.observe_transfer(path, num_bytes, secs)  # P/D consumer: the NIXL READs alone
        for job_id, report in worker_meta.done.items():
            rec = self._jobs.get(job_id)
            if rec is None:
                continue
            rec.reports_left -= report.reports
            rec.failed |= report.failed_keys
            path = {"load": "host_to_device", "store": "device_to_host"}.get(rec.direction, f"host_to_{rec.req_id}")
            self.metrics.observe_transfer(path, report.bytes, report.secs)
            self._count(f"{rec.direction}_bytes", report.bytes)
            self._count(f"{rec.direction}_secs", report.secs)
            if rec.reports_left > 0:
                continue
            del self._jobs[job_id]
            self._finish_job(rec)

    def _finish_job(self, rec: _JobRecord) -> None:
        if rec.failed:
            self.metrics.label(self.metrics.failures, rec.direction).inc(len(rec.failed))
            self._count(f"failed_{rec.direction}_chunks", len(rec.failed))
        if rec.direction == "load":
            self.manager.complete_load(rec.keys, failed=rec.failed)
            if self.pd is not None:
                self.pd.load_finished(rec.keys, rec.failed)
            if rec.failed:
                # A chunk that failed to load is dropped, so the recompute that vLLM now
                # schedules does not look it up and fail on it again (a livelock).
                self.manager.discard(list(rec.failed))
                self._reoffer_after_failed_load(rec)
            return
        if rec.direction == "demote":
            self.manager.complete_demotion(rec.req_id, rec.keys, failed=rec.failed)
            return
        ok = [k for k in rec.keys if k not in rec.failed]
        self.manager.complete_store(ok, ok=True)
        if rec.failed:
            self.manager.complete_store(list(rec.failed), ok=False)

    def _reoffer_after_failed_load(self, rec: _JobRecord) -> None:
        """Store the failed chunks again once vLLM has recomputed them (else: misses for good)."""
        st = self._reqs.get(rec.req_id)
        if st is None:
            return
        keys = self.keys.chunk_keys(st.request.block_hashes)
        failed_at = [i for i, key in enumerate(keys) if key in rec.failed]
        if failed_at:
            st.next_store_chunk = min(st.next_store_chunk, failed_at[0])

    def _sync_tier_metrics(self) -> None:
        for name, (used, _total) in self.manager.usage().items():
            self.metrics.label(self.metrics.used_bytes, name).set(used * self.geometry.slot_bytes)

    # ------------------------------------------------------------ the rest
    def request_finished(self, request: "Request", block_ids: list[int] | None = None) -> tuple[bool, dict[str, Any] | None]:
        # Stores for the request's last step were planned in that step's metadata and
        # are fenced by the worker before the next forward pass: nothing to delay
        # (a P/D hand-off in mode direct pins its blocks instead: connector/pd/scheduler_role.py).
        self._reqs.pop(request.request_id, None)
        if self._shared is not None:
            self._shared.forget(request.request_id)
        if self.pd is not None:
            self.pd.forget_request(request.request_id)
            return self.pd.request_finished(request, block_ids)
        return False, None

    def has_pending_handoffs(self) -> bool:
        """P/D producer: the engine must run another step for its hand-offs (see PDScheduler.has_pending)."""
        return self.pd is not None and self.pd.has_pending()

    def take_events(self) -> list[ChunkEvent]:
        return self.manager.take_events()

    def take_counters(self) -> dict[str, float]:
        counters, self._counters = self._counters, {}
        return counters

    def reset(self) -> bool:
        dropped = self.manager.reset()
        logger.info("tiercache: reset dropped %d chunks", dropped)
        return True

    def shutdown(self) -> None:
        if self._shared is not None:
            self._shared.close()
        self.manager.shutdown()
