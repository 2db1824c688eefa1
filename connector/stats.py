"""tiercache's stats in vLLM's connector-stats envelope: a log line, and the metrics for /metrics.

``data`` holds plain additive counters (hit_tokens, load/store bytes and
seconds, failures, evictions), which vLLM's log line shows (``reduce``), and,
under :data:`PROM_KEY`, the metric changes for vLLM's ``/metrics``
(tiercache/metrics_payload.py; connector/prom_metrics.py puts them there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from tiercache import metrics_payload

PROM_KEY = "prom"


@dataclass
class TierCacheStats(KVConnectorStats):
    """Plain additive counters, plus the metric changes under ``data["prom"]``."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in (other.data or {}).items():
            if name == PROM_KEY:
                metrics_payload.merge(self.data.setdefault(PROM_KEY, metrics_payload.empty()), value)
            else:
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: v for k, v in self.data.items() if k != PROM_KEY}
        for direction in ("load", "store"):
            secs = self.data.get(f"{direction}_secs", 0)
            if secs:
                out[f"{direction}_GBps"] = round(self.data.get(f"{direction}_bytes", 0) / secs / 1e9, 3)
        return out

    def is_empty(self) -> bool:
        return not self.data

    @classmethod
    def from_counters(cls, counters: dict[str, Any], prom: metrics_payload.Payload | None = None) -> TierCacheStats:
        data = dict(counters)
        if not metrics_payload.is_empty(prom):
            data[PROM_KEY] = prom
        return cls(data=data)
