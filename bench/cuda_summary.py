"""One GPU run's CUDA results in one file: what docs/data/cuda_*.json holds and bench/cuda_figures draws.

``bash scripts/gpu_check.sh`` leaves, in its output folder, one
``host_tier_gpu_<case>.json`` per page size (bench/host_tier.py), the raw
batched-copy results (bench/cuda_batched_copy.py) and the overlap results
(bench/cuda_overlap.py). This gathers the cells a reader compares into one
summary: per case, chunk and copy method the store and load throughput, the
pinned single-copy ceilings measured in the same run (D2H, H2D) and their
ratios, copy calls and host time per chunk; the overlap cells; the raw copy
rows; the machine. No GPU needed.

Run: ``python -m bench cuda_summary /tmp/gpu_check_out docs/data/cuda_h100_<date>.json``
(gpu_check.sh runs it itself into ``$OUT/cuda_summary.json``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

GEOMETRY = {"page64k": "64 KiB pages", "page256k": "256 KiB pages", "page2k": "2 KiB pages",
            "llama8b": "32 KiB pages (Llama-8B)"}


def _size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return f"{nbytes}B"


def _r(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def host_tier_cells(folder: Path) -> list[dict[str, Any]]:
    cells: list[dict[str, Any]] = []
    for case in GEOMETRY:
        path = folder / f"host_tier_gpu_{case}.json"
        if not path.exists():
            print(f"cuda_summary: {path.name} missing: case {case} left out", file=sys.stderr)
            continue
        for cell in json.loads(path.read_text())["results"]["cells"]:
            cells.append({
                "case": case, "geometry": GEOMETRY[case], "chunk": _size(cell["chunk_bytes"]),
                "method": cell["method"], "store_gbs": _r(cell["store_gbs"]), "load_gbs": _r(cell["load_gbs"]),
                "d2h_gbs": _r(cell["cuda_d2h_gbs"]), "h2d_gbs": _r(cell["cuda_h2d_gbs"]),
                "store_vs_d2h": _r(cell["store_vs_d2h"]), "load_vs_h2d": _r(cell["load_vs_h2d"]),
                "calls_per_chunk": cell["calls_per_chunk"], "host_us_per_chunk": _r(cell["host_us_per_chunk"], 0),
            })
    return cells


def machine_line(folder: Path) -> str:
    log = (folder / "gpu_check.log").read_text(errors="replace") if (folder / "gpu_check.log").exists() else ""
    gpu = re.search(r"^(NVIDIA [^,\n]+), ([\d.]+), ", log, re.M)
    torch_version = re.search(r"^torch (\S+)", log, re.M)
    parts = [f"{gpu.group(1)}, driver {gpu.group(2)}" if gpu else "GPU unknown",
             f"torch {torch_version.group(1)}" if torch_version else "torch unknown"]
    for path in sorted(folder.glob("host_tier_gpu_*.json")):
        machine = json.loads(path.read_text()).get("machine", {})
        parts += [machine.get("python", ""), f"{machine.get('cpu', '')} ({machine.get('usable_cpus', '?')} CPUs)"]
        break
    return ", ".join(p for p in parts if p)


def summarize(folder: Path) -> dict[str, Any]:
    summary: dict[str, Any] = {"machine": machine_line(folder), "command": "bash scripts/gpu_check.sh",
                               "host_tier": host_tier_cells(folder)}
    for key, name in (("overlap", "cuda_overlap_gpu.json"), ("raw_batched_copy", "cuda_batched_copy_gpu.json")):
        path = folder / name
        if path.exists():
            data = json.loads(path.read_text())
            summary["date"] = summary.get("date") or str(data.get("timestamp", ""))[:10]
            summary[key] = data["results"]
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench cuda_summary", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="gpu_check.sh's output folder ($OUT)")
    parser.add_argument("out", type=Path, help="the summary JSON to write")
    args = parser.parse_args(argv)
    summary = summarize(args.folder)
    if not summary["host_tier"]:
        print(f"cuda_summary: no host_tier_gpu_*.json in {args.folder}", file=sys.stderr)
        return 1
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"cuda_summary: {len(summary['host_tier'])} host-tier cells -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
