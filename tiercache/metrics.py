"""Prometheus collectors for tiercache, in a registry of their own.

One :class:`TierCacheMetrics` per engine, living in the scheduler process (the
manager is there, and workers report bytes and seconds back with their job
results). ``serve(port)`` exposes them on ``/metrics``; the same numbers are
also returned as plain counters through the connector's stats.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

logger = logging.getLogger(__name__)

_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class TierCacheMetrics:
    def __init__(self, engine_label: str = "0") -> None:
        self.registry = CollectorRegistry()
        labels = ["engine"]
        self._engine = engine_label
        self.lookup_tokens = Counter(
            "tiercache_lookup_tokens", "Prompt tokens looked up in tiercache.", labels, registry=self.registry
        )
        self.hit_tokens = Counter(
            "tiercache_hit_tokens", "Tokens served from a tier.", labels + ["tier"], registry=self.registry
        )
        self.transfer_bytes = Counter(
            "tiercache_transfer_bytes", "Bytes moved, by path.", labels + ["path"], registry=self.registry
        )
        self.transfer_seconds = Histogram(
            "tiercache_transfer_seconds",
            "Seconds per transfer job, by path (peer_host_to_device / peer_device_to_device: a P/D "
            "consumer's NIXL READs alone, descriptors to tags checked, from a producer's host slots / KV "
            "blocks; peer_data_read: their data READs alone).",
            labels + ["path"],
            buckets=_SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.evictions = Counter(
            "tiercache_evicted_chunks", "Chunks evicted, by tier.", labels + ["tier"], registry=self.registry
        )
        self.failures = Counter(
            "tiercache_failed_chunks",
            "Chunks whose load or store failed (loads are recomputed).",
            labels + ["op"],
            registry=self.registry,
        )
        self.used_bytes = Gauge(
            "tiercache_tier_used_bytes", "Bytes held by a tier.", labels + ["tier"], registry=self.registry
        )
        self.capacity_bytes = Gauge(
            "tiercache_tier_capacity_bytes", "Byte budget of a tier.", labels + ["tier"], registry=self.registry
        )
        self.pd_handoffs = Counter(
            "tiercache_pd_handoffs",
            "P/D hand-offs by outcome: offered (producer), read / expired (producer), "
            "refused (consumer: incompatible or malformed), untrusted (consumer: a producer "
            "outside its trust).",
            labels + ["outcome"],
            registry=self.registry,
        )
        self.pd_held_chunks = Gauge(
            "tiercache_pd_held_chunks", "Producer: chunks held for consumers that have not read them yet.",
            labels, registry=self.registry,
        )
        self.host_pinned_bytes = Gauge(
            "tiercache_host_pinned_bytes",
            "Bytes of the host tier actually page-locked for the GPU (cudaHostRegister, verified with "
            "is_pinned), summed over the engine's workers; 0 when pinning was not wanted (no CUDA) or failed, "
            "in which case every copy between the host tier and the GPU is synchronous (see the worker's "
            "warning).",
            labels, registry=self.registry,
        )
        self.faults = Counter(
            "tiercache_faults",
            "Faults tiercache contained (each a miss or a recompute, never an error in vLLM), by reason: "
            "load_deadline, store_deadline, tier_stalled, backend_exception, connector_exception, "
            "reader_exception, delete_dropped, lookup_timeout, integrity (tiercache/faults.py).",
            labels + ["reason"],
            registry=self.registry,
        )

    def count_faults(self, counts: dict[str, int]) -> None:
        """Add fault counts by reason (from :func:`tiercache.faults.take` or a worker's report)."""
        for reason, n in counts.items():
            if n:
                self.faults.labels(self._engine, reason).inc(n)

    def observe_transfer(self, path: str, num_bytes: int, secs: float) -> None:
        self.transfer_bytes.labels(self._engine, path).inc(num_bytes)
        self.transfer_seconds.labels(self._engine, path).observe(secs)

    def label(self, metric: Counter | Gauge, *values: str) -> Counter | Gauge:
        return metric.labels(self._engine, *values)

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        """Serve /metrics over HTTP from a daemon thread."""
        start_http_server(port, addr=host, registry=self.registry)
        logger.info("tiercache metrics on http://%s:%d/metrics", host, port)
