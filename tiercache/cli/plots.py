"""Draw a benchmark's result as a PNG next to its JSON, with matplotlib when it is installed.

matplotlib is optional (the ``[plots]`` extra). :func:`png_beside` turns a
JSON path into the PNG path beside it; :func:`draw_load_report` draws a
``tiercache bench server`` report: throughput over the run (requests per
interval) on the left, p50/p99 latency per operation and GB/s each way on the
right, the run's settings in the title. Each drawing function returns the PNG
path, or None after printing one line that says why nothing was drawn
(matplotlib missing), so a benchmark never fails for want of a plot.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any, TextIO

MISSING = "plot skipped: matplotlib is not installed (pip install 'tiercache[plots]')"


def png_beside(json_path: str | Path) -> Path:
    """``out/run.json`` -> ``out/run.png``."""
    return Path(json_path).with_suffix(".png")


def pyplot(out: TextIO | None = None) -> Any:
    """matplotlib's pyplot on the file-only Agg backend, or None (after saying so) when it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(MISSING, file=out or sys.stdout)
        return None
    return plt


def draw_load_report(report: Mapping[str, Any], timeline: Sequence[tuple[float, int]], path: Path,
                     title: str, out: TextIO | None = None) -> Path | None:
    """A bench-server report: requests/s over time, then latency and throughput per operation."""
    plt = pyplot(out)
    if plt is None:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    times = [t for t, _ in timeline]
    rates = [(n1 - n0) / (t1 - t0) for (t0, n0), (t1, n1) in pairwise(timeline) if t1 > t0]
    if rates:
        left.step(times[1 : len(rates) + 1], rates, where="pre", color="tab:blue")
    left.axhline(report["requests_per_s"], color="tab:gray", linestyle="--",
                 label=f"mean {report['requests_per_s']:.0f} requests/s")
    left.set(xlabel="seconds into the run", ylabel="requests/s", title="throughput")
    left.set_ylim(bottom=0)
    left.legend(loc="lower right")
    ops = ["put", "get"]
    x = range(len(ops))
    p50 = [report[f"{op}_p50_ms"] for op in ops]
    p99 = [report[f"{op}_p99_ms"] for op in ops]
    right.bar([i - 0.2 for i in x], p50, width=0.4, label="p50", color="tab:green")
    right.bar([i + 0.2 for i in x], p99, width=0.4, label="p99", color="tab:orange")
    right.set_xticks(list(x), [f"{op}\n{report[f'{op}_gbps']:.3f} GB/s" for op in ops])
    right.set(ylabel="latency per request (ms)", title="latency")
    right.legend()
    fig.suptitle(title, fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
