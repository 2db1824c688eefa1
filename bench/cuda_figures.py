"""The CUDA host-tier figure of docs/PERFORMANCE.md, from a GPU run's recorded results.

Reads the summary a GPU run left (``docs/data/cuda_*.json``: the host-tier
cells of ``bash scripts/gpu_check.sh``, one per page size, chunk and copy
method) and draws store throughput as a share of the pinned single-copy
ceiling measured in the same run, per method, with issue 19's targets
(80% for scattered 64 KiB pages, 90% at 256 KiB and up) as dashed lines.
No GPU needed: it only draws.

Run: ``python -m bench cuda_figures docs/data/cuda_h100_2026-11-26.json --svg docs/img/cuda_host_tier.svg``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script (python bench/<name>.py): import `bench`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.svg_chart import grouped_bars

METHODS = ("per_run", "gather", "driver_batch", "auto")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench cuda_figures", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", type=Path, help="a GPU run's summary JSON (docs/data/cuda_*.json)")
    parser.add_argument("--svg", type=Path, required=True, help="where to write the figure")
    parser.add_argument("--direction", choices=("store", "load"), default="store")
    args = parser.parse_args(argv)
    data = json.loads(args.data.read_text())
    cells = data["host_tier"]
    labels: list[str] = []
    keys: list[tuple[str, str]] = []
    for cell in cells:
        key = (cell["geometry"], cell["chunk"])
        if key not in keys:
            keys.append(key)
            labels.append(f"{cell['geometry'].split(' (')[0]}\n{cell['chunk']} chunks")
    ratio = f"{args.direction}_vs_{'d2h' if args.direction == 'store' else 'h2d'}"
    series = {m: [next((c[ratio] for c in cells if (c["geometry"], c["chunk"]) == k and c["method"] == m), None)
                  for k in keys] for m in METHODS}
    title = (f"{args.direction}s, scattered blocks, share of one pinned cudaMemcpyAsync "
             f"({data['machine'].split(':')[-1].split(',')[0].strip()}, {data['date']})")
    svg = grouped_bars(title, labels, series, ylabel="of the single-copy ceiling", ymax=1.0, percent=True,
                       targets={"target at 64 KiB pages: 80%": 0.8, "target at >= 256 KiB: 90%": 0.9})
    args.svg.write_text(svg)
    print(f"wrote {args.svg}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
