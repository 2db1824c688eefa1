"""tiercache's counters in vLLM's connector-stats envelope (logged by vLLM's stat loggers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


@dataclass
class TierCacheStats(KVConnectorStats):
    """Plain additive counters: hit_tokens, load/store bytes and seconds, failures, evictions."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in (other.data or {}).items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.data)
        for direction in ("load", "store"):
            secs = self.data.get(f"{direction}_secs", 0)
            if secs:
                out[f"{direction}_GBps"] = round(self.data.get(f"{direction}_bytes", 0) / secs / 1e9, 3)
        return out

    def is_empty(self) -> bool:
        return not self.data

    @classmethod
    def from_counters(cls, counters: dict[str, Any]) -> "TierCacheStats":
        return cls(data=dict(counters))
