"""Worker half of the connector: register KV caches, run the step's jobs, report.

Runs in each vLLM worker process, on its main thread. Per step (see vLLM's
``KVConnectorModelRunnerMixin``):

1. ``handle_preemptions`` (before the forward pass): nothing. A store still
   copying reads blocks that vLLM cannot reallocate: the scheduler pins them
   until every worker reported the store (connector/store_pins.py, which
   names the vLLM code this relies on). No fence here could protect them: the
   V2 model runner zeroes and copies into newly allocated blocks before this
   hook runs, and the forward pass never writes the full blocks a store reads;
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
from tiercache.config.schema import ConfigError, TierCacheConfig
from tiercache.jobs import LoadJob
from tiercache.layout import KVBlockLayout, LayoutError
from tiercache.shards import HeadSlicer, ShardError, ShardSet
from tiercache.tiers.tier_io import TierIO
from tiercache.transfer.engine import TransferEngine
from tiercache.transfer.pipeline import WorkerPipeline

from tiercache.connector.engine_info import ChunkGeometry, parallel_rank
from tiercache.connector.lower_tiers import make_backends
from tiercache.connector.metadata import TierCacheConnectorMetadata, TierCacheWorkerMetadata
from tiercache.connector.pd.roles import WorkerPD, pd_settings
from tiercache.connector.pd.worker_role import PDWorker
from tiercache.connector.worker_faults import WorkerFaults

logger = logging.getLogger(__name__)


class TierCacheWorker(WorkerFaults):
    def __init__(
        self, config: TierCacheConfig, geometry: ChunkGeometry, num_blocks: int, rank: int = 0,
        kv_role: str = "kv_both",
    ) -> None:
        self.config = config
        self.kv_role = kv_role
        settings = pd_settings(kv_role, config.pd)
        # P/D's role (tiercache.connector.pd.roles): a null object when P/D is off
        self.pd: WorkerPD = WorkerPD() if settings is None else PDWorker(settings, kv_role, geometry, rank)
        self.geometry = geometry
        self.num_blocks = num_blocks
        self.rank = rank
        self.engine: WorkerPipeline | None = None
        self._loads: dict[int, LoadJob] = {}
        self._sync_jobs: set[int] = set()
        self._finished_recving: set[str] = set()
        self._invalid_blocks: set[int] = set()
        self._failed_recving: set[str] = set()  # a hybrid model's failed loads (connector/kv_groups.py)
        self._by_request = geometry is not None and len(geometry.engine.kv_groups) > 1
        self._given_up: set[int] = set()  # see WorkerFaults
        self._step_taken: set[int] = set()
        self._report = TierCacheWorkerMetadata()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layout = KVBlockLayout.from_kv_caches(kv_caches, self.num_blocks, layout_name=self.geometry.engine.kv_layout)
        expected = self.geometry.engine.bytes_per_block
        if layout.bytes_per_block != expected:
            raise ConfigError(
                f"tiercache: the KV tensors hold {layout.bytes_per_block} bytes per block, the "
                f"KV-cache config says {expected}; unsupported KV layout"
            )
        host = self.config.host_options
        slab = self.pd.host_slab(host.prefault, host.layout)
        transfer = TransferEngine(
            layout,
            self.geometry.slot_blocks,  # per KV-cache group: blocks_per_chunk (connector/kv_groups.py)
            self.geometry.host_slots,
            faults=self.config.faults,
            copy_threads=self.config.copy_threads,
            cuda_copy=self.config.cuda_copy,
            kv_groups=len(self.geometry.engine.kv_groups),
            prefault_host=slab.prefault,
            huge_host=slab.huge_pages,
            slot_layout=slab.layout,
        )
        keyspace = self.geometry.keyspace(self.config)
        shards, slicer = self._store_shards(kv_caches) if len(self.config.tiers) > 1 else (None, None)
        backends = make_backends(self.config, self.geometry, keyspace.digest, self.rank, shards=shards, slicer=slicer)
        block_readers = self.pd.register(kv_caches, layout, transfer, keyspace, self.num_blocks)
        tier_io = TierIO(backends, transfer.host.slab, transfer.planes, self.geometry.slot_blocks) \
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
            slab.layout,
            transfer.host.describe_pinning() + (", prefaulted" if transfer.host.prefaulted else ""),
            sorted(backends) or "none",
        )
        self._report.host_pinned_bytes = transfer.host.pinned_bytes  # once: tiercache_host_pinned_bytes

    def _store_shards(self, kv_caches: dict[str, torch.Tensor]) -> tuple[ShardSet, HeadSlicer | None]:
        """This rank's store shards for lower tiers: by KV head, or by rank if pages cannot be cut."""
        engine = self.geometry.engine
        pp_rank = parallel_rank()[0]
        if engine.kv_heads > 0:
            try:
                slicer = HeadSlicer.from_kv_caches(kv_caches, self.num_blocks, engine.local_kv_heads,
                                                   self.geometry.slot_blocks)
                if slicer.shard_bytes == self.geometry.shard_bytes:
                    return engine.shard_set(self.rank, pp_rank), slicer
                reason = f"a head's shard is {slicer.shard_bytes} bytes, expected {self.geometry.shard_bytes}"
            except (ShardError, LayoutError) as exc:
                reason = str(exc)
            logger.warning("tiercache: lower tiers hold rank shards (shared only with engines of TP size %d): %s",
                           engine.tp_size, reason)
        return engine.shard_set(self.rank, pp_rank, head_sliceable=False), None

    def _engine(self) -> WorkerPipeline:
        if self.engine is None:
            raise RuntimeError("tiercache: register_kv_caches was not called")
        return self.engine

    def handle_preemptions(self, meta: TierCacheConnectorMetadata) -> None:
        """Nothing to do: stores in flight keep their blocks through the scheduler's pins (see above)."""
        del meta

    def start_load_kv(self, meta: TierCacheConnectorMetadata) -> None:
        engine = self._engine()
        self.pd.before_loads(meta.pd, meta.loads, self._report.pd)
        self._invalid_blocks.update(meta.invalid_block_ids)
        self._finished_recving.update(meta.failed_recvs)  # async loads the scheduler could not plan
        if self._by_request:  # a hybrid model: failures per request, vLLM takes no failed blocks
            self._failed_recving.update(meta.failed_recvs)
            self._failed_recving.update(meta.failed_loads)
        self._step_taken = set()
        for job in meta.loads:
            self._start_load(engine, job, meta.loads_are_sync)
        if meta.loads and meta.loads_are_sync:
            # vLLM calls this before the forward pass when a step has sync loads; the
            # blocks must hold their KV before attention reads them (staged chunks are
            # read from their lower tier first, until deadlines.load_s). Stores in flight
            # read other blocks (pinned by the scheduler: connector/store_pins.py).
            self._wait_sync(engine, [job.job_id for job in meta.loads if job.job_id in self._loads])

    def wait_for_save(self, meta: TierCacheConnectorMetadata) -> None:
        engine = self._engine()
        # queued on the housekeeping lanes; a demotion waits for the deletes queued before it
        engine.delete(meta.deletes)
        self._step_taken = set()
        self.pd.before_stores(meta.pd, meta.stores)
        for job in meta.stores:
            self._start_save(engine.submit, job)
        self._absorb(self.pd.after_stores(meta.stores, engine))
        for demote in meta.demotes:
            self._start_save(engine.submit_demote, demote)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        self.pd.poll(self._report.pd)
        if self.engine is not None:
            self._absorb(self.engine.poll())
        recving, self._finished_recving = self._finished_recving, set()
        return set(), recving  # nothing is "sending": a producer's hand-offs never delay vLLM's frees

    def _absorb(self, results: list) -> None:
        for res in results:
            self.pd.job_done(res)
            job = self._loads.pop(res.job_id, None)
            if job is None:
                continue
            if res.job_id in self._given_up:
                self._given_up.discard(res.job_id)  # its blocks were reported failed already
                continue
            if res.job_id in self._sync_jobs:
                self._sync_jobs.discard(res.job_id)  # its request is running: no recv report
            else:
                self._finished_recving.add(job.req_id)
            if res.failed_keys:
                self._fail_load(job, set(res.failed_keys))
        if self.engine is not None:
            # the manager's view: a load past its deadline is reported when its backend is done
            for rep in self.engine.take_reports():
                self._report.add(rep.job_id, rep.failed_keys, rep.bytes, rep.secs)

    def take_failed_recving(self) -> set[str]:
        """A hybrid model's requests whose load failed: vLLM recomputes them from token 0."""
        failed, self._failed_recving = self._failed_recving, set()
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid_blocks = self._invalid_blocks, set()
        return invalid

    def build_worker_meta(self) -> TierCacheWorkerMetadata | None:
        for reason, n in faults.take().items():  # this process's faults: counted by the scheduler
            self._report.faults[reason] = self._report.faults.get(reason, 0) + n
        if not (self._report.done or self._report.pd or self._report.faults
                or self._report.host_pinned_bytes is not None):
            return None
        report, self._report = self._report, TierCacheWorkerMetadata()
        return report

    def shutdown(self) -> None:
        if self.engine is not None:
            self._absorb(self.engine.wait_all())
            self.engine.shutdown()
            self.engine = None
        self.pd.close()
