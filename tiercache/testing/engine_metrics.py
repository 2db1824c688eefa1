"""Metric snapshots an engine runner records after each round (tiercache/testing/engine_runner.py).

* :func:`cache_metrics`: the cumulative ``LLM.get_metrics()`` entries whose name
  mentions the KV connector, the prefix cache, external hits or cached prompt
  tokens, keyed ``name{label=value,...}``;
* :func:`scrape_tiercache_metrics`: the ``tiercache_*`` samples of a connector's
  own Prometheus ``/metrics`` port.

Both are best effort: a failure is recorded, never raised into a test's engine.
"""

from __future__ import annotations

from typing import Any

METRIC_NAME_PARTS = (
    "kv_connector", "prefix_cache", "external", "prompt_tokens_cached", "num_preemptions",
    "prompt_tokens_by_source", "nixl", "kv_cache_usage",
)
IGNORED_METRIC_LABELS = ("model_name", "engine")


def _metric_value(metric: Any) -> Any:
    if hasattr(metric, "values"):
        return list(metric.values)
    if hasattr(metric, "buckets"):
        return {"count": metric.count, "sum": metric.sum}
    return getattr(metric, "value", None)


def _metric_key(metric: Any) -> str:
    labels = {k: v for k, v in (getattr(metric, "labels", None) or {}).items()
              if k not in IGNORED_METRIC_LABELS}
    if not labels:
        return metric.name
    return metric.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"


def cache_metrics(llm: Any) -> dict[str, Any]:
    """Best-effort snapshot of the connector / prefix-cache metrics."""
    try:
        return {
            _metric_key(m): _metric_value(m)
            for m in llm.get_metrics()
            if any(part in m.name for part in METRIC_NAME_PARTS)
        }
    except Exception as exc:  # noqa: BLE001 - metrics are optional diagnostics
        return {"error": f"{type(exc).__name__}: {exc}"}


def scrape_tiercache_metrics(url: str | None) -> dict[str, float]:
    """tiercache_* samples from a Prometheus /metrics URL (the connector's own port)."""
    if not url:
        return {}
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
    except OSError as exc:
        return {"error": str(exc)}  # type: ignore[dict-item]
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("tiercache_") and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
