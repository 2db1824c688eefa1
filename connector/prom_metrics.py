"""tiercache's metrics on vLLM's own /metrics, through vLLM's connector Prometheus hook.

vLLM's metrics process (the API server, or the ``LLM`` process) calls
``TierCacheConnector.build_prom_metrics`` once with its labels (``model_name``,
``engine``); every step's ``KVConnectorStats.data`` of each engine core then
reaches :meth:`TierCachePromMetrics.observe` with that engine's index. The
series are those of tiercache/metric_defs.py, labelled like vLLM's own plus
``cache_instance`` (``metrics.instance``), so data-parallel engines show one
series each on one port. :func:`engine_labels` gives the scheduler's recorder
(tiercache/metrics.py) the same labels for its optional standalone port.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import prometheus_client
from tiercache.connector.stats import PROM_KEY
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from tiercache.config.schema import TierCacheConfig, config_from_extra
from tiercache.metric_defs import (
    BASE_LABELS,
    BY_NAME,
    ENGINE_METRICS,
    INSTANCE_LABEL,
    instance_name,
)
from tiercache.metrics import make_family
from tiercache.metrics_payload import split_key

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)


def engine_labels(vllm_config: VllmConfig, config: TierCacheConfig) -> dict[str, str]:
    """TierCacheMetrics' labels in an engine core: vLLM's model_name and engine index, the instance."""
    model = vllm_config.model_config
    return {"model_name": str(model.served_model_name if model is not None else ""),
            "engine": str(vllm_config.parallel_config.data_parallel_rank),
            "instance": config.metrics.instance}


def _configured_instance(vllm_config: VllmConfig) -> str:
    transfer = vllm_config.kv_transfer_config
    try:
        return instance_name(config_from_extra(transfer.kv_connector_extra_config).metrics.instance)
    except Exception as exc:  # noqa: BLE001 - metrics never stop vLLM; the engine reports the config error
        logger.warning("tiercache metrics: config unreadable (%s); %s is the host name", exc, INSTANCE_LABEL)
        return instance_name(None)


def _unregister_ours(registry: prometheus_client.CollectorRegistry) -> None:
    """Drop tiercache families a previous stat logger of this process registered (vLLM does so for its own)."""
    for collector, names in list(registry._collector_to_names.items()):
        if any(name in BY_NAME or name.removesuffix("_total") in BY_NAME for name in names):
            registry.unregister(collector)


class TierCachePromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        if self._counter_cls is prometheus_client.Counter:  # (Ray's wrappers keep no such registry)
            _unregister_ours(prometheus_client.REGISTRY)
        classes = {"counter": self._counter_cls, "gauge": self._gauge_cls, "histogram": self._histogram_cls}
        self._instance = _configured_instance(vllm_config)
        if list(labelnames[:2]) != list(BASE_LABELS[:2]):
            logger.info("tiercache metrics: vLLM's labels are %s", labelnames)
        self._families = {d.name: make_family(d, [*labelnames, INSTANCE_LABEL, *d.labels], classes=classes)
                          for d in ENGINE_METRICS}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        payload = (transfer_stats_data or {}).get(PROM_KEY)
        if not payload:
            return
        base = [*self.per_engine_labelvalues.get(engine_idx, ["", str(engine_idx)]), self._instance]
        for key, n in (payload.get("counters") or {}).items():
            self._series(key, base, "counter", lambda s, n=n: s.inc(n))
        for key, value in (payload.get("gauges") or {}).items():
            self._series(key, base, "gauge", lambda s, value=value: s.set(value))
        for key, seen in (payload.get("observations") or {}).items():
            self._series(key, base, "histogram", lambda s, seen=seen: [s.observe(v) for v in seen])

    def _series(self, key: str, base: list[object], kind: str, apply: Any) -> None:
        name, values = split_key(key)
        d = BY_NAME.get(name)
        if d is None or d.kind != kind or len(values) != len(d.labels):
            logger.warning("tiercache metrics: unknown series %r (%s) skipped", key, kind)
            return
        apply(self._families[name].labels(*base, *values))
