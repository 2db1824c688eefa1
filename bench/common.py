"""Helpers shared by the benchmarks in bench/: machine description, JSON results, tables.

Every benchmark writes one JSON file under ``bench/results/`` (git-ignored) with
the same envelope: what ran (name, argv, options), where (:func:`machine_info`),
when, and its own ``results`` payload. Tables go to stdout through
:func:`print_table`. Nothing here knows about any particular benchmark.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from tiercache.testing.raw_nixl import post_transfer

RESULTS_DIR = Path(__file__).resolve().parent / "results"


# ------------------------------------------------------------------------------ machine
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def package_versions(names: Iterable[str]) -> dict[str, str | None]:
    """Installed version of each distribution (None when not installed)."""
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def machine_info(packages: Iterable[str] = ()) -> dict[str, Any]:
    """What the numbers were measured on: CPU, cores, memory, load, Python, packages."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "cpu": _cpu_model(),
        "usable_cpus": _usable_cpus(),
        "memory_gib": _memory_gib(),
        "load_average": [round(x, 2) for x in load] if load else None,
        "os": f"{platform.system()} {platform.release()}",
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "packages": package_versions(packages),
    }


def describe_machine(info: Mapping[str, Any]) -> str:
    """One line for a table's header."""
    load = info.get("load_average")
    load_s = f", load {load[0]}" if load else ""
    return (
        f"{info['cpu']} ({info['usable_cpus']} usable cpus{load_s}), "
        f"{info['python']}, {info['os']}"
    )


# ----------------------------------------------------------------------------- ceilings
def repeat_nixl_transfer(agent: Any, handle: Any | Sequence[Any], nbytes: int, seconds: float) -> float:
    """GB/s of prepared NIXL transfers of ``nbytes`` each, posted back to back for ``seconds`` (the raw ceiling).

    ``handle``: one handle, posted again and again, or several, posted in turn
    (different memory each time, so that a ceiling is not measured out of the CPU's cache).
    """
    handles = list(handle) if isinstance(handle, Sequence) else [handle]
    moved, turn, started = 0, 0, time.perf_counter()
    while True:
        handle = handles[turn % len(handles)]
        turn += 1
        post_transfer(agent, handle)
        moved += nbytes
        if time.perf_counter() - started >= seconds:
            return moved / (time.perf_counter() - started) / 1e9


# ------------------------------------------------------------------------------ results
def summarize(samples: Sequence[float]) -> dict[str, float]:
    """min / median / max / mean of repeated measurements."""
    return {
        "min": min(samples),
        "median": statistics.median(samples),
        "max": max(samples),
        "mean": statistics.fmean(samples),
    }


def write_result(
    name: str,
    results: Any,
    options: Mapping[str, Any] | None = None,
    machine: Mapping[str, Any] | None = None,
    directory: Path = RESULTS_DIR,
) -> Path:
    """Write ``<directory>/<name>.json`` with the common envelope; return its path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    doc = {
        "benchmark": name,
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "options": dict(options or {}),
        "machine": dict(machine) if machine is not None else machine_info(),
        "results": results,
    }
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=False, default=str) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


# ------------------------------------------------------------------------------- tables
def format_rate(value: float) -> str:
    """A rate with an SI suffix: 1234567 -> '1.23M'."""
    for threshold, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= threshold:
            return f"{value / threshold:.2f}{suffix}"
    return f"{value:.1f}"


def format_table(
    headers: Sequence[str], rows: Iterable[Sequence[Any]], title: str | None = None
) -> str:
    """A plain-text table; text columns align left, numbers right."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(values: Sequence[str], numeric: Sequence[bool]) -> str:
        parts = [v.rjust(w) if n else v.ljust(w) for v, w, n in zip(values, widths, numeric)]
        return "  ".join(parts).rstrip()

    numeric_cols = [
        bool(cells) and all(_looks_numeric(row[i]) for row in cells) for i in range(len(headers))
    ]
    out = [title] if title else []
    out.append(line(list(headers), numeric_cols))
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(row, numeric_cols) for row in cells)
    return "\n".join(out)


def print_table(
    headers: Sequence[str], rows: Iterable[Sequence[Any]], title: str | None = None
) -> None:
    print(format_table(headers, rows, title))


def _looks_numeric(text: str) -> bool:
    stripped = text.rstrip("kMGx%s").lstrip("+-")
    return stripped.replace(".", "", 1).isdigit()
