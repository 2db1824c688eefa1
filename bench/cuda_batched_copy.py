"""Scattered KV pages between GPU and pinned host memory: one copy per page vs one batched copy.

Issue 19's question, measured before the CUDA copier is rebuilt: how fast can
``n`` scattered pages of ``page`` bytes move between a paged device KV cache
and a contiguous pinned host buffer (a chunk slot)?

* ``per_page``: one ``copy_(non_blocking=True)`` per page, what
  ``tiercache/transfer/device.py`` issues today (runs of consecutive pages merged, none
  here: the page ids are a random permutation);
* ``gather``: the pages gathered on the GPU into a contiguous device staging
  buffer by one ``index_select`` kernel, then one device-to-host copy (store);
  one host-to-device copy, then one ``index_copy_`` kernel (load);
* ceiling: one pinned ``cudaMemcpyAsync`` of the same bytes, contiguous, in
  the same run (``copy_`` of a device buffer to the pinned buffer).

Timed with CUDA events around ``--repeat`` copies after a warm-up; the table
gives GB/s and the ratio to the ceiling. Every method's bytes are checked
against the source once (untimed). Needs CUDA; exits with a message without it.

Run from the repository root: ``python -m bench cuda_batched_copy`` (``--help``).
Results go to ``bench/results/cuda_batched_copy.json``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script (python bench/<name>.py): import `bench`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import BenchParser, machine_info, print_table, save_results

PAGE_SIZES = (2 << 10, 32 << 10, 256 << 10)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = BenchParser(
        "cuda_batched_copy", __doc__,
        ceiling="one pinned cudaMemcpyAsync of the same bytes, contiguous, in the same run "
        "(device -> pinned host for stores, pinned host -> device for loads)",
        examples=("--chunk-bytes 2MiB",),
        out="cuda_batched_copy", progress=False, sizes=True,
        quick={"chunk_bytes": "2MiB", "repeat": 4},
    )
    add = parser.add_argument
    parser.add_size("--chunk-bytes", "16MiB", "bytes moved per transfer (one chunk)")
    add("--pool-pages", type=int, default=4,
        help="device pool size, in chunks' worth of pages (default 4)")
    parser.add_repeat(20, "timed transfers per method")
    return parser.parse_args(argv)


def timed(fn: Callable[[], None], repeat: int) -> float:
    """Seconds per call, by CUDA events (after one untimed call)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / repeat


def measure(page: int, args: argparse.Namespace) -> dict[str, float]:
    n = args.chunk_bytes // page
    pool = torch.randint(0, 255, (n * args.pool_pages, page), dtype=torch.uint8, device="cuda")
    ids = torch.randperm(pool.shape[0], device="cuda")[:n]
    ids_host = ids.tolist()
    host = torch.empty((n, page), dtype=torch.uint8, pin_memory=True)
    staging = torch.empty((n, page), dtype=torch.uint8, device="cuda")
    assert host.is_pinned()

    def per_page_store() -> None:
        for i, b in enumerate(ids_host):
            host[i].copy_(pool[b], non_blocking=True)

    def per_page_load() -> None:
        for i, b in enumerate(ids_host):
            pool[b].copy_(host[i], non_blocking=True)

    def gather_store() -> None:
        torch.index_select(pool, 0, ids, out=staging)
        host.copy_(staging, non_blocking=True)

    def gather_load() -> None:
        staging.copy_(host, non_blocking=True)
        pool.index_copy_(0, ids, staging)

    def ceiling_d2h() -> None:
        host.copy_(staging, non_blocking=True)

    def ceiling_h2d() -> None:
        staging.copy_(host, non_blocking=True)

    expected = pool[ids].cpu()
    for store in (per_page_store, gather_store):
        host.zero_()
        store()
        torch.cuda.synchronize()
        assert torch.equal(host, expected), f"{store.__name__} moved other bytes"
    nbytes = n * page
    out = {"page": page, "pages": n}
    for name, fn in (("per_page_store", per_page_store), ("gather_store", gather_store),
                     ("per_page_load", per_page_load), ("gather_load", gather_load),
                     ("d2h", ceiling_d2h), ("h2d", ceiling_h2d)):
        repeat = max(2, args.repeat // 10) if name.startswith("per_page") and n > 1024 else args.repeat
        out[name] = nbytes / timed(fn, repeat) / 1e9
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA: nothing measured")
        return 0
    title = (f"{torch.cuda.get_device_name()} | torch {torch.__version__} | "
             f"{args.chunk_bytes >> 20} MiB per transfer")
    header = ("page", "pages", "per-page store", "gather store", "D2H ceiling", "per-page/ceil",
              "gather/ceil", "per-page load", "gather load", "H2D ceiling", "per-page/ceil",
              "gather/ceil")
    results = [measure(page, args) for page in PAGE_SIZES]
    print_table(header, [_row(r) for r in results], title)
    machine = machine_info(["torch"]) | {"gpu": torch.cuda.get_device_name()}
    save_results(args, results, machine)
    return 0


def _row(r: dict[str, float]) -> list[str]:
    """One page size: GB/s of each method and its ratio to the ceiling, stores then loads."""
    row = [f"{int(r['page']) >> 10}K", str(int(r["pages"]))]
    for op, ceiling in (("store", "d2h"), ("load", "h2d")):
        row += [f"{r[f'per_page_{op}']:.2f}", f"{r[f'gather_{op}']:.2f}", f"{r[ceiling]:.2f}",
                f"{r[f'per_page_{op}'] / r[ceiling]:.2f}", f"{r[f'gather_{op}'] / r[ceiling]:.2f}"]
    return row


if __name__ == "__main__":
    raise SystemExit(main())
