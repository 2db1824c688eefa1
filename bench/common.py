"""What the benchmarks in bench/ share: options, sizes, machine description, JSON results, tables.

Every benchmark is a module ``bench/<name>.py`` with a ``main(argv)``, run as
``python -m bench <name>`` (bench/__main__.py) or ``python bench/<name>.py``.
Its options come from a :class:`BenchParser`, which gives every benchmark the
same ``--help`` (what it measures, the ceiling it compares to, examples, the
size notation) and the same shared options: ``--out`` (the results name),
``--no-progress`` and ``--quick`` (a short smoke run). Sizes on the command
line are parsed by :func:`tiercache.config.sizes.parse_size`, as in the YAML
configs: ``KiB``/``MiB``/``GiB`` are powers of 1024, ``K``/``M``/``G`` powers
of 1000.

Every benchmark writes one JSON file under ``bench/results/`` (git-ignored) with
the same envelope: what ran (name, argv, options), where (:func:`machine_info`),
when, and its own ``results`` payload. Tables go to stdout through
:func:`print_table`, which also keeps them (:data:`TABLES`) so that writing the
JSON draws them into a PNG beside it (bench/table_plot.py; ``--no-plot``
skips it, and without matplotlib one line says so). Nothing here knows about
any particular benchmark.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import textwrap
import time
from collections.abc import Iterable, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tiercache.config.sizes import parse_size
from tiercache.testing.raw_nixl import post_transfer

RESULTS_DIR = Path(__file__).resolve().parent / "results"
TABLES: list[tuple[str | None, list[str], list[list[Any]]]] = []  # what print_table printed, to draw
SIZE_NOTE = (
    "Sizes: bytes, or a number and a unit: KiB, MiB, GiB are powers of 1024 (64KiB = 65536), "
    "K, M, G (or KB, MB, GB) powers of 1000 (64K = 64000), as in tiercache's configs."
)


# -------------------------------------------------------------------------------- sizes
def size_arg(text: str) -> int:
    """An argparse ``type``: a size such as ``"256KiB"`` in bytes (:func:`parse_size`)."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def size_list(text: str) -> list[int]:
    """An argparse ``type``: comma-separated sizes, ``"256KiB,1MiB"`` -> ``[262144, 1048576]``."""
    return [size_arg(part) for part in text.split(",") if part.strip()]


def size_label(n: int) -> str:
    """A table's short size label that :func:`parse_size` reads back as ``n``: 262144 -> ``"256KiB"``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def kib_label(n: int) -> str:
    """A table's size label in whole KiB: 1048576 -> ``"1024 KiB"``."""
    return f"{n >> 10} KiB"


# ------------------------------------------------------------------------------ options
class BenchParser(argparse.ArgumentParser):
    """The argument parser of one benchmark: the same help layout and shared options for all.

    ``--help`` shows the module docstring (what is measured), then the ceiling
    the figures are compared to, examples (both ways of running it), the size
    notation where the benchmark takes sizes, and where the results go.
    Shared options, each only where the benchmark has a use for it:
    ``--out`` (``out``: the default results name), ``--no-progress``
    (``progress``), ``--quick`` (``quick``: the option values of a short
    smoke run, applied as defaults, so options given beside it still win).
    """

    def __init__(
        self,
        name: str,
        doc: str | None,
        *,
        ceiling: str,
        examples: Sequence[str] = (),
        out: str | None = None,
        progress: bool = True,
        quick: Mapping[str, Any] | None = None,
        sizes: bool = False,
    ) -> None:
        self.quick = dict(quick or {})
        if self.quick and out is not None:
            self.quick.setdefault("out", f"{out}_quick")
        lines = [*_wrap(f"Ceiling: {ceiling}"), "", "Examples:"]
        lines += [f"  python -m bench {name} {example}".rstrip() for example in examples or ("",)]
        if self.quick:
            lines.append(f"  python -m bench {name} --quick")
        lines.append(f"  python bench/{name}.py --help    (the same main, run as a script)")
        if sizes:
            lines += ["", *_wrap(SIZE_NOTE)]
        if out is not None:
            lines += ["", (f"Results: bench/results/<--out>.json (default {out}.json), its tables drawn "
                       "beside it as <--out>.png.")]
        super().__init__(
            prog=f"python -m bench {name}",
            description=doc,
            epilog="\n".join(lines),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        shared = self.add_argument_group("shared options")  # listed after the benchmark's own
        if out is not None:
            shared.add_argument(
                "--out", default=out, help="result name under bench/results/ (default %(default)s)"
            )
            shared.add_argument("--no-plot", action="store_true",
                                help="write no PNG of the tables beside the JSON (drawn with matplotlib)")
        if progress:
            shared.add_argument("--no-progress", action="store_true", help="no progress bars")
        if self.quick:
            shown = " ".join(_as_option(dest, value) for dest, value in self.quick.items())
            shared.add_argument("--quick", action="store_true", help=f"a short smoke run: {shown}")

    def add_sizes(self, default: str, help: str, flag: str = "--sizes") -> None:
        """A comma-separated list of sizes (``args.<flag>`` is a list of ints)."""
        self.add_argument(flag, type=size_list, default=default, help=f"{help} (default {default})")

    def add_size(self, flag: str, default: str, help: str) -> None:
        """One size (``args.<flag>`` is an int)."""
        self.add_argument(flag, type=size_arg, default=default, help=f"{help} (default {default})")

    def add_repeat(self, default: int, help: str = "measurements per cell; medians shown") -> None:
        self.add_argument("--repeat", type=int, default=default, help=f"{help} (default {default})")

    def add_seed(self) -> None:
        self.add_argument("--seed", type=int, default=0, help="random seed (default 0)")

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed = super().parse_args(args, namespace)
        if self.quick and getattr(parsed, "quick", False):
            # Again with --quick's values as defaults (options given beside it still win);
            # the defaults are put back afterwards, so the parser can be used again.
            saved = [(action, action.default) for action in self._actions]
            saved_defaults = dict(self._defaults)
            self.set_defaults(**self.quick)
            try:
                parsed = super().parse_args(args, namespace)
            finally:
                for action, default in saved:
                    action.default = default
                self._defaults = saved_defaults
        return parsed


def _wrap(text: str) -> list[str]:
    return textwrap.wrap(text, width=79, subsequent_indent="  ", break_on_hyphens=False)


def _as_option(dest: str, value: Any) -> str:
    flag = "--" + dest.replace("_", "-")
    if value is True:
        return flag
    if isinstance(value, (list, tuple)):
        return f"{flag} {' '.join(map(str, value))}"
    return f"{flag} {value}"


def progress(args: argparse.Namespace, total: int, desc: str, unit: str, **kwargs: Any) -> tqdm:
    """A tqdm bar, off with ``--no-progress``."""
    disable = getattr(args, "no_progress", False)
    return tqdm(total=total, desc=desc, unit=unit, disable=disable, **kwargs)


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
    if TABLES and not doc["options"].get("no_plot"):
        from bench.table_plot import draw_tables

        try:
            title = f"{name}: {describe_machine(doc['machine'])}"
        except (KeyError, TypeError):  # a benchmark's own machine record
            title = name
        png = draw_tables(TABLES, path.with_suffix(".png"), title)
        if png is not None:
            print(f"plot: {png}")
    return path


def save_results(
    args: argparse.Namespace, results: Any, machine: Mapping[str, Any], name: str | None = None
) -> Path:
    """Write ``results`` as ``bench/results/<name or --out>.json``; print and return the path."""
    path = write_result(name or args.out, results, options=vars(args), machine=machine)
    print(f"results: {path}")
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
    """Print the table; keep it for the PNG that :func:`write_result` draws."""
    kept = [list(row) for row in rows]
    TABLES.append((title, list(headers), kept))
    print(format_table(headers, kept, title))


def _looks_numeric(text: str) -> bool:
    stripped = text.rstrip("kMGx%s").lstrip("+-")
    return stripped.replace(".", "", 1).isdigit()
