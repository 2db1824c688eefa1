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

from tiercache.config import ConfigError, TierCacheConfig
from tiercache.layout import KVBlockLayout
from tiercache.pipeline import WorkerPipeline
from tiercache.tier_io import TierIO
from tiercache.transfer import TransferEngine, TransferJobSpec

from tiercache.connector.lower_tiers import make_backends

from tiercache.connector.engine_info import ChunkGeometry
from tiercache.connector.metadata import TierCacheConnectorMetadata, TierCacheWorkerMetadata

logger = logging.getLogger(__name__)


class TierCacheWorker:
    def __init__(
        self, config: TierCacheConfig, geometry: ChunkGeometry, num_blocks: int, rank: int = 0
    ) -> None:
        self.config = config
        self.geometry = geometry
        self.num_blocks = num_blocks
        self.rank = rank
        self.engine: WorkerPipeline | None = None
        self._loads: dict[int, TransferJobSpec] = {}
        self._sync_jobs: set[int] = set()
        self._finished_recving: set[str] = set()
        self._invalid_blocks: set[int] = set()
        self._report = TierCacheWorkerMetadata()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layout = KVBlockLayout.from_kv_caches(kv_caches, self.num_blocks)
        expected = self.geometry.engine.bytes_per_block
        if layout.bytes_per_block != expected:
            raise ConfigError(
                f"tiercache: the KV tensors hold {layout.bytes_per_block} bytes per block, the "
                f"KV-cache config says {expected}; unsupported KV layout"
            )
        transfer = TransferEngine(
            layout,
            self.geometry.blocks_per_chunk,
            self.geometry.host_slots,
            faults=self.config.faults,
            copy_threads=self.config.copy_threads,
        )
        digest = self.geometry.keyspace(self.config).digest
        backends = make_backends(self.config, self.geometry, digest, self.rank)
        tier_io = TierIO(backends, transfer.host.slab) if backends else None
        self.engine = WorkerPipeline(transfer, tier_io)
        logger.info(
            "tiercache worker: %d regions, %d B/block, host tier %d slots x %d B (%s), lower tiers %s",
            len(layout.regions),
            layout.bytes_per_block,
            self.geometry.host_slots,
            self.geometry.slot_bytes,
            "pinned" if transfer.host.pinned else "pageable",
            sorted(backends) or "none",
        )

    def _engine(self) -> WorkerPipeline:
        if self.engine is None:
            raise RuntimeError("tiercache: register_kv_caches was not called")
        return self.engine

    def handle_preemptions(self, meta: TierCacheConnectorMetadata) -> None:
        if self.engine is not None:
            self.engine.fence_stores()

    def start_load_kv(self, meta: TierCacheConnectorMetadata) -> None:
        engine = self._engine()
        self._invalid_blocks.update(meta.invalid_block_ids)
        for spec in meta.loads:
            self._loads[spec.job_id] = spec
            engine.submit(spec, meta.staging.get(spec.job_id, ()))
        if meta.loads and meta.loads_are_sync:
            # vLLM calls this before the forward pass when a step has sync loads; the
            # blocks must hold their KV before attention reads them (staged chunks are
            # read from their lower tier first). Earlier stores were fenced already.
            for spec in meta.loads:
                self._sync_jobs.add(spec.job_id)
            self._absorb(engine.wait_for([spec.job_id for spec in meta.loads]))

    def wait_for_save(self, meta: TierCacheConnectorMetadata) -> None:
        engine = self._engine()
        engine.delete(meta.deletes)  # before the demotions, so the budget has room for them
        for spec in meta.stores:
            engine.submit(spec)
        for demote in meta.demotes:
            engine.submit_demote(demote)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        if self.engine is not None:
            self._absorb(self.engine.poll())
        recving, self._finished_recving = self._finished_recving, set()
        return set(), recving

    def _absorb(self, results: list) -> None:
        for res in results:
            self._report.add(res.job_id, res.failed_keys, res.bytes, res.secs)
            spec = self._loads.pop(res.job_id, None)
            if spec is None:
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

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid_blocks = self._invalid_blocks, set()
        return invalid

    def build_worker_meta(self) -> TierCacheWorkerMetadata | None:
        if not self._report.done:
            return None
        report, self._report = self._report, TierCacheWorkerMetadata()
        return report

    def shutdown(self) -> None:
        if self.engine is not None:
            self._absorb(self.engine.wait_all())
            self.engine.shutdown()
            self.engine = None
