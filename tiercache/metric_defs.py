"""The catalogue of an engine's tiercache metrics: names, kinds, help texts and labels.

One table, read by three consumers: :class:`tiercache.metrics.TierCacheMetrics`
(the scheduler's recorder and its optional standalone registry),
``tiercache.connector.prom_metrics`` (the same series on vLLM's own ``/metrics``)
and the dashboard test (every query of ``dashboards/tiercache.json`` names one
of these). Every series carries :data:`BASE_LABELS` first: vLLM's own
``model_name`` and ``engine`` (the data-parallel engine index), then
``cache_instance`` (``metrics.instance``; :func:`instance_name`).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Literal

Kind = Literal["counter", "gauge", "histogram"]

INSTANCE_LABEL = "cache_instance"
BASE_LABELS: tuple[str, ...] = ("model_name", "engine", INSTANCE_LABEL)
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


@dataclass(frozen=True)
class MetricDef:
    """One metric family; ``labels`` come after :data:`BASE_LABELS`."""

    attr: str  # the TierCacheMetrics attribute that names it
    name: str  # without the _total suffix prometheus_client adds to counters
    kind: Kind
    doc: str
    labels: tuple[str, ...] = ()

    def exposed_names(self) -> tuple[str, ...]:
        """The sample names a scrape shows for this family."""
        if self.kind == "counter":
            return (f"{self.name}_total", f"{self.name}_created")
        if self.kind == "histogram":
            return tuple(f"{self.name}_{s}" for s in ("bucket", "count", "sum", "created"))
        return (self.name,)


ENGINE_METRICS: tuple[MetricDef, ...] = (
    MetricDef("lookup_tokens", "tiercache_lookup_tokens", "counter",
              "Prompt tokens tiercache was asked for: a scheduled request's tokens beyond vLLM's own "
              "prefix-cache hit (the denominator of the hit rate)."),
    MetricDef("hit_tokens", "tiercache_hit_tokens", "counter", "Tokens loaded from a tier, by tier.", ("tier",)),
    MetricDef("transfer_bytes", "tiercache_transfer_bytes", "counter", "Bytes moved, by path.", ("path",)),
    MetricDef("transfer_seconds", "tiercache_transfer_seconds", "histogram",
              "Seconds per transfer job, by path (peer_host_to_device / peer_device_to_device: a P/D "
              "consumer's NIXL READs alone, descriptors to tags checked, from a producer's host slots / KV "
              "blocks; peer_data_read: their data READs alone).", ("path",)),
    MetricDef("evictions", "tiercache_evicted_chunks", "counter", "Chunks evicted, by tier.", ("tier",)),
    MetricDef("store_refused", "tiercache_store_refused_chunks", "counter",
              "Chunks a tier refused to store, by tier: every slot was being written or pinned (the host tier "
              "under many concurrent loads and stores, or a lower tier behind on demotions). The host tier's "
              "refusals are offered again next step while their request runs, each time counted.", ("tier",)),
    MetricDef("lookup_waits", "tiercache_lookup_waits", "counter",
              "Lookups answered 'ask again next step' (vLLM schedules the request a step later), by reason: "
              "shared_tier_pending (a shared tier's answer not back yet; up to deadlines.lookup_s), "
              "chunk_being_written (the chunk after the hit is being written into the host tier), "
              "no_staging_room (the host tier cannot stage the hit's lower-tier chunks this step); these two "
              "hold a request three times, then within deadlines.lookup_s of its first hold.",
              ("reason",)),
    MetricDef("failures", "tiercache_failed_chunks", "counter",
              "Chunks whose load or store failed (loads are recomputed).", ("op",)),
    MetricDef("used_bytes", "tiercache_tier_used_bytes", "gauge", "Bytes held by a tier.", ("tier",)),
    MetricDef("capacity_bytes", "tiercache_tier_capacity_bytes", "gauge", "Byte budget of a tier.", ("tier",)),
    MetricDef("pd_handoffs", "tiercache_pd_handoffs", "counter",
              "P/D hand-offs by outcome: offered (producer), read / expired (producer), refused (consumer: "
              "incompatible or malformed), untrusted (consumer: a producer outside its trust).", ("outcome",)),
    MetricDef("pd_held_chunks", "tiercache_pd_held_chunks", "gauge",
              "Producer: chunks held for consumers that have not read them yet."),
    MetricDef("host_pinned_bytes", "tiercache_host_pinned_bytes", "gauge",
              "Bytes of the host tier actually page-locked for the GPU (cudaHostRegister, verified with "
              "is_pinned), summed over the engine's workers; 0 when pinning was not wanted (no CUDA) or "
              "failed, in which case every copy between the host tier and the GPU is synchronous (see the "
              "worker's warning)."),
    MetricDef("faults", "tiercache_faults", "counter",
              "Faults tiercache contained (each a miss or a recompute, never an error in vLLM), by reason: "
              "load_deadline, store_deadline, tier_stalled, backend_exception, connector_exception, "
              "reader_exception, delete_dropped, lookup_timeout, integrity, tier_read_failed, "
              "window_block_not_stored, staging_no_slot (tiercache/faults.py).",
              ("reason",)),
)

BY_NAME = {d.name: d for d in ENGINE_METRICS}


def instance_name(configured: str | None) -> str:
    """The ``cache_instance`` label: ``metrics.instance`` when set, else this host's name.

    Stable across restarts (unlike vLLM's per-start ``engine_id``); set it when
    the host name is not (a pod) or several vLLM servers share a host.
    """
    return configured or socket.gethostname()


def exposed_metric_names() -> frozenset[str]:
    """Every sample name an engine's tiercache metrics can show on a scrape."""
    return frozenset(n for d in ENGINE_METRICS for n in d.exposed_names())
