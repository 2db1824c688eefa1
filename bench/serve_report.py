"""bench/serve.py's figures: from vLLM's load-generator results to the table, the ratios and the plot.

Starts nothing and needs no engine, so tests/unit/test_serve_bench.py runs it
on a canned result. One *run* is one case (``none``, ``host``, ``disk``,
``redis``, ``server``, ``ideal``) at one *cell* (workload, prefix length,
concurrency; the workload is ``prefix_repetition`` or ``multi_turn``,
bench/serve_turns.py, whose runs merge every turn's result into one):
the JSON ``vllm bench serve --save-result`` wrote (``vllm.benchmarks.serve``;
keys ``request_throughput``, ``median_ttft_ms``, ``p99_ttft_ms``,
``completed``, ``failed``, ``total_input_tokens``) plus the deltas of the
server's /metrics over the run (vLLM's prefix-cache hits, tiercache's hit
tokens per tier). :func:`summarize_run` keeps what the report needs;
:func:`add_ratios` divides every run by the ``ideal`` run of its cell
(throughput ratio: higher is better, 1.0 = the ideal; TTFT p50 ratio: lower
is better); :func:`table_rows` and :func:`draw_ratios` show them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# The targets (issue 22, item 5), for every tiercache case.
THROUGHPUT_TARGET = 0.95  # >= this fraction of the ideal's request throughput
TTFT_TARGET = 1.10  # TTFT p50 <= this multiple of the ideal's
IDEAL = "ideal"
PREFIX_REPETITION = "prefix_repetition"
MULTI_TURN = "multi_turn"
HEADERS = ["case", "prefix (turns), conc", "req/s", "TTFT p50 ms", "TTFT p99 ms", "req/s / ideal", "p50 / ideal",
           "vLLM hits", "tiercache hits", "target"]


def prefix_label(tokens: int) -> str:
    """``1024 -> "1k"``, ``4096 -> "4k"``, ``96 -> "96"``."""
    return f"{tokens // 1024}k" if tokens >= 1024 and tokens % 1024 == 0 else str(tokens)


def cell_of(run: Mapping[str, Any]) -> tuple[str, int, int]:
    """A run's cell: (workload, prefix length, concurrency); runs without a workload repeat prefixes."""
    return run.get("workload", PREFIX_REPETITION), run["prefix_len"], run["concurrency"]


def cell_label(prefix_len: int, concurrency: int, workload: str = PREFIX_REPETITION) -> str:
    """The name of one cell on the plot: ``"1k prefix, c=2"``, ``"1k multi-turn, c=2"``."""
    kind = "multi-turn" if workload == MULTI_TURN else "prefix"
    return f"{prefix_label(prefix_len)} {kind}, c={concurrency}"


def metric_deltas(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """``after - before`` for every series in ``after`` (counters of /metrics)."""
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def parse_metrics(text: str, names: Sequence[str]) -> dict[str, float]:
    """The sums of the Prometheus series named in ``names``, per ``tier`` (or fault ``reason``) label
    where there is one.

    ``tiercache_hit_tokens_total{tier="cpu",...} 96`` -> ``{"tiercache_hit_tokens_total/cpu": 96}``,
    ``tiercache_faults_total{reason="staging_no_slot",...} 3`` -> ``{"tiercache_faults_total/staging_no_slot": 3}``;
    series without either label are summed under the bare name.
    """
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        if name not in names:
            continue
        key = name
        for label in ('tier="', 'reason="'):
            if label in labels:
                key += "/" + labels.split(label, 1)[1].split('"', 1)[0]
                break
        try:
            out[key] = out.get(key, 0.0) + float(value)
        except ValueError:
            continue
    return out


def summarize_run(case: str, prefix_len: int, concurrency: int, result: Mapping[str, Any],
                  metrics: Mapping[str, float] | None = None) -> dict[str, Any]:
    """One run's figures from the load generator's result JSON and the metric deltas."""
    metrics = dict(metrics or {})
    queries = metrics.get("vllm:prefix_cache_queries_total", 0.0)
    hits = metrics.get("vllm:prefix_cache_hits_total", 0.0)
    input_tokens = float(result.get("total_input_tokens") or 0)
    tiers = {key.split("/", 1)[1]: value for key, value in metrics.items()
             if key.startswith("tiercache_hit_tokens_total/") and value}
    return {
        "case": case,
        "prefix_len": prefix_len,
        "concurrency": concurrency,
        "completed": int(result.get("completed") or 0),
        "failed": int(result.get("failed") or 0),
        "duration_s": result.get("duration"),
        "request_throughput": float(result["request_throughput"]),
        "ttft_p50_ms": float(result["median_ttft_ms"]),
        "ttft_p99_ms": float(result.get("p99_ttft_ms", math.nan)),
        "total_input_tokens": int(input_tokens),
        "vllm_hit_fraction": hits / queries if queries else None,
        "tiercache_hit_fraction": {t: v / input_tokens for t, v in tiers.items()} if input_tokens else {},
        "metrics": metrics,
    }


def add_ratios(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run with ``throughput_ratio`` and ``ttft_p50_ratio`` to the ideal run of its cell (None without one)."""
    ideal = {cell_of(r): r for r in runs if r["case"] == IDEAL}
    out: list[dict[str, Any]] = []
    for run in runs:
        ref = ideal.get(cell_of(run))
        thr = ttft = None
        if ref is not None and ref["request_throughput"] > 0 and ref["ttft_p50_ms"] > 0:
            thr = run["request_throughput"] / ref["request_throughput"]
            ttft = run["ttft_p50_ms"] / ref["ttft_p50_ms"]
        met = None
        if thr is not None and ttft is not None and run["case"] not in (IDEAL, "none"):
            met = thr >= THROUGHPUT_TARGET and ttft <= TTFT_TARGET
        out.append({**run, "throughput_ratio": thr, "ttft_p50_ratio": ttft, "meets_target": met})
    return out


def fault_lines(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per run whose tiercache contained faults (each a miss or a recompute): what and how many."""
    lines = []
    for run in runs:
        faults = {key.split("/", 1)[1]: int(n) for key, n in (run.get("metrics") or {}).items()
                  if key.startswith("tiercache_faults_total/") and n}
        if faults:
            lines.append(f"faults: {run['case']} {_cell_text(run)}: "
                         + ", ".join(f"{reason} {n}" for reason, n in sorted(faults.items())))
    return lines


def _hits(run: Mapping[str, Any]) -> str:
    parts = [f"{tier} {frac * 100:.0f}%" for tier, frac in sorted(run["tiercache_hit_fraction"].items())]
    return " ".join(parts) or "-"


def table_rows(runs: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """The printed table (:data:`HEADERS`), one row per run, in the order given."""
    rows = []
    for r in runs:
        ratio = lambda v, f: "-" if v is None else f.format(v)
        vllm_hits = r["vllm_hit_fraction"]
        target = {True: "yes", False: "NO", None: "-"}[r["meets_target"]]
        failed = f" ({r['failed']} failed)" if r["failed"] else ""
        rows.append([
            r["case"] + failed, _cell_text(r),
            f"{r['request_throughput']:.2f}", f"{r['ttft_p50_ms']:.0f}", f"{r['ttft_p99_ms']:.0f}",
            ratio(r["throughput_ratio"], "{:.2f}x"), ratio(r["ttft_p50_ratio"], "{:.2f}x"),
            "-" if vllm_hits is None else f"{vllm_hits * 100:.0f}%", _hits(r), target,
        ])
    return rows


def _cell_text(run: Mapping[str, Any]) -> str:
    workload, prefix_len, concurrency = cell_of(run)
    turns = f" {len(run['turns'])} turns" if workload == MULTI_TURN and run.get("turns") else ""
    return f"{prefix_label(prefix_len)}{turns}, c={concurrency}"


def draw_ratios(runs: Sequence[Mapping[str, Any]], stem: Path, title: str) -> list[Path]:
    """Two panels (throughput / ideal, TTFT p50 / ideal): a group per case, a bar per cell; SVG and PNG.

    The house style of bench/plot_summary.py (its colours, fonts, the
    reference drawn at 1.0 = the ideal, the target dashed). Returns the files
    written (none without matplotlib, after one line that says so).
    """
    from bench.plot_summary import COLOURS
    from tiercache.cli.plots import pyplot

    plt = pyplot()
    if plt is None:
        return []
    plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "tiercache", "font.size": 9,
                         "font.family": "sans-serif", "font.sans-serif": ["DejaVu Sans"]})
    cases = list(dict.fromkeys(r["case"] for r in runs if r["case"] != IDEAL and r["throughput_ratio"] is not None))
    cells = list(dict.fromkeys(cell_of(r) for r in runs))
    if not cases:
        return []
    by = {(r["case"], *cell_of(r)): r for r in runs}
    bar = 0.8 / len(cells)
    height = 1.4 + len(cases) * (0.16 * len(cells) + 0.25)
    fig, axes = plt.subplots(1, 2, figsize=(11, height), sharey=True)
    panels = (("throughput_ratio", "request throughput / ideal (higher is better)", THROUGHPUT_TARGET),
              ("ttft_p50_ratio", "TTFT p50 / ideal (lower is better)", TTFT_TARGET))
    for ax, (key, xlabel, target) in zip(axes, panels):
        values = [by[(c, *cell)][key] for c in cases for cell in cells if (c, *cell) in by
                  and by[(c, *cell)][key] is not None]
        xmax = max([*values, target, 1.0]) * 1.2
        for s, cell in enumerate(cells):
            labelled = False
            for g, case in enumerate(cases):
                run = by.get((case, *cell))
                if run is None or run[key] is None:
                    continue
                y = len(cases) - 1 - g + 0.4 - bar * (s + 0.5)
                ax.barh(y, run[key], height=bar * 0.92, color=COLOURS[s % len(COLOURS)],
                        label=None if labelled else cell_label(cell[1], cell[2], cell[0]))
                labelled = True
                ax.text(run[key] + xmax * 0.006, y, f"{run[key]:.2f}", va="center", fontsize=7)
        ax.axvline(1.0, color="black", linewidth=1.2)
        ax.axvline(target, color="#C44E52", linewidth=1.0, linestyle="--")
        low = target < 1.0  # the lower line's label goes left of it, so the two never overlap
        ax.text(1.0, len(cases) - 0.45, " 1.0 = ideal" if low else "1.0 = ideal ", fontsize=7, va="bottom",
                ha="left" if low else "right")
        ax.text(target, len(cases) - 0.45, f"target {target:g} " if low else f" target {target:g}", fontsize=7,
                va="bottom", ha="right" if low else "left", color="#C44E52")
        ax.set_xlim(0, xmax)
        ax.set_xlabel(xlabel)
        ax.grid(axis="x", color="#ddd", linewidth=0.6)
        ax.set_axisbelow(True)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    axes[0].set_yticks(range(len(cases)), list(reversed(cases)))
    axes[0].set_ylim(-0.6, len(cases) - 0.4)
    fig.suptitle(title, fontsize=10)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(cells), 4), fontsize=7.5, frameon=False,
               bbox_to_anchor=(0.5, -0.02))
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    written = []
    for suffix in (".svg", ".png"):
        path = stem.with_suffix(suffix)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"Date": None, "Creator": "bench/serve.py"} if suffix == ".svg" else {"Software": "bench/serve.py"}
        fig.savefig(path, bbox_inches="tight", metadata=meta, dpi=120)
        written.append(path)
    plt.close(fig)
    return written
