"""What ``tiercache inspect engine`` shows: one engine's tiers, usage, hit rate and evictions.

:class:`EngineSnapshot` is built from the ``tiercache_*`` samples of one
scrape (:mod:`tiercache.cli.prom_scrape`); :func:`render` prints it, and with
the previous snapshot (``--watch``) adds what changed since: hit and lookup
tokens and evictions in the last interval. Labels other than ``tier`` (vLLM's
``engine`` and ``model_name``, tiercache's ``cache_instance``) are summed
over, so data-parallel engines behind one ``/metrics`` show as one; the
engines and instances seen are listed.

The metrics read, named by tiercache/metric_defs.py: lookup tokens, hit tokens,
used and capacity bytes and evicted chunks per tier, faults per reason and
failed chunks per op. Hit rate is hit tokens / lookup tokens; a tier's share
is its hit tokens / lookup tokens (the shares add up to the hit rate).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tiercache.cli.prom_scrape import Sample
from tiercache.config.sizes import format_size
from tiercache.metric_defs import ENGINE_METRICS, INSTANCE_LABEL

NAME = {d.attr: d.name for d in ENGINE_METRICS}  # lookup_tokens -> tiercache_lookup_tokens, ...
PER_TIER = {NAME["hit_tokens"]: "hit_tokens", NAME["capacity_bytes"]: "capacity_bytes",
            NAME["used_bytes"]: "used_bytes", NAME["evictions"]: "evictions"}


@dataclass
class TierRow:
    name: str
    capacity_bytes: float = 0.0
    used_bytes: float = 0.0
    hit_tokens: float = 0.0
    evictions: float = 0.0


@dataclass
class EngineSnapshot:
    url: str
    taken_at: float  # time.time()
    lookup_tokens: float = 0.0
    tiers: list[TierRow] = field(default_factory=list)
    faults: dict[str, float] = field(default_factory=dict)
    failed_chunks: dict[str, float] = field(default_factory=dict)
    engines: list[str] = field(default_factory=list)
    instances: list[str] = field(default_factory=list)

    @property
    def hit_tokens(self) -> float:
        return sum(t.hit_tokens for t in self.tiers)

    def tier(self, name: str) -> TierRow:
        for row in self.tiers:
            if row.name == name:
                return row
        row = TierRow(name)
        self.tiers.append(row)
        return row

    def as_dict(self) -> dict[str, Any]:
        return {
            "url": self.url, "taken_at": self.taken_at, "engines": self.engines, "instances": self.instances,
            "lookup_tokens": self.lookup_tokens, "hit_tokens": self.hit_tokens,
            "hit_rate": ratio(self.hit_tokens, self.lookup_tokens),
            "tiers": [vars(t) for t in self.tiers], "faults": self.faults, "failed_chunks": self.failed_chunks,
        }


def ratio(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def snapshot(url: str, samples: Iterable[Sample], taken_at: float | None = None) -> EngineSnapshot:
    """Sum the samples into one snapshot (tiers in the order the page lists them)."""
    snap = EngineSnapshot(url, time.time() if taken_at is None else taken_at)
    lookups_by_tier: dict[str, float] = {}
    engines: set[str] = set()
    instances: set[str] = set()
    for s in samples:
        tier = s.labels.get("tier")
        engines.update([s.labels["engine"]] if "engine" in s.labels else [])
        instances.update([s.labels[INSTANCE_LABEL]] if INSTANCE_LABEL in s.labels else [])
        if s.base == NAME["lookup_tokens"]:
            lookups_by_tier[tier or ""] = lookups_by_tier.get(tier or "", 0.0) + s.value
        elif tier is not None and s.base in PER_TIER:
            row = snap.tier(tier)
            attr = PER_TIER[s.base]
            setattr(row, attr, getattr(row, attr) + s.value)
        elif s.base == NAME["faults"]:
            reason = s.labels.get("reason", "?")
            snap.faults[reason] = snap.faults.get(reason, 0.0) + s.value
        elif s.base == NAME["failures"]:
            op = s.labels.get("op", "?")
            snap.failed_chunks[op] = snap.failed_chunks.get(op, 0.0) + s.value
    # Without a tier label: every lookup. Per tier: the top tier is asked for every token.
    snap.lookup_tokens = lookups_by_tier.get("", max(lookups_by_tier.values(), default=0.0))
    snap.engines, snap.instances = sorted(engines), sorted(instances)
    return snap


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def _n(value: float) -> str:
    return f"{int(value):,}"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _nonzero(counts: dict[str, float]) -> str:
    shown = [f"{name} {_n(v)}" for name, v in sorted(counts.items()) if v]
    return ", ".join(shown) or "none"


def render(snap: EngineSnapshot, previous: EngineSnapshot | None = None) -> str:
    """The report; with ``previous``, what changed since it (hits, lookups, evictions per interval)."""
    stamp = time.strftime("%H:%M:%S", time.localtime(snap.taken_at))
    engines = f", engines: {', '.join(snap.engines)}" if snap.engines else ""
    engines += f", instance: {', '.join(snap.instances)}" if snap.instances else ""
    lines = [
        f"tiercache at {snap.url} ({stamp}{engines})",
        (f"lookups: {_n(snap.lookup_tokens)} tokens; hits: {_n(snap.hit_tokens)} tokens, hit rate "
         f"{_pct(snap.hit_tokens, snap.lookup_tokens)} (since the engine started)"),
    ]
    interval = snap.taken_at - previous.taken_at if previous is not None else 0.0
    if previous is not None:
        d_lookup = snap.lookup_tokens - previous.lookup_tokens
        d_hit = snap.hit_tokens - previous.hit_tokens
        lines.append(f"last {interval:.0f} s: lookups {_n(d_lookup)} tokens, hits {_n(d_hit)} tokens, "
                     f"hit rate {_pct(d_hit, d_lookup)}")
    header = ["tier", "capacity", "used", "use%", "hit tokens", "share of lookups", "evictions"]
    if previous is not None:
        header += [f"hits last {interval:.0f}s", f"evictions last {interval:.0f}s"]
    rows = [header]
    for t in snap.tiers:
        row = [t.name, format_size(int(t.capacity_bytes)), format_size(int(t.used_bytes)),
               _pct(t.used_bytes, t.capacity_bytes), _n(t.hit_tokens), _pct(t.hit_tokens, snap.lookup_tokens),
               _n(t.evictions)]
        if previous is not None:
            before = next((r for r in previous.tiers if r.name == t.name), TierRow(t.name))
            row += [_n(t.hit_tokens - before.hit_tokens), _n(t.evictions - before.evictions)]
        rows.append(row)
    lines.append("tiers:")
    lines.append(_table(rows) if len(rows) > 1 else "  (none reported yet)")
    lines.append(f"faults contained (each a miss or a recompute): {_nonzero(snap.faults)}; "
                 f"failed chunks: {_nonzero(snap.failed_chunks)}")
    return "\n".join(lines)
