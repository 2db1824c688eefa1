"""The plots and the summary table of docs/PERFORMANCE.md, from the figures recorded in docs/data/performance_summary.json.

Measures nothing. The data file holds, per data path, the row of the page's
summary table (its current ratio to its ceiling, what the ceiling is, the
machine, the date, the command that reproduces it) and the figures its plot
draws, each taken from a benchmark run the page reports (``source`` says
which section). This script draws one SVG per path into docs/img/ (ratios to
the ceiling as horizontal bars with the ceiling drawn at 1.0, or throughput
next to the ceiling), and prints the summary table the page carries
(``--table``), so that tests/unit/test_performance_doc.py can check the page
against the data. Paths whose plot another script draws (``drawn_by``, e.g.
the CUDA figure of bench/cuda_figures.py) are left alone.

Needs matplotlib (in the project's dev venv). Run:
``python bench/plot_summary.py`` (all plots), ``--only pd_ttft`` (one),
``--table`` (print the summary table's markdown and draw nothing).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data" / "performance_summary.json"
DOCS = ROOT / "docs"
COLOURS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3")
TABLE_HEAD = ("| data path | now: ratio to its ceiling | ceiling (measured in the same run) | machine | date | reproduce |\n"
              "|---|---|---|---|---|---|")


def load(path: Path = DATA) -> dict[str, Any]:
    """The data file, parsed."""
    return json.loads(path.read_text(encoding="utf-8"))


def anchor(heading: str) -> str:
    """GitHub's anchor for a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def table_row(path: dict[str, Any]) -> str:
    """One row of the summary table."""
    cells = [f"[{path['name']}](#{anchor(path['heading'])})", path["ratio"], path["ceiling"], path["machine"],
             path["date"], path["command"]]
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def summary_table(data: dict[str, Any]) -> str:
    """The page's summary table, one row per data path, in the data file's order."""
    return "\n".join([TABLE_HEAD, *(table_row(p) for p in data["paths"])])


def value_label(value: float, unit: str) -> str:
    """How a bar's value is written on the plot: ratios with two decimals, large numbers with separators."""
    text = f"{value:,.0f}" if abs(value) >= 100 else f"{value:g}" if unit else f"{value:.2f}"
    return f"{text} {unit}".strip()


def draw(plot: dict[str, Any], out: Path) -> None:
    """One horizontal grouped-bar chart as SVG: a group per case (first on top), a bar per series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "tiercache", "font.size": 9,
                         "font.family": "sans-serif", "font.sans-serif": ["DejaVu Sans"]})
    series: list[str] = plot["series"]
    cases: list[tuple[str, list[float | None]]] = [(c[0], c[1]) for c in plot["cases"]]
    unit = plot.get("unit", "")
    n_s = len(series)
    bar = 0.8 / n_s
    fig, ax = plt.subplots(figsize=(7.5, 1.2 + len(cases) * (0.16 * n_s + 0.2)))
    values = [v for _, vals in cases for v in vals if v is not None]
    xmax = plot.get("xmax") or max([*values, plot.get("reference", {}).get("value", 0),
                                    plot.get("target", {}).get("value", 0)]) * 1.18
    for s, name in enumerate(series):
        labelled = False
        for g, (_, vals) in enumerate(cases):
            v = vals[s]
            if v is None:
                continue
            y = len(cases) - 1 - g + 0.4 - bar * (s + 0.5)
            shown = min(v, xmax)
            left = plot.get("xmin", 0)  # an axis from xmin: a few per cent around 1 would not show from 0
            ax.barh(y, shown - left, left=left, height=bar * 0.92, color=COLOURS[s % len(COLOURS)],
                    label=None if labelled else name)
            labelled = True
            text = value_label(v, unit) + (" (cut)" if v > xmax else "")
            ax.text(shown * (1.02 if plot.get("log") else 1) + (0 if plot.get("log") else xmax * 0.006), y, text,
                    va="center", fontsize=7)
    ax.set_yticks(range(len(cases)), [c[0] for c in reversed(cases)])
    ax.set_ylim(-0.6, len(cases) - 0.4)
    if plot.get("log"):
        from matplotlib.ticker import FuncFormatter

        ax.set_xscale("log")
        ax.set_xlim(min(values) / 1.6, xmax * 1.6)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    else:
        ax.set_xlim(plot.get("xmin", 0), xmax)
    for key, style in (("reference", {"color": "black", "linewidth": 1.2}),
                       ("target", {"color": "#C44E52", "linewidth": 1.0, "linestyle": "--"})):
        if key in plot:
            line = plot[key]
            ax.axvline(line["value"], **style)
            label = f"{value_label(line['value'], unit)} = {line['label']}" if key == "reference" else line["label"]
            other = plot.get("target" if key == "reference" else "reference")
            left = other is not None and line["value"] < other["value"]  # two labels never overlap
            ax.text(line["value"], len(cases) - 0.45, f"{label} " if left else f" {label}", fontsize=7,
                    va="bottom", ha="right" if left else "left", color=style["color"])
    ax.set_xlabel(plot["xlabel"])
    ax.set_title(plot["title"], fontsize=10, pad=14)
    ax.grid(axis="x", color="#ddd", linewidth=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    if n_s > 1:
        axes_h = fig.get_figheight() * ax.get_position().height  # inches; the legend goes 0.45 in below
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45 / axes_h), ncol=min(n_s, 3),
                  fontsize=7.5, frameon=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="svg", bbox_inches="tight", metadata={"Date": None, "Creator": "bench/plot_summary.py"})
    plt.close(fig)


def drawable(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{path id: plot}`` for the plots this script draws (not those another script draws)."""
    return {p["id"]: p["plot"] for p in data["paths"] if "drawn_by" not in p["plot"]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/plot_summary.py", description=__doc__.split("\n", 1)[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Paths: " + ", ".join(p["id"] for p in load()["paths"]))
    parser.add_argument("--data", type=Path, default=DATA, help="the data file (default %(default)s)")
    parser.add_argument("--docs", type=Path, default=DOCS,
                        help="the docs folder plots' paths are relative to (default %(default)s)")
    parser.add_argument("--only", action="append", default=[], metavar="ID", help="draw only this path's plot")
    parser.add_argument("--table", action="store_true", help="print the summary table's markdown; draw nothing")
    args = parser.parse_args(argv)
    data = load(args.data)
    if args.table:
        print(summary_table(data))
        return 0
    plots = drawable(data)
    unknown = set(args.only) - set(plots)
    if unknown:
        print(f"no plot drawn here for {sorted(unknown)}; known: {sorted(plots)}", file=sys.stderr)
        return 2
    for pid, plot in plots.items():
        if args.only and pid not in args.only:
            continue
        out = args.docs / plot["file"]
        draw(plot, out)
        print(f"{pid}: {out} ({out.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
