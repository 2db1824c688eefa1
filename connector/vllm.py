"""TierCacheConnector: the class vLLM loads; a thin facade over scheduler.py and worker.py.

Enable it with::

    --kv-transfer-config '{"kv_connector": "TierCacheConnector",
                           "kv_connector_module_path": "tiercache.connector.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"config_file": "configs/cpu.yaml"}}'

Other keys of ``kv_connector_extra_config`` override the YAML file (see
``tiercache.config.schema``). The connector runs on vLLM's CPU platform and on CUDA.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tiercache.config.schema import config_from_extra
from tiercache.tiers.registry import check_tier_backends
from tiercache.connector.vllm_version import check_vllm_version
from tiercache.metrics import TierCacheMetrics
from tiercache.connector.prom_metrics import TierCachePromMetrics, engine_labels

from tiercache.connector.engine_info import ChunkGeometry, EngineGeometry, parallel_rank
from tiercache.connector import guard
from tiercache.connector.events import KVEvents
from tiercache.connector.guard import contained
from tiercache.connector.inactive import InactiveScheduler, InactiveWorker
from tiercache.connector.kv_groups import UnsupportedKVGroups, refuse_unserved_state_layers
from tiercache.connector.logs import adopt_vllm_logging
from tiercache.connector.metadata import TierCacheConnectorMetadata, TierCacheWorkerMetadata
from tiercache.connector.model_identity import model_identity_fields, scheduler_attention_view
from tiercache.connector.namespace_check import SchedulerGate, WorkerNamespace
from tiercache.connector.scheduler import TierCacheScheduler
from tiercache.connector.stats import TierCacheStats
from tiercache.connector.worker import TierCacheWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

SUPPORTED_ROLES = ("kv_both", "kv_producer", "kv_consumer")


class TierCacheConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.HOST
    _kv_events = KVEvents.off()  # records nothing; the scheduler's own is set in __init__ (connector/events.py)
    _metrics: TierCacheMetrics | None = None  # the scheduler's (tiercache/metrics.py)

    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: "KVCacheConfig | None" = None,
    ) -> None:
        check_vllm_version()  # before anything is allocated: connector/vllm_version.py
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        if transfer.kv_role not in SUPPORTED_ROLES:
            raise ValueError(
                f"kv_role: TierCacheConnector supports {SUPPORTED_ROLES}, got {transfer.kv_role!r}"
            )
        self.config = config_from_extra(transfer.kv_connector_extra_config)
        check_tier_backends(self.config.tiers)  # the same check as `tiercache config check`
        adopt_vllm_logging(self.config.log_level)
        assert kv_cache_config is not None, "vLLM must pass kv_cache_config to connectors"
        self._scheduler: TierCacheScheduler | None = None
        self._worker: TierCacheWorker | None = None
        self._namespace: WorkerNamespace | None = None
        try:
            engine = EngineGeometry.from_vllm(vllm_config, kv_cache_config)
            refuse_unserved_state_layers(engine.kv_groups, engine.pp_size)
        except UnsupportedKVGroups as exc:
            # vLLM must still serve the model: tiercache steps aside (connector/inactive.py)
            logger.warning("tiercache inactive for this engine (vLLM serves it without offloading): %s", exc)
            if role == KVConnectorRole.SCHEDULER:
                self._scheduler = InactiveScheduler(str(exc))  # type: ignore[assignment]
            else:
                self._worker = InactiveWorker(str(exc))  # type: ignore[assignment]
                self._namespace = None
            return
        geometry = ChunkGeometry.build(self.config, engine)
        if role == KVConnectorRole.SCHEDULER:
            # A failed load must become a recompute, not a failed request (docs/architecture.md, Faults);
            # vLLM reads this right after constructing the scheduler-side connector.
            transfer.kv_load_failure_policy = self.config.load_failure_policy
            # on vLLM's /metrics through get_kv_connector_stats (connector/prom_metrics.py)
            metrics = self._metrics = TierCacheMetrics(**engine_labels(vllm_config, self.config))
            if self.config.metrics.port is not None:
                metrics.serve(self.config.metrics.port, self.config.metrics.host)
            # Built once every worker's identity is in (vLLM's start-up handshake), so that the
            # namespace covers the KV layout the workers registered (connector/namespace_check.py).
            self._scheduler = SchedulerGate(  # type: ignore[assignment]
                self.config, geometry, model_identity_fields(vllm_config),
                scheduler_attention_view(vllm_config, kv_cache_config),
                lambda config, geo: TierCacheScheduler(config, geo, metrics, kv_role=transfer.kv_role,
                                                       engine_id=str(transfer.engine_id or "0")),
            )
            self._kv_events = KVEvents.for_engine(vllm_config, self.config, engine.block_size,
                                                  geometry.blocks_per_chunk)
            logger.info(
                "tiercache: %d-token chunks (%d B), host tier %d chunks",
                geometry.chunk_tokens,
                geometry.slot_bytes,
                geometry.host_slots,
            )
        else:
            self._worker = TierCacheWorker(
                self.config, geometry, kv_cache_config.num_blocks, rank=parallel_rank()[1],
                kv_role=transfer.kv_role,
            )
            # The handshake reaches this connector only when vLLM loaded it directly (a
            # MultiConnector forwards one connector's): else the step reports carry it.
            self._namespace = WorkerNamespace(vllm_config, kv_cache_config, model_identity_fields(vllm_config),
                                              handshake=transfer.kv_connector == type(self).__name__)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is only a future miss

    # ------------------------------------------------------------ worker side
    def _w(self) -> TierCacheWorker:
        assert self._worker is not None, "worker-side method called on the scheduler connector"
        return self._worker

    def _meta(self) -> TierCacheConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TierCacheConnectorMetadata)
        return meta

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        worker = self._w()
        if self._namespace is None:  # inactive (connector/inactive.py)
            return
        # the namespace covers the layout registered here (connector/namespace_check.py)
        worker.config, worker.geometry = self._namespace.prepare(worker.config, worker.geometry, kv_caches)
        worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> "KVConnectorHandshakeMetadata | None":
        return self._namespace.handshake_metadata() if self._worker is not None and self._namespace else None

    @contained()
    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._w().handle_preemptions(kv_connector_metadata)  # type: ignore[arg-type]

    @contained(fallback=guard.fail_loads)
    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        if self._namespace is not None:
            self._namespace.saw(self._meta())
        self._w().start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous and whole-request

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: "AttentionMetadata",
        **kwargs: Any,
    ) -> None:
        return None  # stores are submitted once per step in wait_for_save

    @contained(fallback=guard.fail_saves)
    def wait_for_save(self) -> None:
        self._w().wait_for_save(self._meta())

    @contained(guard.no_finished)
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._w().get_finished(finished_req_ids)

    @contained(guard.no_transfer_results)
    def get_transfer_results(self, finished_req_ids: set[str]) -> "KVConnectorTransferResults":
        # get_finished's, plus a hybrid model's failed loads per request (vLLM 0.32 takes no failed
        # blocks with several KV-cache groups: connector/kv_groups.py)
        sending, recving = self.get_finished(finished_req_ids)
        worker = self._w()
        failed = worker.take_failed_recving() if hasattr(worker, "take_failed_recving") else set()
        return KVConnectorTransferResults(set(sending or ()), set(recving or ()), failed)

    @contained(set)
    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._w().get_block_ids_with_load_errors()

    @contained()
    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        report = self._w().build_worker_meta()
        return self._namespace.attach(report) if self._namespace is not None else report

    @contained()
    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # --------------------------------------------------------- scheduler side
    def _s(self) -> TierCacheScheduler:
        assert self._scheduler is not None, "scheduler-side method called on a worker connector"
        return self._scheduler

    @contained()
    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._s().bind_kv_cache_manager(kv_cache_manager)

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], "KVConnectorHandshakeMetadata"]
    ) -> None:
        # Start-up, after the workers registered their KV caches: a namespace mismatch
        # raises here and vLLM refuses to start (connector/namespace_check.py).
        self._s().handshake(metadata)  # type: ignore[attr-defined]

    def set_xfer_handshake_metadata(self, metadata: dict[int, "KVConnectorHandshakeMetadata"]) -> None:
        self.set_xfer_handshake_metadata_pp_aware({(0, rank): m for rank, m in metadata.items()})

    @contained(guard.NO_MATCH)
    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._kv_events.saw(request)
        return self._s().get_num_new_matched_tokens(request, num_computed_tokens)

    @contained(fallback=guard.fail_alloc)
    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        self._kv_events.saw(request)
        self._s().update_state_after_alloc(request, blocks, num_external_tokens)

    @contained(TierCacheConnectorMetadata, fallback=guard.fallback_meta)
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = self._s().build_connector_meta(scheduler_output)
        self._kv_events.planned(meta)  # what the planned chunks are, for their KV events
        return meta

    @contained()
    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        self._s().update_connector_output(
            meta if isinstance(meta, TierCacheWorkerMetadata) else None
        )

    @contained(guard.NOT_DELAYED)
    def request_finished(
        self, request: "Request", block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._kv_events.finished(request.request_id)
        return self._s().request_finished(request, (block_ids,))

    @contained(guard.NOT_DELAYED)
    def request_finished_all_groups(
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._kv_events.finished(request.request_id)
        return self._s().request_finished(request, block_ids)

    @contained(False)
    def has_pending_push_work(self) -> bool:
        # Keep the engine stepping, even with no request left, while (1) a store's blocks are
        # pinned: the workers' reports that release them come only in a step (connector/
        # store_pins.py); (2) a P/D producer's worker must learn of hand-off marks and releases,
        # or progress UCX for held hand-offs with tcp transports (see PDScheduler.has_pending);
        # (3) copies down to lower tiers wait to be planned or reported: an idle engine would
        # keep their host copies pinned (a reset skips them) and never write a shared tier.
        return self._scheduler is not None and self._scheduler.has_pending_work()

    @contained(list)
    def take_events(self) -> Iterable["KVCacheEvent"]:
        return self._kv_events.translate(self._s().take_events())  # drained even with events off

    @contained()
    def get_kv_connector_stats(self) -> "KVConnectorStats | None":
        if self._scheduler is None:
            return None
        counters = self._scheduler.take_counters()
        prom = self._metrics.take_payload() if self._metrics is not None else None
        stats = TierCacheStats.from_counters(counters, prom)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> "KVConnectorStats | None":
        return TierCacheStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: "VllmConfig",
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> TierCachePromMetrics:
        # tiercache's series on vLLM's own /metrics, labelled like vLLM's (connector/prom_metrics.py)
        return TierCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @contained(False)
    def reset_cache(self) -> bool | None:
        return self._s().reset() if self._scheduler is not None else None

    def stats_snapshot(self) -> dict[str, Any]:
        """Manager statistics (scheduler side), for tools and tests."""
        stats = self._s().manager.stats()
        return {
            "lookups": stats.lookups,
            "lookup_hit_chunks": stats.lookup_hit_chunks,
            "tiers": {name: t.as_dict() for name, t in stats.tiers.items()},
        }
