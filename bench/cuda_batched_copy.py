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

Run from the repository root: ``python -m bench.cuda_batched_copy`` (``--help``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

import torch

PAGE_SIZES = (2 << 10, 32 << 10, 256 << 10)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.cuda_batched_copy", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunk-bytes", type=int, default=16 << 20, help="bytes moved per transfer (one chunk)")
    parser.add_argument("--pool-pages", type=int, default=4, help="device pool size, in chunks' worth of pages")
    parser.add_argument("--repeat", type=int, default=20, help="timed transfers per method")
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
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | {args.chunk_bytes >> 20} MiB per transfer")
    header = ("page", "pages", "per-page store", "gather store", "D2H ceiling", "per-page/ceil", "gather/ceil",
              "per-page load", "gather load", "H2D ceiling", "per-page/ceil", "gather/ceil")
    print("  ".join(header))
    for page in PAGE_SIZES:
        r = measure(page, args)
        print("  ".join([f"{page >> 10}K", str(r["pages"]),
                         f"{r['per_page_store']:.2f}", f"{r['gather_store']:.2f}", f"{r['d2h']:.2f}",
                         f"{r['per_page_store'] / r['d2h']:.2f}", f"{r['gather_store'] / r['d2h']:.2f}",
                         f"{r['per_page_load']:.2f}", f"{r['gather_load']:.2f}", f"{r['h2d']:.2f}",
                         f"{r['per_page_load'] / r['h2d']:.2f}", f"{r['gather_load'] / r['h2d']:.2f}"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
