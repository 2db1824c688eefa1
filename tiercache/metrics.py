"""The scheduler's metric recorder: every change goes to vLLM's /metrics, and to an optional port.

One :class:`TierCacheMetrics` per engine, living in the scheduler process (the
manager is there, and workers report bytes and seconds back with their job
results). Each ``inc`` / ``set`` / ``observe`` is

* kept as a change for :meth:`take_payload` (tiercache/metrics_payload.py),
  which the connector hands to vLLM each step (``get_kv_connector_stats``);
  vLLM's metrics process puts it on its own ``/metrics`` with its labels
  (connector/prom_metrics.py): the default, and what works with several engines;
* applied to a registry of its own, which :meth:`serve` exposes on
  ``metrics.port`` when that is set (one engine per port).

The metrics themselves are listed in tiercache/metric_defs.py.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from tiercache.metric_defs import (
    BASE_LABELS,
    BY_NAME,
    ENGINE_METRICS,
    SECONDS_BUCKETS,
    MetricDef,
    instance_name,
)
from tiercache.metrics_payload import MAX_OBSERVATIONS, Payload, empty, series_key

logger = logging.getLogger(__name__)

_D = {d.attr: d for d in ENGINE_METRICS}


def make_family(d: MetricDef, labelnames: list[str], registry: CollectorRegistry | None = None,
                classes: dict[str, type] | None = None) -> Counter | Gauge | Histogram:
    """The prometheus_client family for ``d`` (``classes``: vLLM's metric types, by kind)."""
    cls = (classes or {"counter": Counter, "gauge": Gauge, "histogram": Histogram})[d.kind]
    extra: dict[str, object] = {"registry": registry} if registry is not None else {}
    if d.kind == "histogram":
        extra["buckets"] = list(SECONDS_BUCKETS)
    if d.kind == "gauge":
        extra["multiprocess_mode"] = "mostrecent"  # vLLM's API servers may share a multiprocess dir
    return cls(name=d.name, documentation=d.doc, labelnames=labelnames, **extra)


class _Series:
    """One labelled series: what the call sites ``inc``, ``set`` or ``observe``."""

    __slots__ = ("_child", "_def", "_key", "_owner")

    def __init__(self, owner: TierCacheMetrics, d: MetricDef, values: tuple[str, ...]) -> None:
        self._owner, self._def = owner, d
        self._key = series_key(d.name, values)
        self._child = owner.families[d.name].labels(*owner.base, *values)

    def inc(self, amount: float = 1.0) -> None:
        if self._def.kind == "gauge":
            self.set(self._owner.gauge_values.get(self._key, 0.0) + amount)
            return
        self._child.inc(amount)
        if amount:
            counters = self._owner.pending["counters"]
            counters[self._key] = counters.get(self._key, 0) + amount

    def set(self, value: float) -> None:
        self._child.set(value)
        if self._owner.gauge_values.get(self._key) != value:
            self._owner.gauge_values[self._key] = value
            self._owner.pending["gauges"][self._key] = value

    def observe(self, value: float) -> None:
        self._child.observe(value)
        seen = self._owner.pending["observations"].setdefault(self._key, [])
        if len(seen) < MAX_OBSERVATIONS:
            seen.append(value)


class TierCacheMetrics:
    """An engine's tiercache metrics; ``engine`` and ``model_name`` as vLLM labels its own."""

    lookup_tokens = _D["lookup_tokens"]
    hit_tokens = _D["hit_tokens"]
    transfer_bytes = _D["transfer_bytes"]
    transfer_seconds = _D["transfer_seconds"]
    evictions = _D["evictions"]
    store_refused = _D["store_refused"]
    lookup_waits = _D["lookup_waits"]
    failures = _D["failures"]
    used_bytes = _D["used_bytes"]
    capacity_bytes = _D["capacity_bytes"]
    pd_handoffs = _D["pd_handoffs"]
    pd_held_chunks = _D["pd_held_chunks"]
    host_pinned_bytes = _D["host_pinned_bytes"]
    faults = _D["faults"]

    def __init__(self, engine: str = "0", model_name: str = "", instance: str | None = None) -> None:
        self.registry = CollectorRegistry()
        self.base = (model_name, engine, instance_name(instance))
        self.families = {d.name: make_family(d, [*BASE_LABELS, *d.labels], self.registry)
                         for d in ENGINE_METRICS}
        self.pending: Payload = empty()
        self.gauge_values: dict[str, float] = {}

    def label(self, metric: MetricDef, *values: str) -> _Series:
        assert BY_NAME.get(metric.name) is metric, metric
        return _Series(self, metric, tuple(str(v) for v in values))

    def count_faults(self, counts: dict[str, int]) -> None:
        """Add fault counts by reason (from :func:`tiercache.faults.take` or a worker's report)."""
        for reason, n in counts.items():
            if n:
                self.label(self.faults, reason).inc(n)

    def observe_transfer(self, path: str, num_bytes: int, secs: float) -> None:
        self.label(self.transfer_bytes, path).inc(num_bytes)
        self.label(self.transfer_seconds, path).observe(secs)

    def sample(self, name: str, **labels: str) -> float | None:
        """A sample of this engine's registry, its base labels implied (for tools and tests)."""
        return self.registry.get_sample_value(name, {**dict(zip(BASE_LABELS, self.base)), **labels})

    def take_payload(self) -> Payload:
        """The changes since the last take (tiercache/metrics_payload.py), for vLLM's /metrics."""
        payload, self.pending = self.pending, empty()
        return payload

    def serve(self, port: int, host: str = "127.0.0.1") -> bool:
        """Serve this engine's registry on /metrics from a daemon thread; False if the port is taken."""
        try:
            start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:  # e.g. a second data-parallel engine on the same port
            logger.warning("tiercache: metrics.port %d on %s not served (%s); the metrics are on vLLM's "
                           "/metrics", port, host, exc)
            return False
        logger.info("tiercache metrics on http://%s:%d/metrics", host, port)
        return True
