"""What the commands print around the work: an engine's log kept off the screen, plots that may be skipped.

* :func:`tiercache.cli.engine_log.log_to_file` sends file descriptors 1 and 2
  (a child process's output, C-level writes, Python's own streams) to the log
  and leaves the command's console on the terminal; checked in a fresh
  interpreter whose stdout is a pipe, as ``tiercache demo`` runs it.
* :mod:`tiercache.cli.plots` draws a bench-server report as a PNG, and without
  matplotlib prints the one line that says so and draws nothing.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

import pytest

from tiercache.cli import plots

SCRIPT = textwrap.dedent("""
    import os, subprocess, sys, pathlib
    from tiercache.cli.engine_log import log_to_file
    with log_to_file(pathlib.Path(sys.argv[1])) as console:
        print("python stdout", flush=True)
        print("python stderr", file=sys.stderr, flush=True)
        os.write(1, b"fd 1\\n")
        subprocess.run(["sh", "-c", "echo child out; echo child err >&2"], check=True)
        print("[demo] progress", file=console, flush=True)
    print("after the block", flush=True)
""")


def test_log_to_file_keeps_the_engine_off_the_screen(tmp_path: pathlib.Path) -> None:
    log = tmp_path / "logs" / "vllm.log"
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(log)], capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["[demo] progress", "after the block"]
    assert out.stderr == ""
    logged = log.read_text().splitlines()
    assert sorted(logged) == sorted(["python stdout", "python stderr", "fd 1", "child out", "child err"])


REPORT = {"requests_per_s": 5000.0, "put_p50_ms": 0.5, "put_p99_ms": 0.8, "get_p50_ms": 0.4,
          "get_p99_ms": 0.7, "put_gbps": 0.36, "get_gbps": 0.05}
TIMELINE = [(0.0, 0), (0.2, 900), (0.4, 1900), (0.6, 3000)]


def test_draws_a_png_beside_the_json(tmp_path: pathlib.Path) -> None:
    png = plots.png_beside(tmp_path / "run.json")
    assert png == tmp_path / "run.png"
    assert plots.draw_load_report(REPORT, TIMELINE, png, "a test run") == png
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_one_line_and_no_file(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an uninstalled package looks like to import
    png = tmp_path / "run.png"
    assert plots.draw_load_report(REPORT, TIMELINE, png, "a test run") is None
    assert capsys.readouterr().out == plots.MISSING + "\n"
    assert not png.exists()
