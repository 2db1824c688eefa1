"""docs/PERFORMANCE.md cannot drift from its data file, docs/data/performance_summary.json.

The page's summary table is the one bench/plot_summary.py renders from the
data; every number a ratio cell cites is a figure of its data path; every
plot the page embeds exists, and every plot of the data is embedded and
carries its figures (the SVGs keep their text as text); the page's and the
history's links land on headings that exist. Reads files only: no
matplotlib, nothing drawn.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from bench.plot_summary import TABLE_HEAD, anchor, drawable, load, summary_table, value_label

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGE = DOCS / "PERFORMANCE.md"
HISTORY = DOCS / "performance" / "history.md"
# a number as a ratio cell writes one: signed where a space or "(" comes before the minus
# (so "0.44-0.51" is a range), with a decimal point or thousands separators; bare
# integers ("64 KiB", "TP=2") are conditions, not figures
NUMBER = re.compile(r"(?:(?<=[\s(])-)?\d{1,3}(?:,\d{3})+(?:\.\d+)?|(?:(?<=[\s(])-)?\d+\.\d+")
LINK = re.compile(r"\]\(([^)\s]+)\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


@pytest.fixture(scope="module")
def data() -> dict[str, Any]:
    return load()


@pytest.fixture(scope="module")
def page() -> str:
    return PAGE.read_text(encoding="utf-8")


def figures(path: dict[str, Any]) -> set[float]:
    """Every figure a data path holds: its plot's values, target and reference, and its extra figures."""
    values = {float(f["value"]) for f in path.get("figures", [])}
    values |= {float(path["plot"][k]["value"]) for k in ("target", "reference") if k in path["plot"]}
    for _, vals in path["plot"].get("cases", []):
        values |= {float(v) for v in vals if v is not None}
    return values


def table_rows(page: str) -> dict[str, list[str]]:
    """The page's summary table, as ``{data path name: cells}``, read from the page itself."""
    start = page.index(TABLE_HEAD)
    rows: dict[str, list[str]] = {}
    for line in page[start + len(TABLE_HEAD):].lstrip("\n").splitlines():
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        name = re.match(r"\[([^\]]+)\]", cells[0])
        assert name, line
        rows[name.group(1)] = cells
    return rows


def drift(page: str, data: dict[str, Any]) -> list[str]:
    """What in the page's summary table is not in the data: numbers of a ratio cell, or whole rows."""
    found: list[str] = []
    rows = table_rows(page)
    by_name = {p["name"]: p for p in data["paths"]}
    if set(rows) != set(by_name):
        found.append(f"rows {sorted(set(rows) ^ set(by_name))} are in one of page and data only")
    for name, cells in rows.items():
        path = by_name.get(name)
        if path is None:
            continue
        known = figures(path)
        for text in NUMBER.findall(cells[1]):
            value = float(text.replace(",", ""))
            if not any(abs(value - k) < 1e-9 for k in known):
                found.append(f"{name}: {text} in the table is no figure of the data")
    return found


def headings(markdown: str) -> set[str]:
    return {anchor(m) for m in re.findall(r"^#{1,6} (.+)$", markdown, flags=re.MULTILINE)}


def test_the_summary_table_is_the_data(page: str, data: dict[str, Any]) -> None:
    assert summary_table(data) in page, "run `python bench/plot_summary.py --table` and paste it into the page"


def test_every_ratio_in_the_table_is_a_figure_of_the_data(page: str, data: dict[str, Any]) -> None:
    assert len(table_rows(page)) == len(data["paths"]) >= 12
    assert drift(page, data) == []


def test_a_drifted_page_would_be_seen(page: str, data: dict[str, Any]) -> None:
    """The negative control: a ratio edited on the page only, and a row the data lacks."""
    edited = page.replace("put 0.62-0.76, get 0.69-0.75", "put 0.62-0.78, get 0.69-0.75", 1)
    assert edited != page
    assert drift(edited, data) == ["LMDB tier: 0.78 in the table is no figure of the data"]
    extra = page.replace(TABLE_HEAD, TABLE_HEAD + "\n| [Made up](#x) | 1.00 | - | - | - | - |", 1)
    assert any("Made up" in d for d in drift(extra, data))


def test_every_path_names_its_sources(data: dict[str, Any]) -> None:
    for path in data["paths"]:
        for key in ("id", "name", "heading", "ratio", "ceiling", "machine", "date", "command", "source", "plot"):
            assert path.get(key) not in (None, ""), (path["id"], key)
        for figure in path["figures"]:
            assert figure["source"], (path["id"], figure)
        plot = path["plot"]
        for _, vals in plot.get("cases", []):
            assert len(vals) == len(plot["series"]), (path["id"], vals)


def test_every_embedded_plot_exists_and_every_plot_is_embedded(page: str, data: dict[str, Any]) -> None:
    embedded = IMAGE.findall(page)
    for target in embedded:
        file = DOCS / target
        assert file.is_file() and file.stat().st_size > 0, target
        assert file.read_text(encoding="utf-8").lstrip().startswith(("<svg", "<?xml")), target
    assert {p["plot"]["file"] for p in data["paths"]} <= set(embedded)


@pytest.mark.parametrize("pid", sorted(drawable(load())))
def test_each_drawn_plot_carries_its_figures(data: dict[str, Any], pid: str) -> None:
    """Each bar's value label is in the SVG: a plot not redrawn after the data changed fails."""
    plot = drawable(data)[pid]
    svg = (DOCS / plot["file"]).read_text(encoding="utf-8")
    for _, vals in plot["cases"]:
        for v in vals:
            if v is not None:
                assert f">{value_label(v, plot.get('unit', ''))}" in svg, (pid, v)


def test_links_land_on_headings_that_exist(page: str) -> None:
    history = HISTORY.read_text(encoding="utf-8")
    targets = {PAGE: headings(page), HISTORY: headings(history)}
    for source, text in ((PAGE, page), (HISTORY, history)):
        for link in LINK.findall(text):
            if link.startswith(("http://", "https://")):
                continue
            file, _, fragment = link.partition("#")
            dest = (source.parent / file).resolve() if file else source
            assert dest.exists(), (source.name, link)
            if fragment:
                assert fragment in targets[dest], (source.name, link)
