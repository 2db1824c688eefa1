"""The metric changes an engine's scheduler ships to vLLM's metrics process, as plain data.

vLLM carries a connector's stats from its engine core to the process that
serves ``/metrics`` (``KVConnectorStats.data``, msgpack-encoded), then calls
the connector's Prometheus hook with them (connector/prom_metrics.py). The
payload is a dict of three maps, each keyed by :func:`series_key` (a metric
name and its label values after the base labels, joined by ``\\x1f``)::

    {"counters": {key: increment}, "gauges": {key: value}, "observations": {key: [seconds, ...]}}

Counters add up, gauges carry their latest value, histogram observations are
listed (at most :data:`MAX_OBSERVATIONS` per series between two takes).
"""

from __future__ import annotations

from typing import Any

SEP = "\x1f"
MAX_OBSERVATIONS = 4096
KINDS = ("counters", "gauges", "observations")

Payload = dict[str, dict[str, Any]]


def series_key(name: str, values: tuple[str, ...]) -> str:
    return SEP.join((name, *values))


def split_key(key: str) -> tuple[str, tuple[str, ...]]:
    name, *values = key.split(SEP)
    return name, tuple(values)


def empty() -> Payload:
    return {kind: {} for kind in KINDS}


def is_empty(payload: Payload | None) -> bool:
    return not payload or not any(payload.get(kind) for kind in KINDS)


def merge(into: Payload, other: Payload) -> Payload:
    """Add ``other`` (a later payload) to ``into``, in place; returns ``into``."""
    counters, gauges, observations = (into.setdefault(kind, {}) for kind in KINDS)
    for key, n in (other.get("counters") or {}).items():
        counters[key] = counters.get(key, 0) + n
    gauges.update(other.get("gauges") or {})
    for key, seen in (other.get("observations") or {}).items():
        kept = observations.setdefault(key, [])
        kept.extend(seen[: max(MAX_OBSERVATIONS - len(kept), 0)])
    return into
