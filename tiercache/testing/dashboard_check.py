"""Checks of the Grafana dashboard (dashboards/tiercache.json) against the metrics the code registers.

* :func:`dashboard_queries`: every PromQL expression of the dashboard (panel
  targets and template-variable queries);
* :func:`metric_names_in`: the tiercache metric names one expression uses;
* :func:`registered_names`: every sample name an engine's recorder
  (tiercache/metrics.py) and the cache server (tiercache/server/metrics.py)
  can expose, read from their registries;
* :func:`for_prometheus`: an expression with Grafana's variables filled in, for
  Prometheus' own query API (the live check in tests/e2e).
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any

from prometheus_client import CollectorRegistry

DASHBOARD = pathlib.Path(__file__).resolve().parents[2] / "dashboards" / "tiercache.json"
_NAME = re.compile(r"\b(?:tiercache_|vllm:)[A-Za-z0-9_:]*")
_LABEL_VALUES = re.compile(r"^label_values\((?P<expr>.*),\s*\w+\)$")
_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
             "gauge": ("",), "info": ("_info",)}


def dashboard_queries(path: pathlib.Path = DASHBOARD) -> list[str]:
    board: dict[str, Any] = json.loads(path.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    for var in board.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            match = _LABEL_VALUES.match(var["query"])
            exprs.append(match.group("expr") if match else var["query"])
    return exprs


def metric_names_in(expr: str) -> set[str]:
    return set(_NAME.findall(expr))


def exposed_names(registry: CollectorRegistry) -> set[str]:
    """The sample names of every family in ``registry``, labelled children or not."""
    return {family.name + suffix for family in registry.collect() for suffix in _SUFFIXES[family.type]}


def registered_names() -> set[str]:
    from tiercache.metrics import TierCacheMetrics
    from tiercache.server.metrics import ServerMetrics

    return exposed_names(TierCacheMetrics().registry) | exposed_names(ServerMetrics().registry)


def unknown_names(exprs: list[str], known: set[str]) -> dict[str, set[str]]:
    """Each expression that names a metric outside ``known``, with those names."""
    return {e: bad for e in exprs if (bad := metric_names_in(e) - known)}


def for_prometheus(expr: str, rate_interval: str = "1m") -> str:
    """Grafana's ``$__rate_interval`` and template variables (``=~"$x"``: any value) filled in."""
    return re.sub(r'"\$\w+"', '".*"', expr.replace("$__rate_interval", rate_interval))
