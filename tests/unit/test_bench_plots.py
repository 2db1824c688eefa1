"""`python -m bench <name>` draws the tables it printed into a PNG beside its JSON (bench/table_plot.py).

Through the real path a benchmark takes: :func:`bench.common.print_table`
then :func:`bench.common.write_result` into a temporary results folder; the
PNG is a real matplotlib drawing. ``--no-plot`` (``options["no_plot"]``)
writes none; a table of labels only is left out.
"""

from __future__ import annotations

import pathlib

import pytest

from bench import common
from bench.table_plot import number, plottable

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_cells_read_as_the_table_shows_them() -> None:
    assert [number(c) for c in ("14.55", "1.23M", "45%", "0.93x", "2.5k", "12s", 3, "-0.5")] == [
        14.55, 1.23e6, 45.0, 0.93, 2500.0, 12.0, 3.0, -0.5]
    assert [number(c) for c in ("256KiB", "memcpy", "", "LBHNC")] == [None, None, None, None]
    labels, columns = plottable(["chunk", "what", "GB/s"], [["256KiB", "memcpy", "14.5"], ["4MiB", "mac", "0.9"]])
    assert labels == ["256KiB memcpy", "4MiB mac"] and columns == {"GB/s": [14.5, 0.9]}


def test_write_result_draws_the_printed_tables(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(common, "TABLES", [])
    common.print_table(["chunk", "GB/s", "/memcpy"], [["256KiB", "14.5", "1.00"], ["4MiB", "30.2", "2.41"]],
                       title="frames")
    common.print_table(["what"], [["a label only"]])
    path = common.write_result("demo_bench", {"rows": 2}, options={}, machine=common.machine_info(),
                               directory=tmp_path)
    png = tmp_path / "demo_bench.png"
    assert path == tmp_path / "demo_bench.json"
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert f"plot: {png}" in capsys.readouterr().out
    common.write_result("no_plot", {}, options={"no_plot": True}, machine={}, directory=tmp_path)
    assert (tmp_path / "no_plot.json").exists() and not (tmp_path / "no_plot.png").exists()


def test_nothing_numeric_is_said_not_drawn(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(common, "TABLES", [])
    common.print_table(["what"], [["a label only"]])
    common.write_result("labels", {}, options={}, machine={}, directory=tmp_path)
    assert "plot skipped: no table with numbers to draw" in capsys.readouterr().out
    assert not (tmp_path / "labels.png").exists()


def test_help_says_where_the_plot_goes() -> None:
    parser = common.BenchParser("x", "A test benchmark.", ceiling="none", out="x")
    text = parser.format_help()
    assert "--no-plot" in text and "<--out>.png" in text
