"""Compute idle between forward passes while stores run: tiercache's CUDA copier next to a model step.

Issue 19's target: with stores running, the GPU's compute stream must stay busy
(idle <= 5%). A *step* here is what a vLLM worker does: a forward pass (a chain
of bf16 matrix products on the compute stream, calibrated to ``--forward-ms``),
then ``wait_for_save`` (one store job of ``--store-bytes`` of scattered KV
blocks, submitted to the copier, which orders it after the forward), then the
host waits for the step's output (an event on the compute stream, as sampling
does). Measured, same run, same card:

* ``base``: the steps without stores;
* ``stores``: the steps with a store per step, as tiercache runs them now (the
  store stream waits on the compute stream; nothing waits on the stores);
* ``fenced``: the same with the fence tiercache used before issue 19 (the
  compute stream waits for the last store before each forward), for comparison.

``idle`` = 1 - base time / time with stores: the share of the steps' time the
compute stream spent not computing because of the stores. ``store GB/s`` is the
store bytes over the steps' time (every store done by the end). Needs CUDA.

Run: ``python -m bench cuda_overlap`` (``--help``). Results go to ``bench/results/cuda_overlap.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script (python bench/<name>.py): import `bench`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from tiercache.layout import KVBlockLayout
from tiercache.testing.job_builders import make_job
from tiercache.transfer.device import CopySegment
from tiercache.transfer.engine import TransferEngine


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = common.BenchParser(
        "cuda_overlap", __doc__,
        ceiling="the same steps without stores, in the same run (idle = 1 - base / with stores)",
        examples=("--forward-ms 10 --store-bytes 32MiB --steps 50",),
        out="cuda_overlap", sizes=True, quick={"steps": 10},
    )
    add = parser.add_argument
    add("--steps", type=int, default=40, help="model steps per measurement (default 40)")
    add("--repeat", type=int, default=3, help="measurements per variant; medians shown (default 3)")
    add("--forward-ms", type=float, default=10.0, help="length of one forward pass (default 10 ms)")
    parser.add_size("--store-bytes", "32MiB", "bytes stored per step (a 256-token chunk of Llama-8B: 32MiB)")
    add("--layers", type=int, default=32, help="KV layers in one shared buffer (default 32)")
    add("--page-kib", type=int, default=32, help="KiB per block per layer, K and V each (default 32)")
    add("--cuda-copy", default="gather,per_run", help="copy methods compared (default %(default)s)")
    return parser.parse_args(argv)


def make_layout(args: argparse.Namespace, num_blocks: int) -> KVBlockLayout:
    """Every layer a (2, blocks, page) bf16 view of one buffer, as vLLM 0.32 allocates a group."""
    page = args.page_kib * 1024 // 2
    raw = torch.empty(args.layers * 2 * num_blocks * page, dtype=torch.bfloat16, device="cuda")
    raw.view(torch.int16).random_(-1000, 1000)
    per = 2 * num_blocks * page
    kvs = {f"l{i}": raw[i * per:(i + 1) * per].view(2, num_blocks, page) for i in range(args.layers)}
    return KVBlockLayout.from_kv_caches(kvs, num_blocks)


class Forward:
    """A chain of matrix products on the current stream lasting about ``ms`` milliseconds."""

    def __init__(self, ms: float) -> None:
        self.a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        self.b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        self.count = 1
        torch.cuda.synchronize()
        for _ in range(3):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            self()
            end.record()
            end.synchronize()
            per = start.elapsed_time(end) / self.count
            self.count = max(1, round(ms / per))

    def __call__(self) -> None:
        for _ in range(self.count):
            torch.mm(self.a, self.b)


def run_steps(engine: TransferEngine | None, forward: Forward, jobs: list, fenced: bool) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    previous: set[int] = set()
    for job in jobs:
        if engine is not None and fenced:
            engine.copier.order_before_compute(previous)  # the old fence: wait for the last store
        forward()
        previous = {job.job_id}
        if engine is not None:
            engine.submit(job)
        done = torch.cuda.Event()
        done.record()
        done.synchronize()  # the host waits for the step's output, as sampling does
    if engine is not None:
        results = engine.wait_all()
        assert all(r.ok for r in results), results
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_overlap needs CUDA: nothing to measure here", file=sys.stderr)
        return 2
    bytes_per_block = args.layers * 2 * args.page_kib * 1024
    bpc = max(1, args.store_bytes // bytes_per_block)
    num_blocks = bpc * args.steps * 2
    layout = make_layout(args, num_blocks)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    jobs = [make_job(i, f"r{i}", "store", (b"%d" % i,), (CopySegment(i, 0, tuple(order[i * bpc:(i + 1) * bpc])),))
            for i in range(args.steps)]
    forward = Forward(args.forward_ms)
    rows, results = [], []
    methods = [m.strip() for m in args.cuda_copy.split(",") if m.strip()]
    with common.progress(args, len(methods) * args.repeat, "overlap", "rep") as bar:
        for method in methods:
            engine = TransferEngine(layout, bpc, args.steps, cuda_copy=method)
            try:
                run_steps(engine, forward, jobs[:3], False)  # warm-up
                samples: dict[str, list[float]] = {"base": [], "stores": [], "fenced": []}
                for _ in range(args.repeat):
                    samples["base"].append(run_steps(None, forward, jobs, False))
                    samples["stores"].append(run_steps(engine, forward, jobs, False))
                    samples["fenced"].append(run_steps(engine, forward, jobs, True))
                    bar.update(1)
            finally:
                engine.shutdown()
            med = {k: statistics.median(v) for k, v in samples.items()}
            moved = args.steps * bpc * bytes_per_block
            for variant in ("stores", "fenced"):
                idle = 1 - med["base"] / med[variant]
                rows.append([method, variant, f"{med['base'] / args.steps * 1e3:.2f}",
                             f"{med[variant] / args.steps * 1e3:.2f}", f"{idle:.1%}",
                             f"{moved / med[variant] / 1e9:.1f}"])
                results.append({"method": method, "variant": variant, "base_s": med["base"],
                                "with_stores_s": med[variant], "idle": idle, "steps": args.steps,
                                "store_bytes_per_step": bpc * bytes_per_block})
    machine = common.machine_info(packages=("torch",))
    title = (f"compute idle with stores: {args.steps} steps of ~{args.forward_ms:g} ms forward + "
             f"{common.size_label(bpc * bytes_per_block)} stored per step ({bpc} scattered blocks x "
             f"{args.layers} layers x K,V of {args.page_kib} KiB), {torch.cuda.get_device_name()}\n"
             f"{common.describe_machine(machine)}")
    common.print_table(["method", "variant", "base ms/step", "ms/step", "idle", "store GB/s"], rows, title)
    common.save_results(args, {"cells": results}, machine)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
