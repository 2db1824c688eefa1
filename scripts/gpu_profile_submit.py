"""Where a CUDA copier job's host time goes: cProfile of TransferEngine.submit on a GPU.

For each copy method, 200 store jobs of one 4 MiB chunk (64 KiB pages, scattered,
one shared KV buffer) are submitted back to back under cProfile; prints the mean
host microseconds per submit and the functions that take it. Needs CUDA.

    python scripts/gpu_profile_submit.py            # from the repository root
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time

import torch

from tiercache.layout import KVBlockLayout
from tiercache.testing.job_builders import make_job
from tiercache.transfer.device import CopySegment
from tiercache.transfer.engine import TransferEngine


def main() -> int:
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 2
    layers, page, nb, jobs = 32, 64 << 10, 512, 200
    raw = torch.empty(layers * 2 * nb * page, dtype=torch.uint8, device="cuda")
    per = 2 * nb * page
    kvs = {f"l{i}": raw[i * per:(i + 1) * per].view(2, nb, page) for i in range(layers)}
    layout = KVBlockLayout.from_kv_caches(kvs, nb)
    order = torch.randperm(nb, generator=torch.Generator().manual_seed(0)).tolist()
    for method in ("driver_batch", "gather"):
        engine = TransferEngine(layout, 1, jobs, cuda_copy=method)
        specs = [make_job(i, "p", "store", (b"%d" % i,), (CopySegment(i, 0, (order[i % nb],)),)) for i in range(jobs)]
        for job in specs[:20]:
            engine.submit(job)
        engine.wait_all()
        prof = cProfile.Profile()
        torch.cuda.synchronize()
        start = time.perf_counter()
        prof.enable()
        for job in specs:
            engine.submit(job)
        prof.disable()
        secs = time.perf_counter() - start
        engine.wait_all()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
        print(f"=== {method}: {secs / jobs * 1e6:.0f} us per submit (under cProfile)")
        print("\n".join(out.getvalue().splitlines()[6:32]))
        start = time.perf_counter()
        for job in specs:
            engine.submit(job)
        secs = time.perf_counter() - start
        engine.wait_all()
        print(f"=== {method}: {secs / jobs * 1e6:.0f} us per submit (no profiler)")
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
