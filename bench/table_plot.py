"""A benchmark's printed tables, drawn: the PNG beside its bench/results/<name>.json.

Every table a benchmark prints through :func:`bench.common.print_table` is
kept (:data:`bench.common.TABLES`); when it writes its JSON,
:func:`draw_tables` draws them into ``<name>.png``: one row of panels per
table, one panel per numeric column (its own axis, so GB/s, ratios and
percentages never share a scale), one horizontal bar per table row, labelled
by the row's text columns. A cell reads as a number as the table shows it:
``1.23M`` is 1.23e6, ``45%`` is 45, ``0.93x`` is 0.93. Tables without a
numeric column are left out. Without matplotlib, one line says so
(tiercache/cli/plots.py) and nothing is drawn; ``--no-plot`` skips it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiercache.cli.plots import pyplot

SCALE = {"k": 1e3, "M": 1e6, "G": 1e9}
MAX_PANELS_PER_ROW = 5


def number(cell: Any) -> float | None:
    """A table cell as the number it shows, or None (a label)."""
    if isinstance(cell, (int, float)) and not isinstance(cell, bool):
        return float(cell)
    text = str(cell).strip().rstrip("%xs")
    scale = 1.0
    if text[-1:] in SCALE:
        scale, text = SCALE[text[-1]], text[:-1]
    try:
        return float(text) * scale
    except ValueError:
        return None


def plottable(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> tuple[list[str], dict[str, list[float]]]:
    """(row labels, {numeric column: values}); the labels join the columns that are not all numbers."""
    numeric = [i for i in range(len(headers)) if rows and all(number(r[i]) is not None for r in rows)]
    labels = [" ".join(str(r[i]) for i in range(len(headers)) if i not in numeric) or str(n + 1)
              for n, r in enumerate(rows)]
    return labels, {headers[i]: [number(r[i]) or 0.0 for r in rows] for i in numeric}


def draw_tables(tables: Sequence[tuple[str | None, Sequence[str], Sequence[Sequence[Any]]]], path: Path,
                title: str) -> Path | None:
    """Draw ``(title, headers, rows)`` tables into ``path``; None when there is nothing to draw (said why)."""
    shown = [(t, *plottable(h, r)) for t, h, r in tables if r]
    shown = [(t, labels, cols) for t, labels, cols in shown if cols]
    if not shown:
        print("plot skipped: no table with numbers to draw")
        return None
    plt = pyplot()
    if plt is None:
        return None
    lines = [(t, labels, list(cols.items())[i:i + MAX_PANELS_PER_ROW])
             for t, labels, cols in shown for i in range(0, len(cols), MAX_PANELS_PER_ROW)]
    width = max(len(panels) for _, _, panels in lines)
    height = [0.6 + 0.28 * len(labels) for _, labels, _ in lines]
    fig, axes = plt.subplots(len(lines), width, figsize=(3.4 * width + 1.5, sum(height) + 0.8), squeeze=False,
                             gridspec_kw={"height_ratios": height}, constrained_layout=True)
    for row, (table_title, labels, panels) in zip(axes, lines):
        for col, ax in enumerate(row):
            if col >= len(panels):
                ax.set_visible(False)
                continue
            name, values = panels[col]
            ax.barh(range(len(values)), values, color="tab:blue")
            ax.set_yticks(range(len(values)), labels if col == 0 else [""] * len(values), fontsize=7)
            ax.invert_yaxis()
            ax.set_title(name, fontsize=8)
            ax.tick_params(axis="x", labelsize=7)
        if table_title:
            row[0].annotate(table_title[:90], (0, 1.18), xycoords="axes fraction", fontsize=8, weight="bold")
    fig.suptitle(title, fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
