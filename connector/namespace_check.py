"""Start-up agreement on the key namespace between the scheduler and every worker.

The namespace digest must cover what the KV bytes depend on (``model_identity``):
the checkpoint, which scheduler and workers each compute from the config, and
the attention layout, which only a worker knows (the backend its layers chose,
the tensors it registered). So:

1. each worker, in ``register_kv_caches``, computes both identities, builds its
   namespace with them, and returns a :class:`WorkerIdentity` from
   ``get_handshake_metadata``;
2. vLLM's engine core collects them from every worker after the KV caches are
   registered and hands them to the scheduler-side connector
   (``set_xfer_handshake_metadata_pp_aware``; EngineCore.__init__, every
   platform and executor, CPU included) — before any request;
3. the scheduler half waits for that (:class:`SchedulerGate` holds it): the
   workers must agree with each other on the attention identity and with the
   scheduler on the model identity and its own view of the attention fields
   (layout, KV cache dtype, vLLM version); the scheduler then builds its
   namespace with the workers' attention identity and checks its digest
   fields against every worker's. Any difference refuses start-up with
   :class:`NamespaceMismatch`, naming each differing field and rank.

Fallback, when no handshake arrives (the hook is gone, or tiercache runs inside
vLLM's MultiConnector, which forwards only one connector's handshake): at its
first use the gate says so in the log and serves every lookup as a miss; the
workers put their :class:`WorkerIdentity` into their step reports
(``TierCacheWorkerMetadata.namespace_reports``) until the connector metadata
says the namespace is settled; once every rank has reported, the same check
runs, and a mismatch disables tiercache for the engine's life (an error in the
log, every lookup a miss) instead of raising into a running vLLM.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata

from tiercache.config.schema import ConfigError, TierCacheConfig
from tiercache.pd.handoff import fingerprint

from tiercache.connector.engine_info import ChunkGeometry, parallel_rank
from tiercache.connector.metadata import TierCacheConnectorMetadata, TierCacheWorkerMetadata
from tiercache.connector.model_identity import attention_identity_fields, identity_digest

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from tiercache.connector.scheduler import TierCacheScheduler

logger = logging.getLogger(__name__)

Rank = tuple[int, int]  # (pp_rank, tp_rank), as vLLM keys handshake metadata


class NamespaceMismatch(ConfigError):
    """The scheduler and the workers (or the workers among themselves) disagree on the namespace."""


@dataclass
class WorkerIdentity(KVConnectorHandshakeMetadata):
    """What one worker tells the scheduler at start-up (pickled by vLLM's executor)."""

    rank: Rank
    model: dict[str, str]  # model_identity_fields
    attention: dict[str, str]  # attention_identity_fields, as this worker registered its KV caches
    namespace: dict[str, Any] = field(default_factory=dict)  # its Namespace's fields (no process nonce)
    digest: str = ""  # its namespace digest (hex, no process nonce): must equal the scheduler's


# --------------------------------------------------------------------------- the digests


def with_identity(
    config: TierCacheConfig, geometry: ChunkGeometry, model: Mapping[str, str], attention: Mapping[str, str]
) -> tuple[TierCacheConfig, ChunkGeometry]:
    """The config and geometry whose namespace covers both identities (``EngineGeometry``'s
    ``model_identity`` and ``attention_identity``, passed on into ``Namespace``)."""
    engine = dataclasses.replace(geometry.engine, model_identity=identity_digest(model),
                                 attention_identity=identity_digest(attention))
    return config, dataclasses.replace(geometry, engine=engine)


def namespace_fields(config: TierCacheConfig, geometry: ChunkGeometry) -> dict[str, Any]:
    """The namespace's fields (the per-process nonce left out), to name what differs."""
    return fingerprint(geometry.keyspace(config).namespace)


def namespace_digest(config: TierCacheConfig, geometry: ChunkGeometry) -> str:
    """The namespace digest every key starts with (hex), without the per-process nonce."""
    namespace = geometry.keyspace(config).namespace
    return dataclasses.replace(namespace, process_nonce="").digest().hex()


# --------------------------------------------------------------------------- comparing


def _diff(what: str, ours: Mapping[str, Any], theirs: Mapping[str, Any], us: str, them: str,
          keys: Any = None) -> list[str]:
    names = sorted(keys if keys is not None else set(ours) | set(theirs))
    return [
        f"{what}.{n}: {us} {ours.get(n, '<absent>')!r}, {them} {theirs.get(n, '<absent>')!r}"
        for n in names
        if ours.get(n, "<absent>") != theirs.get(n, "<absent>")
    ]


def identity_mismatches(
    model: Mapping[str, str], attention_view: Mapping[str, str], workers: Mapping[Rank, WorkerIdentity]
) -> list[str]:
    """Every field on which a worker differs from the scheduler (model, attention view) or from rank 0."""
    lines: list[str] = []
    ranks = sorted(workers)
    first = workers[ranks[0]]
    for rank in ranks:
        w = workers[rank]
        lines += _diff("model", model, w.model, "scheduler", f"worker {rank}")
        lines += _diff("attention", attention_view, w.attention, "scheduler", f"worker {rank}",
                       keys=set(attention_view))
        if rank != ranks[0]:
            lines += _diff("attention", first.attention, w.attention, f"worker {ranks[0]}", f"worker {rank}")
    return lines


def namespace_mismatches(ours: Mapping[str, Any], digest: str, workers: Mapping[Rank, WorkerIdentity]) -> list[str]:
    """Per worker whose namespace digest is not the scheduler's: the fields that differ."""
    lines: list[str] = []
    for rank in sorted(workers):
        w = workers[rank]
        if w.digest == digest:
            continue
        named = _diff("namespace", ours, w.namespace, "scheduler", f"worker {rank}")
        lines += named or [f"namespace digest: scheduler {digest}, worker {rank} {w.digest} (equal fields)"]
    return lines


def mismatch_error(lines: list[str]) -> NamespaceMismatch:
    return NamespaceMismatch(
        "tiercache: the scheduler and the workers disagree on what the KV bytes depend on, so their "
        "chunk keys would not name the same bytes:\n  " + "\n  ".join(lines)
    )


def describe(fields: Mapping[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in fields.items() if v not in ("", "null"))


# --------------------------------------------------------------------------- worker side


class WorkerNamespace:
    """A worker's identity: computed at ``register_kv_caches``, sent by handshake or in step reports."""

    def __init__(self, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", model: dict[str, str],
                 handshake: bool = True) -> None:
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self.model = model
        self.handshake = handshake  # False inside a MultiConnector: report through the step metadata
        self.identity: WorkerIdentity | None = None
        self.settled = False  # the scheduler has decided: stop reporting

    def prepare(self, config: TierCacheConfig, geometry: ChunkGeometry,
                kv_caches: Mapping[str, "torch.Tensor"]) -> tuple[TierCacheConfig, ChunkGeometry]:
        """Measure the registered layout; return the config and geometry the worker must key with."""
        attention = attention_identity_fields(self._vllm_config, self._kv_cache_config, kv_caches)
        config, geometry = with_identity(config, geometry, self.model, attention)
        self.identity = WorkerIdentity(parallel_rank(), dict(self.model), attention,
                                       namespace_fields(config, geometry), namespace_digest(config, geometry))
        logger.info("tiercache worker %s: attention identity %s (%s)", self.identity.rank,
                    identity_digest(attention), describe(attention))
        return config, geometry

    def handshake_metadata(self) -> WorkerIdentity | None:
        return self.identity if self.handshake else None

    def saw(self, meta: Any) -> None:
        """The step's connector metadata: has the scheduler settled the namespace?"""
        if isinstance(meta, TierCacheConnectorMetadata) and getattr(meta, "namespace_settled", True):
            self.settled = True

    def attach(self, report: TierCacheWorkerMetadata | None) -> TierCacheWorkerMetadata | None:
        """The step report, carrying this worker's identity while the scheduler still waits for it."""
        if self.settled or self.identity is None:
            return report
        report = report if report is not None else TierCacheWorkerMetadata()
        report.namespace_reports[self.identity.rank] = self.identity
        return report


# --------------------------------------------------------------------------- scheduler side


class SchedulerGate:
    """The scheduler half of the connector, built once the workers' identities are known.

    Until then (and for good after a mismatch found at run time) every lookup is
    a miss, no job is planned, and nothing raises. The connector facade calls it
    exactly as it calls :class:`TierCacheScheduler`.
    """

    def __init__(
        self,
        config: TierCacheConfig,
        geometry: ChunkGeometry,
        model: dict[str, str],
        attention_view: dict[str, str],
        make: Callable[[TierCacheConfig, ChunkGeometry], "TierCacheScheduler"],
    ) -> None:
        self.config = config
        self.geometry = geometry
        self.model = model
        self.attention_view = attention_view
        self._make = make
        self.block_size = geometry.engine.block_size
        self.bpc = geometry.blocks_per_chunk
        self.world_size = geometry.engine.world_size
        self.inner: TierCacheScheduler | None = None
        self.state = "waiting"  # waiting (for the handshake) | reports (fallback) | ready | disabled
        self._reports: dict[Rank, WorkerIdentity] = {}
        self._kv_cache_manager: Any = None

    # ------------------------------------------------------------ agreement
    def handshake(self, metadata: Mapping[Any, Any]) -> None:
        """vLLM's start-up handshake: every worker's metadata. Raises NamespaceMismatch."""
        workers = {rank: m for rank, m in metadata.items() if isinstance(m, WorkerIdentity)}
        if self.state != "waiting":
            return
        if len(workers) != self.world_size:
            logger.warning(
                "tiercache: the start-up handshake brought %d worker identities for %d workers "
                "(another connector's handshake?); checking the namespace at the first worker reports",
                len(workers), self.world_size)
            self._fall_back()
            return
        self._agree(workers)  # raises: vLLM refuses to start

    def _fall_back(self) -> None:
        self.state = "reports"
        logger.warning("tiercache: waiting for the workers' identities; every lookup is a miss until then")

    def _agree(self, workers: Mapping[Rank, WorkerIdentity]) -> None:
        lines = identity_mismatches(self.model, self.attention_view, workers)
        if lines:
            raise mismatch_error(lines)
        attention = workers[min(workers)].attention
        config, geometry = with_identity(self.config, self.geometry, self.model, attention)
        lines = namespace_mismatches(namespace_fields(config, geometry), namespace_digest(config, geometry), workers)
        if lines:
            raise mismatch_error(lines)
        inner = self._make(config, geometry)
        if self._kv_cache_manager is not None:
            inner.bind_kv_cache_manager(self._kv_cache_manager)
        self.inner, self.state = inner, "ready"
        logger.info(
            "tiercache: namespace %s agreed by %d worker(s); model identity %s (%s); attention identity %s (%s)",
            inner.keys.digest.hex(), len(workers), identity_digest(self.model), describe(self.model),
            identity_digest(attention), describe(attention))

    def _collect(self, reports: Mapping[Rank, WorkerIdentity]) -> None:
        """Fallback: the workers' identities from their step reports; decide once all are in."""
        self._reports.update(reports)
        if self.state != "reports" or len(self._reports) < self.world_size:
            return
        try:
            self._agree(self._reports)
        except Exception as exc:  # never raise into a running engine
            self.state = "disabled"
            logger.error("tiercache disabled for this engine (every lookup is a miss): %s", exc)

    def _usable(self) -> TierCacheScheduler | None:
        if self.state == "waiting":
            self._fall_back()  # vLLM is serving and no handshake came
        return self.inner if self.state == "ready" else None

    # --------------------------------------------------- the scheduler's API
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._kv_cache_manager = kv_cache_manager
        if self.inner is not None:
            self.inner.bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        inner = self._usable()
        return inner.get_num_new_matched_tokens(request, num_computed_tokens) if inner else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        inner = self._usable()
        if inner is not None:
            inner.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> TierCacheConnectorMetadata:
        inner = self._usable()
        if inner is not None:
            return inner.build_connector_meta(scheduler_output)
        return TierCacheConnectorMetadata(namespace_settled=self.state != "reports")

    def update_connector_output(self, worker_meta: TierCacheWorkerMetadata | None) -> None:
        if worker_meta is not None and worker_meta.namespace_reports:
            self._collect(worker_meta.namespace_reports)
        if self.inner is not None:
            self.inner.update_connector_output(worker_meta)

    def fallback_meta(self) -> TierCacheConnectorMetadata:
        """connector/guard.py's answer when ``build_connector_meta`` raised."""
        if self.inner is not None:
            return self.inner.fallback_meta()  # type: ignore[attr-defined]
        return TierCacheConnectorMetadata(namespace_settled=self.state != "reports")

    def fail_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """connector/guard.py's answer when ``update_state_after_alloc`` raised (no hit before start)."""
        if self.inner is not None:
            self.inner.fail_alloc(request, blocks, num_external_tokens)  # type: ignore[attr-defined]

    def request_finished(self, request: Any, block_ids: Any = None) -> tuple[bool, dict[str, Any] | None]:
        return self.inner.request_finished(request, block_ids) if self.inner is not None else (False, None)

    def has_pending_work(self) -> bool:
        return self.inner is not None and self.inner.has_pending_work()

    def take_events(self) -> list[Any]:
        return self.inner.take_events() if self.inner is not None else []

    def take_counters(self) -> dict[str, float]:
        return self.inner.take_counters() if self.inner is not None else {}

    def reset(self) -> bool:
        return self.inner.reset() if self.inner is not None else True

    def shutdown(self) -> None:
        if self.inner is not None:
            self.inner.shutdown()

    def __getattr__(self, name: str) -> Any:
        # Anything else (manager, keys, metrics, pd, ...) is the built scheduler's.
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(f"tiercache scheduler not started ({self.__dict__.get('state')}): no {name!r}")
        return getattr(inner, name)
