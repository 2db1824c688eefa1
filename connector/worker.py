"""Worker half of the connector: register KV caches, run the step's jobs, report.

Runs in each vLLM worker process, on its main thread. Per step (see vLLM's
``KVConnectorModelRunnerMixin``):

1. ``handle_preemptions`` (before the forward pass): fence earlier stores, so
   no block the forward pass may overwrite is still being read by a store;
2. ``start_load_kv``: submit the step's loads. Sync mode (default): vLLM calls
   it before the forward pass and it returns once the blocks hold their KV.
   Async mode: vLLM holds the requests until ``get_finished`` reports them;
3. ``wait_for_save`` (after the forward pass): submit the step's stores;
4. ``get_finished`` / ``get_block_ids_with_load_errors`` /
   ``build_worker_meta``: report finished loads, failed blocks (vLLM
   recomputes them) and finished jobs for the scheduler's manager.
"""

from __future__ import annotations

import logging

import torch

from tiercache import faults
from tiercache.backend import JobResult

from tiercache.config.schema import ConfigError, TierCacheConfig
from tiercache.transfer.huge_pages import collapse_tensors
from tiercache.layout import KVBlockLayout, LayoutError, SlotLayout
from tiercache.shards import HeadSlicer, ShardError, ShardSet
from tiercache.transfer.pipeline import WorkerPipeline
from tiercache.tiers.tier_io import TierIO
from tiercache.transfer.engine import TransferEngine, TransferJobSpec

from tiercache.connector.lower_tiers import make_backends

from tiercache.pd.peer_tier import PEER_TIER, NixlPeerTier
from tiercache.connector.engine_info import ChunkGeometry, parallel_rank
from tiercache.connector.metadata import TierCacheConnectorMetadata, TierCacheWorkerMetadata
from tiercache.connector.pd.scheduler_role import CONSUMER_ROLES, PRODUCER_ROLES, pd_settings
from tiercache.connector.worker_faults import WorkerFaults
from tiercache.pd.handoff import fingerprint
from tiercache.pd.blocks import BlockRegions
from tiercache.pd.channel import ProducerEndpoint
from tiercache.pd.heads import page_heads

logger = logging.getLogger(__name__)


class TierCacheWorker(WorkerFaults):
    def __init__(
        self, config: TierCacheConfig, geometry: ChunkGeometry, num_blocks: int, rank: int = 0,
        kv_role: str = "kv_both",
    ) -> None:
        self.config = config
        self.kv_role = kv_role
        self.pd = pd_settings(kv_role, config.pd)
        # P/D (see connector/pd/scheduler_role.py): the producer's side channel, the consumer's peer tier.
        self.handoff: ProducerEndpoint | None = None
        self.peer: NixlPeerTier | None = None
        self._stores: dict[int, TransferJobSpec] = {}
        self._staged_slots: dict[int, list[tuple[bytes, int]]] = {}
        self.geometry = geometry
        self.num_blocks = num_blocks
        self.rank = rank
        self.engine: WorkerPipeline | None = None
        self._loads: dict[int, TransferJobSpec] = {}
        self._sync_jobs: set[int] = set()
        self._finished_recving: set[str] = set()
        self._invalid_blocks: set[int] = set()
        self._given_up: set[int] = set()  # see WorkerFaults
        self._step_taken: set[int] = set()
        self._report = TierCacheWorkerMetadata()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layout = KVBlockLayout.from_kv_caches(kv_caches, self.num_blocks)
        expected = self.geometry.engine.bytes_per_block
        if layout.bytes_per_block != expected:
            raise ConfigError(
                f"tiercache: the KV tensors hold {layout.bytes_per_block} bytes per block, the "
                f"KV-cache config says {expected}; unsupported KV layout"
            )
        prefault = self.config.host_options.prefault
        huge = self.pd is not None and self.pd.huge_pages
        slot_layout = self._slot_layout()
        if huge:  # before NIXL registers them: a READ from (producer) or into (consumer) them
            report = collapse_tensors(kv_caches.values())
            if report.requested_bytes:
                logger.info("tiercache P/D: KV tensors in host memory: %s", report.describe())
        transfer = TransferEngine(
            layout,
            self.geometry.blocks_per_chunk,
            self.geometry.host_slots,
            faults=self.config.faults,
            copy_threads=self.config.copy_threads,
            # P/D: NIXL reads land in (consumer) or are served from (producer) host slots
            prefault_host=self.pd is not None if prefault is None else prefault,
            huge_host=huge,
            slot_layout=slot_layout,
        )
        if transfer.host.huge_pages is not None:
            logger.info("tiercache P/D: host slab: %s", transfer.host.huge_pages.describe())
        keyspace = self.geometry.keyspace(self.config)
        digest = keyspace.digest
        shards, slicer = self._store_shards(kv_caches) if len(self.config.tiers) > 1 else (None, None)
        backends = make_backends(self.config, self.geometry, digest, self.rank, shards=shards, slicer=slicer)
        block_readers = {}
        if self.pd is not None:
            slab = transfer.host.slab
            pd = self.pd
            # the handshake also checks that both sides' NIXL agents can talk to each other
            fp = {**fingerprint(keyspace.namespace), "nixl_error_handling": pd.nixl_error_handling}
            blocks = BlockRegions.from_layout(layout)
            engine = self.geometry.engine  # pages by KV head: hand-offs between TP sizes (tiercache.pd.heads)
            heads = page_heads(kv_caches, self.num_blocks, engine.kv_heads, engine.tp_size, self.rank,
                               engine.local_kv_heads)
            if self.kv_role in PRODUCER_ROLES:
                progress = pd.busy_progress if pd.busy_progress is not None else pd.nixl_error_handling == "peer"
                planes = transfer.planes
                self.handoff = ProducerEndpoint(slab.data_ptr(), self.geometry.slot_bytes, self.geometry.host_slots,
                                                fp, pd.host, pd.port + self.rank, pd.nixl_error_handling, progress,
                                                blocks if pd.mode == "direct" else None,
                                                BlockRegions.from_planes(planes) if planes is not None else None,
                                                page_heads=heads)
            if self.kv_role in CONSUMER_ROLES:
                self.peer = NixlPeerTier(self.geometry.slot_bytes, fp, self.rank, pd.read_timeout_s,
                                         pd.nixl_error_handling, self.num_blocks)
                self.peer.expose_blocks(blocks)  # hand-offs are READ straight into the blocks
                self.peer.page_heads = heads
                block_readers[PEER_TIER] = self.peer
        tier_io = TierIO(backends, transfer.host.slab, transfer.planes, self.geometry.blocks_per_chunk) \
            if backends else None
        deadlines = self.config.deadlines
        self.engine = WorkerPipeline(transfer, tier_io, block_readers, deadlines.load_s, deadlines.store_s)
        self.engine.track_reports = True  # the manager hears of a job when its slots are free again
        logger.info(
            "tiercache worker: %d regions, %d B/block, host tier %d slots x %d B (%s, %s), lower tiers %s",
            len(layout.regions),
            layout.bytes_per_block,
            self.geometry.host_slots,
            self.geometry.slot_bytes,
            slot_layout,
            "pinned" if transfer.host.pinned else "pageable, prefaulted" if transfer.host.prefaulted else "pageable",
            sorted(backends) or "none",
        )

    def _store_shards(self, kv_caches: dict[str, torch.Tensor]) -> tuple[ShardSet, HeadSlicer | None]:
        """This rank's store shards for lower tiers: by KV head, or by rank if pages cannot be cut."""
        engine = self.geometry.engine
        pp_rank = parallel_rank()[0]
        if engine.kv_heads > 0:
            try:
                slicer = HeadSlicer.from_kv_caches(kv_caches, self.num_blocks, engine.local_kv_heads,
                                                   self.geometry.blocks_per_chunk)
                if slicer.shard_bytes == self.geometry.shard_bytes:
                    return engine.shard_set(self.rank, pp_rank), slicer
                reason = f"a head's shard is {slicer.shard_bytes} bytes, expected {self.geometry.shard_bytes}"
            except (ShardError, LayoutError) as exc:
                reason = str(exc)
            logger.warning("tiercache: lower tiers hold rank shards (shared only with engines of TP size %d): %s",
                           engine.tp_size, reason)
        return engine.shard_set(self.rank, pp_rank, head_sliceable=False), None

    def _slot_layout(self) -> SlotLayout:
        """The host slab's layout: as configured, else ``planes`` for a via_host producer (its
        consumers READ hand-offs out of the slab: a few runs per region instead of a run per chunk)."""
        configured = self.config.host_options.layout
        if configured is not None:
            return configured
        producer = self.pd is not None and self.pd.mode == "via_host" and self.kv_role in PRODUCER_ROLES
        return "planes" if producer else "slots"

    def _engine(self) -> WorkerPipeline:
        if self.engine is None:
            raise RuntimeError("tiercache: register_kv_caches was not called")
        return self.engine

    def handle_preemptions(self, meta: TierCacheConnectorMetadata) -> None:
        if self.engine is not None:
            self.engine.fence_stores()

    def start_load_kv(self, meta: TierCacheConnectorMetadata) -> None:
        engine = self._engine()
        if self.handoff is not None:
            self.handoff.set_holding(meta.handoffs_held)
            for rid in meta.direct_unmarks:
                self.handoff.release_blocks(rid)  # vLLM frees these blocks itself: nothing to report
            for rid in meta.direct_released:
                self.handoff.release_blocks(rid)  # cleared here (now or at the read): the scheduler unpins
                self._report.blocks_released[rid] = {self.rank}
        self._invalid_blocks.update(meta.invalid_block_ids)
        self._finished_recving.update(meta.failed_recvs)  # async loads the scheduler could not plan
        if self.peer is not None and meta.peer_sources:
            self.peer.expect(meta.peer_sources)
        self._step_taken = set()
        for spec in meta.loads:
            staging = meta.staging.get(spec.job_id, ())
            if self.handoff is not None and staging:
                filled = [(k, seg.slot) for k, seg, t in zip(spec.keys, spec.segments, staging) if t]
                self.handoff.slot_filling([slot for _, slot in filled])
                self._staged_slots[spec.job_id] = filled
            self._start_load(engine, spec, staging, meta.loads_are_sync)
        if meta.loads and meta.loads_are_sync:
            # vLLM calls this before the forward pass when a step has sync loads; the
            # blocks must hold their KV before attention reads them (staged chunks are
            # read from their lower tier first, until deadlines.load_s). Earlier stores
            # were fenced already.
            self._wait_sync(engine, [spec.job_id for spec in meta.loads if spec.job_id in self._loads])

    def wait_for_save(self, meta: TierCacheConnectorMetadata) -> None:
        engine = self._engine()
        if self.handoff is not None:
            # Mode direct: the forward pass just wrote these prompts' KV; consumers may read
            # them as soon as the request finishes, without another step here.
            for rid, hold in meta.direct_holds.items():
                self.handoff.hold_blocks(rid, hold.keys, hold.blocks)
        # queued on the housekeeping lanes; a demotion waits for the deletes queued before it
        engine.delete(meta.deletes)
        self._step_taken = set()
        for spec in meta.stores:
            if self.handoff is not None:
                self.handoff.slot_filling([seg.slot for seg in spec.segments])
                self._stores[spec.job_id] = spec
            self._start_save(engine.submit, spec)
        if self.handoff is not None and meta.stores and self.pd is not None and self.pd.mode == "via_host":
            # A producer's step ends with its chunks in host memory (mode via_host): a
            # consumer may ask for them the moment the request finishes, and an idle
            # engine runs no further step that would notice the copies completing.
            self._absorb(engine.wait_for([spec.job_id for spec in meta.stores]))
        for demote in meta.demotes:
            self._start_save(engine.submit_demote, demote)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        if self.handoff is not None:
            # Each step: the hand-offs consumers reported read (the side-channel thread
            # heard them meanwhile); mode direct: their blocks go back to vLLM.
            read = self.handoff.service()
            for rid in read:
                self._report.handoffs_read.setdefault(rid, set()).add(self.rank)
                if self.handoff.release_blocks(rid):  # mode direct: tags cleared, the scheduler unpins
                    self._report.blocks_released[rid] = {self.rank}
        if self.engine is not None:
            self._absorb(self.engine.poll())
        if self.peer is not None:
            self._report.transfers += self.peer.take_transfers()
        recving, self._finished_recving = self._finished_recving, set()
        return set(), recving  # nothing is "sending": a producer's hand-offs never delay vLLM's frees

    def _absorb(self, results: list) -> None:
        for res in results:
            if self.handoff is not None:
                self._publish_filled_slots(res)
            spec = self._loads.pop(res.job_id, None)
            if spec is None:
                continue
            if res.job_id in self._given_up:
                self._given_up.discard(res.job_id)  # its blocks were reported failed already
                continue
            if res.job_id in self._sync_jobs:
                self._sync_jobs.discard(res.job_id)  # its request is running: no recv report
            else:
                self._finished_recving.add(spec.req_id)
            if res.failed_keys:
                # vLLM recomputes from the first invalid block of the request on.
                failed = set(res.failed_keys)
                for key, seg in zip(spec.keys, spec.segments):
                    if key in failed:
                        self._invalid_blocks.update(seg.block_ids)
        if self.engine is not None:
            # the manager's view: a load past its deadline is reported when its backend is done
            for rep in self.engine.take_reports():
                self._report.add(rep.job_id, rep.failed_keys, rep.bytes, rep.secs)

    def _publish_filled_slots(self, res: JobResult) -> None:
        """Producer: host slots whose copy finished may now be read by consumers."""
        assert self.handoff is not None
        failed = set(res.failed_keys)
        store = self._stores.pop(res.job_id, None)
        pairs = [(k, seg.slot) for k, seg in zip(store.keys, store.segments)] if store else []
        pairs += self._staged_slots.pop(res.job_id, [])
        ok = [(k, slot) for k, slot in pairs if k not in failed]
        if ok:
            self.handoff.slot_filled([k for k, _ in ok], [slot for _, slot in ok])

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid_blocks = self._invalid_blocks, set()
        return invalid

    def build_worker_meta(self) -> TierCacheWorkerMetadata | None:
        for reason, n in faults.take().items():  # this process's faults: counted by the scheduler
            self._report.faults[reason] = self._report.faults.get(reason, 0) + n
        if not (self._report.done or self._report.handoffs_read or self._report.transfers
                or self._report.blocks_released or self._report.faults):
            return None
        report, self._report = self._report, TierCacheWorkerMetadata()
        return report

    def shutdown(self) -> None:
        if self.engine is not None:
            self._absorb(self.engine.wait_all())
            self.engine.shutdown()
            self.engine = None
        if self.peer is not None:
            self.peer.close()  # a block reader, not a TierIO backend: closed here
            self.peer = None
        if self.handoff is not None:
            self.handoff.close()
            self.handoff = None
