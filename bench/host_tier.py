"""Device <-> host-tier throughput of tiercache's real copy path, next to a plain memcpy.

What is measured: stores (engine KV blocks -> host-tier chunk slots) and loads
(slots -> engine blocks) through :class:`tiercache.transfer.engine.TransferEngine`, i.e.
the copier the connector uses, over a :class:`tiercache.layout.KVBlockLayout`
of a realistic engine KV cache: ``--layers`` separately allocated tensors of
shape ``(num_blocks, 2, block_size, kv_heads, head_dim)`` (vLLM's FlashInfer
layout; ``--kv-split`` gives FlashAttention's ``(2, num_blocks, ...)``, two
regions per layer). Each chunk is one job of one segment, its block ids either
``scattered`` (a random permutation, as a paged allocator hands them out after
a while) or ``contiguous``. A chunk's size is its bytes over all layers, so a
chunk of ``S`` bytes holds ``S / bytes_per_block`` blocks; sizes smaller than
one block are skipped. ``--chunks-per-job K`` puts K chunks (segments) in each
job instead, as a step's store of a request's K new chunks does. The default
geometry (32 layers of 16 tokens x 1 KV head x 32 dims in bf16: 2 KiB pages,
64 KiB blocks) is a small model's, the
hardest case: many small copies per chunk. A Llama-8B-like one is
``--kv-heads 8 --head-dim 128 --kv-split --sizes 2MiB,4MiB,8MiB,16MiB --total 1GiB``.

Each measurement moves ``--total`` bytes (the engine holds exactly that much KV,
so every pass streams through memory rather than cache), is warmed up first and
repeated ``--repeat`` times, interleaved with the references so that load from
other processes hits both alike; the table shows medians. References, same
bytes, same run:

* ``memcpy``: the faster of torch ``copy_`` and ``ctypes.memmove`` of one
  contiguous buffer of ``--total`` bytes: the ceiling the target refers to;
* ``chunked``: ``ctypes.memmove`` of the same buffer in chunk-sized pieces
  (what any copy that goes chunk by chunk can reach at best);
* per-job cost, reported beside the streaming figures (CPU columns ``1 job us``,
  ``submit us``): the median time of one store job submitted alone and waited
  for, and the host time one submit takes while the others stream;
* on CUDA, pinned host <-> device ``copy_(non_blocking=True)`` of one buffer
  (``cudaMemcpyAsync``), device->host for stores, host->device for loads; and,
  where the installed vLLM is a CUDA build, vLLM's own batched swap op
  (``swap_blocks_batch``) over the same pages as the store/load jobs.

On CUDA, ``--cuda-copy`` names the copy methods to compare (tiercache/transfer/cuda_batch.py:
``gather``, ``vllm_batch``, ``per_run``), each a row; ``calls`` is the copy calls
one chunk's job issues and ``host us`` the host time spent submitting one chunk's job
(what delays the engine's next launch). ``--shared-buffer`` allocates every layer
as a view of one buffer, as vLLM 0.32 does.

Run: ``python -m bench host_tier`` (``--help`` for options). Results go to
``bench/results/host_tier.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

if __package__ in (None, ""):  # run as a script (python bench/<name>.py): import `bench`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common, cuda_refs
from tiercache.jobs import TransferJob
from tiercache.layout import KVBlockLayout, block_runs
from tiercache.testing.job_builders import make_job
from tiercache.transfer import host_copier, host_kernel
from tiercache.transfer.device import CopySegment, Direction, default_copy_threads
from tiercache.transfer.engine import TransferEngine
from tiercache.transfer.host_gather import HostSegmentCopier

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GB = 1e9


# ------------------------------------------------------------------------------ options
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = common.BenchParser(
        "host_tier", __doc__,
        ceiling="one contiguous memcpy of --total bytes in the same run (the faster of torch "
        "copy_ and ctypes.memmove); with the KV on CUDA, one pinned cudaMemcpyAsync of the same "
        "bytes (D2H for stores, H2D for loads)",
        examples=(
            "--sizes 256KiB,1MiB,4MiB --total 128MiB --repeat 3",
            "--kv-heads 8 --head-dim 128 --kv-split --sizes 2MiB,16MiB --total 1GiB  # Llama-8B",
        ),
        out="host_tier", sizes=True,
        quick={"sizes": "256KiB,1MiB", "total": "16MiB", "repeat": 1, "ids": "scattered"},
    )
    add = parser.add_argument
    parser.add_sizes("64KiB,128KiB,256KiB,512KiB,1MiB,2MiB,4MiB", "chunk sizes over all layers")
    parser.add_size("--total", "256MiB", "bytes moved per measurement")
    parser.add_repeat(5, "measurements per cell; medians are shown")
    add("--layers", type=int, default=32, help="engine KV tensors, one per layer (default 32)")
    add("--block-size", type=int, default=16, help="tokens per engine block (default 16)")
    add("--kv-heads", type=int, default=1, help="KV heads per layer (default 1)")
    add("--head-dim", type=int, default=32, help="head dimension (default 32)")
    add("--dtype", choices=sorted(DTYPES), default="bf16", help="KV dtype (default bf16)")
    add("--kv-split", action="store_true", help="(2, num_blocks, ...) tensors: K and V apart")
    add("--ids", default="scattered,contiguous", help="block id patterns (default %(default)s)")
    add("--chunks-per-job", type=int, default=1,
        help="chunks (segments) per job, as a request's store of several new chunks (default 1)")
    add(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where the engine KV lives: auto = cuda when available (default auto)",
    )
    add(
        "--threads",
        type=int,
        default=None,
        help="copy threads of the host copier (default: tiercache's, 2 where 2 CPUs are usable)",
    )
    add(
        "--cuda-copy",
        default="auto",
        help="CUDA copy methods to compare, comma-separated: auto, gather, vllm_batch, per_run "
        "(default auto; see tiercache/transfer/cuda_batch.py)",
    )
    add("--shared-buffer", action="store_true",
        help="every layer a view of one buffer (vLLM 0.32's allocation) instead of one tensor per layer")
    add(
        "--per-run-copies",
        action="store_true",
        help="CPU: force the copy plan with one memmove per run (no numpy gathers, no kernel), "
        "for before/after comparisons",
    )
    add("--kernel", action=argparse.BooleanOptionalAction, default=True,
        help="CPU: parts of 1 MiB and more copied by the compiled copy-plan executor where it was built "
        "(tiercache/transfer/host_kernel.py, the default); --no-kernel: numpy gathers only, as with "
        "TIERCACHE_HOST_KERNEL=0 (default on)")
    add("--segments", action=argparse.BooleanOptionalAction, default=True,
        help="CPU: each segment planned and copied in one C call (host_kernel.segment_runner, the default "
        "where the executor is built); --no-segments: the copier before session 29 (numpy gathers below "
        "1 MiB parts, numpy plans run by the executor from there), for before/after runs (default on)")
    add("--batches", action=argparse.BooleanOptionalAction, default=True,
        help="CPU: a copy thread copies the parts queued behind it as one batch, one C call (the default "
        "since session 30); --no-batches: each part alone, as before, for before/after runs (default on)")
    parser.add_seed()
    return parser.parse_args(argv)


@dataclass(frozen=True)
class Geometry:
    layers: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: str
    kv_split: bool

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        page = (self.block_size, self.kv_heads, self.head_dim)
        return (2, num_blocks, *page) if self.kv_split else (num_blocks, 2, *page)

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=DTYPES[self.dtype]).element_size()
        return self.layers * 2 * self.block_size * self.kv_heads * self.head_dim * elem


# ------------------------------------------------------------------------------- engine
def make_kv_caches(
    geom: Geometry, num_blocks: int, device: torch.device, seed: int, shared: bool = False
) -> dict[str, torch.Tensor]:
    """One separately allocated, randomly filled KV tensor per layer, as vLLM registers them.

    All are allocated before any is filled, and filled in place: freeing large
    temporaries first would make glibc serve the layers from its heap at
    drifting 64-byte offsets, unlike an engine's large page-aligned tensors.
    """
    shape = geom.layer_shape(num_blocks)
    if shared:
        per_layer = int(torch.Size(shape).numel())
        raw = torch.empty(per_layer * geom.layers, dtype=DTYPES[geom.dtype], device=device)
        caches = {
            f"model.layers.{layer}.self_attn.attn": raw[layer * per_layer:(layer + 1) * per_layer].view(shape)
            for layer in range(geom.layers)
        }
    else:
        caches = {
            f"model.layers.{layer}.self_attn.attn": torch.empty(
                shape, dtype=DTYPES[geom.dtype], device=device
            )
            for layer in range(geom.layers)
        }
    gen = torch.Generator(device=device).manual_seed(seed)
    for raw in caches.values():
        raw.view(torch.uint8).random_(0, 256, generator=gen)
    return caches


def block_order(num_blocks: int, pattern: str, seed: int) -> list[int]:
    if pattern == "contiguous":
        return list(range(num_blocks))
    if pattern == "scattered":
        return torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    raise SystemExit(f"unknown --ids pattern {pattern!r} (scattered, contiguous)")


def make_jobs(
    direction: Direction, order: list[int], bpc: int, first_id: int = 0, per_job: int = 1
) -> list[TransferJob]:
    """Chunk ``c`` <-> slot ``c``; ``per_job`` consecutive chunks per job (one by default)."""
    chunks = len(order) // bpc
    jobs = []
    for j, first in enumerate(range(0, chunks, per_job)):
        cs = range(first, min(first + per_job, chunks))
        segs = tuple(CopySegment(c, 0, tuple(order[c * bpc : (c + 1) * bpc])) for c in cs)
        keys = tuple(b"%d" % c for c in cs)
        jobs.append(make_job(first_id + j, f"bench-{first}", direction, keys, segs))
    return jobs


def run_jobs(
    engine: TransferEngine, jobs: list[TransferJob], sync: Callable[[], None],
    submit_secs: list[float] | None = None,
) -> float:
    """Submit every job, wait for all; seconds from first submit to last completion
    (host seconds spent in the submits appended to ``submit_secs``)."""
    sync()
    start = time.perf_counter()
    for job in jobs:
        engine.submit(job)
    if submit_secs is not None:
        submit_secs.append(time.perf_counter() - start)
    results = engine.wait_all()
    sync()
    secs = time.perf_counter() - start
    failed = [r for r in results if not r.ok]
    if failed or len(results) != len(jobs):
        raise RuntimeError(f"{len(failed)} of {len(jobs)} jobs failed ({len(results)} reported)")
    return secs


def verify(
    engine: TransferEngine,
    layout: KVBlockLayout,
    order: list[int],
    bpc: int,
    sync: Callable[[], None],
) -> None:
    """Slots hold the engine's bytes after a store; zeroed blocks get them back from a load."""
    chunks = sorted({0, len(order) // bpc // 2, len(order) // bpc - 1})
    for c in chunks:
        ids = torch.tensor(order[c * bpc : (c + 1) * bpc], device=layout.device)
        expect = torch.cat([r.index_select(0, ids).reshape(-1) for r in _word_views(layout)])
        slot = engine.host.slot(c).to(layout.device).view(expect.dtype)
        if not torch.equal(slot, expect):
            raise AssertionError(f"store of chunk {c}: slot bytes differ from the engine's")
        for region in _word_views(layout):
            region.index_fill_(0, ids, 0)
        seg = CopySegment(c, 0, tuple(order[c * bpc : (c + 1) * bpc]))
        run_jobs(engine, [make_job(-1 - c, "verify", "load", (b"v",), (seg,))], sync)
        got = torch.cat([r.index_select(0, ids).reshape(-1) for r in _word_views(layout)])
        if not torch.equal(got, expect):
            raise AssertionError(f"load of chunk {c}: engine bytes differ from the slot's")


def _word_views(layout: KVBlockLayout) -> list[torch.Tensor]:
    # torch's CPU index_select is very slow on uint8; compare as 32-bit words where possible.
    words = all(p % 4 == 0 for p in layout.page_bytes)
    return [r.view(torch.int32) if words else r for r in layout.regions]


# --------------------------------------------------------------------------- references
class References:
    """Plain copies of ``total`` bytes: the yardsticks for one cell."""

    def __init__(self, total: int, device: torch.device) -> None:
        self.total = total
        self.src = torch.ones(total, dtype=torch.uint8)
        self.dst = torch.zeros(total, dtype=torch.uint8)
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.pinned = torch.ones(total, dtype=torch.uint8, pin_memory=True)
            self.dev = torch.zeros(total, dtype=torch.uint8, device=device)

    def torch_copy(self) -> float:
        return _timed(lambda: self.dst.copy_(self.src))

    def memmove(self) -> float:
        return _timed(lambda: ctypes.memmove(self.dst.data_ptr(), self.src.data_ptr(), self.total))

    def chunked(self, chunk: int) -> float:
        def run() -> None:
            src, dst = self.src.data_ptr(), self.dst.data_ptr()
            for off in range(0, self.total - chunk + 1, chunk):
                ctypes.memmove(dst + off, src + off, chunk)

        return _timed(run)

    def d2h(self) -> float:
        return _timed(
            lambda: self.pinned.copy_(self.dev, non_blocking=True), torch.cuda.synchronize
        )

    def h2d(self) -> float:
        return _timed(
            lambda: self.dev.copy_(self.pinned, non_blocking=True), torch.cuda.synchronize
        )


def _timed(fn: Callable[[], object], sync: Callable[[], None] = lambda: None) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


# --------------------------------------------------------------------------------- cells
@dataclass
class Cell:
    chunk_bytes: int
    ids: str
    blocks_per_chunk: int
    copies_per_chunk: float  # region x run copies the generic path issues per chunk
    numpy_calls_per_chunk: int  # take/put calls of the HostSegmentCopier path (0: not used)
    store_gbs: float
    load_gbs: float
    memcpy_gbs: float  # the ceiling: faster of torch copy_ and memmove, whole buffer
    torch_copy_gbs: float
    memmove_gbs: float
    chunked_memcpy_gbs: float
    store_vs_memcpy: float  # medians of per-repetition ratios
    load_vs_memcpy: float
    cuda_d2h_gbs: float | None = None
    cuda_h2d_gbs: float | None = None
    store_vs_d2h: float | None = None
    load_vs_h2d: float | None = None
    method: str = "cpu"  # the copier's method (CUDA: gather, vllm_batch, per_run)
    calls_per_chunk: float | None = None  # copy calls (kernels, DMAs, batched calls) one chunk's job issues
    host_us_per_chunk: float | None = None  # host time submitting one chunk's job (median store, load)
    job_us: float | None = None  # one store job submitted alone and waited for (median), microseconds
    vllm_batch_store_gbs: float | None = None  # vLLM's swap_blocks_batch on the same pages, if installed
    vllm_batch_load_gbs: float | None = None


def measure_cell(
    args: argparse.Namespace,
    layout: KVBlockLayout,
    chunk: int,
    pattern: str,
    refs: References,
    bar: tqdm,
    method: str = "auto",
) -> Cell:
    bpc = chunk // layout.bytes_per_block
    num_blocks = (layout.num_blocks // bpc) * bpc
    device = layout.device
    order = block_order(num_blocks, pattern, args.seed)
    engine = TransferEngine(layout, bpc, num_blocks // bpc, copy_threads=args.threads, cuda_copy=method)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    per = args.chunks_per_job
    stores, loads = make_jobs("store", order, bpc, 0, per), make_jobs("load", order, bpc, len(order), per)
    submits: dict[str, list[float]] = {"store": [], "load": []}
    try:
        run_jobs(engine, stores, sync)  # warm-up: touches every slot page
        run_jobs(engine, loads, sync)
        verify(engine, layout, order, bpc, sync)
        batch = cuda_refs.VllmBatchReference.build(engine, stores) if refs.cuda else None
        samples: dict[str, list[float]] = {}
        for _ in range(args.repeat):
            for name, fn in _round(engine, stores, loads, refs, chunk, sync, submits, batch).items():
                samples.setdefault(name, []).append(fn())
            bar.update(1)
        calls = cuda_refs.calls_per_chunk(engine, stores) if refs.cuda else None
        # per-job cost (CPU): up to 32 store jobs, each submitted alone and waited for
        alone = [] if refs.cuda else [run_jobs(engine, [job], sync) for job in stores[:: max(1, len(stores) // 32)]]
    finally:
        engine.shutdown()
    copier = getattr(engine.copier, "_segment_copier", None)
    moved = {name: refs.total for name in samples} | {
        name: len(order) * layout.bytes_per_block for name in ("store", "load", "vllm_store", "vllm_load")
    }
    cell = _summarize(samples, moved, chunk, pattern, bpc, layout, order, copier)
    cell.method = getattr(engine.copier, "method", "cpu")
    cell.calls_per_chunk = calls
    per_job = [s / len(stores) * 1e6 for s in submits["store"] + submits["load"]]
    cell.host_us_per_chunk = statistics.median(per_job) if per_job else None
    cell.job_us = statistics.median(alone) * 1e6 if alone else None
    return cell


def _round(
    engine, stores, loads, refs: References, chunk: int, sync, submits: dict[str, list[float]], batch
) -> dict[str, Callable[[], float]]:
    """One interleaved repetition: every reference and both directions, in seconds."""
    fns: dict[str, Callable[[], float]] = {
        "torch_copy": refs.torch_copy,
        "memmove": refs.memmove,
        "chunked": lambda: refs.chunked(chunk),
        "store": lambda: run_jobs(engine, stores, sync, submits["store"]),
        "load": lambda: run_jobs(engine, loads, sync, submits["load"]),
    }
    if refs.cuda:
        fns["d2h"], fns["h2d"] = refs.d2h, refs.h2d
    if batch is not None:
        fns["vllm_store"], fns["vllm_load"] = batch.store, batch.load
    return fns


def _summarize(samples, moved, chunk, pattern, bpc, layout, order, copier) -> Cell:
    rate = {name: [moved[name] / s / GB for s in secs] for name, secs in samples.items()}
    med = {name: statistics.median(r) for name, r in rate.items()}
    ceiling = [max(t, m) for t, m in zip(rate["torch_copy"], rate["memmove"])]

    def ratio(name: str, ref: list[float]) -> float:
        return statistics.median(a / b for a, b in zip(rate[name], ref))

    runs = statistics.fmean(
        len(block_runs(order[c * bpc : (c + 1) * bpc])) for c in range(len(order) // bpc)
    )
    cell = Cell(
        chunk_bytes=chunk,
        ids=pattern,
        blocks_per_chunk=bpc,
        copies_per_chunk=round(runs * len(layout.regions), 1),
        numpy_calls_per_chunk=len(copier.groups) if copier is not None else 0,
        store_gbs=med["store"],
        load_gbs=med["load"],
        memcpy_gbs=statistics.median(ceiling),
        torch_copy_gbs=med["torch_copy"],
        memmove_gbs=med["memmove"],
        chunked_memcpy_gbs=med["chunked"],
        store_vs_memcpy=ratio("store", ceiling),
        load_vs_memcpy=ratio("load", ceiling),
    )
    if "vllm_store" in rate:
        cell.vllm_batch_store_gbs, cell.vllm_batch_load_gbs = med["vllm_store"], med["vllm_load"]
    if "d2h" in rate:
        cell.cuda_d2h_gbs, cell.cuda_h2d_gbs = med["d2h"], med["h2d"]
        cell.store_vs_d2h, cell.load_vs_h2d = (
            ratio("store", rate["d2h"]),
            ratio("load", rate["h2d"]),
        )
    return cell


# ---------------------------------------------------------------------------------- main
def pick_device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: CUDA is not available")
        return torch.device("cuda")
    print(
        "CUDA not available (or --device cpu): the engine KV lives in host memory, as on vLLM's "
        "CPU platform; skipping the pinned cudaMemcpyAsync comparison.",
        file=sys.stderr,
    )
    return torch.device("cpu")


def print_cells(cells: list[Cell], title: str) -> None:
    headers = [
        "chunk",
        "method",
        "ids",
        "blocks",
        "copies",
        "store GB/s",
        "load GB/s",
        "memcpy GB/s",
        "chunked GB/s",
        "store/memcpy",
        "load/memcpy",
    ]
    rows = []
    for c in cells:
        row = [
            common.size_label(c.chunk_bytes),
            c.method,
            c.ids,
            c.blocks_per_chunk,
            f"{c.copies_per_chunk:g}",
            f"{c.store_gbs:.2f}",
            f"{c.load_gbs:.2f}",
            f"{c.memcpy_gbs:.2f}",
            f"{c.chunked_memcpy_gbs:.2f}",
            f"{c.store_vs_memcpy:.0%}",
            f"{c.load_vs_memcpy:.0%}",
        ]
        if c.cuda_d2h_gbs is None:
            row += [f"{c.job_us:.0f}" if c.job_us is not None else "-",
                    f"{c.host_us_per_chunk:.1f}" if c.host_us_per_chunk is not None else "-"]
        else:
            vllm = (f"{c.vllm_batch_store_gbs:.1f}/{c.vllm_batch_load_gbs:.1f}"
                    if c.vllm_batch_store_gbs is not None else "n/a")
            row += [
                f"{c.cuda_d2h_gbs:.2f}",
                f"{c.cuda_h2d_gbs:.2f}",
                f"{c.store_vs_d2h:.0%}",
                f"{c.load_vs_h2d:.0%}",
                vllm,
                f"{c.calls_per_chunk:g}" if c.calls_per_chunk is not None else "-",
                f"{c.host_us_per_chunk:.0f}" if c.host_us_per_chunk is not None else "-",
            ]
        rows.append(row)
    if cells and cells[0].cuda_d2h_gbs is None:
        headers += ["1 job us", "submit us"]
    if cells and cells[0].cuda_d2h_gbs is not None:
        headers += ["D2H GB/s", "H2D GB/s", "store/D2H", "load/H2D", "vLLM batch st/ld", "calls", "host us"]
    common.print_table(headers, rows, title)


def usable_sizes(sizes: list[int], geom: Geometry) -> list[int]:
    """The chunk sizes that are whole numbers of blocks; the others are reported and dropped."""
    usable = [s for s in sizes if s >= geom.bytes_per_block and s % geom.bytes_per_block == 0]
    for s in sorted(set(sizes) - set(usable)):
        print(
            f"skipping chunk size {common.size_label(s)}: not a multiple of one block "
            f"({geom.bytes_per_block} bytes)",
            file=sys.stderr,
        )
    return usable


def run_cells(
    args: argparse.Namespace, layout: KVBlockLayout, sizes: list[int], refs: References
) -> list[Cell]:
    patterns = [p.strip() for p in args.ids.split(",") if p.strip()]
    methods = [m.strip() for m in args.cuda_copy.split(",") if m.strip()] if refs.cuda else ["auto"]
    cells: list[Cell] = []
    total = len(sizes) * len(patterns) * len(methods) * args.repeat
    with common.progress(args, total, "host tier", "rep") as bar:
        for chunk in sizes:
            for pattern in patterns:
                for method in methods:
                    bar.set_postfix_str(f"{common.size_label(chunk)} {pattern} {method}")
                    cells.append(measure_cell(args, layout, chunk, pattern, refs, bar, method))
    return cells


def describe_run(
    args: argparse.Namespace, geom: Geometry, device: torch.device, total: int, machine: dict
) -> str:
    lead = "2, num_blocks" if geom.kv_split else "num_blocks, 2"
    shape = f"({lead}, {geom.block_size}, {geom.kv_heads}, {geom.head_dim})"
    page = geom.bytes_per_block // geom.layers // (2 if geom.kv_split else 1)
    if device.type == "cuda":
        copier = "CUDA streams" + (", one shared KV buffer" if args.shared_buffer else ", a tensor per layer")
    else:
        copier = f"{args.threads or default_copy_threads()} copy thread(s)"
        copier += ", per-run copies" if args.per_run_copies else ""
        executor = args.kernel and not args.per_run_copies and host_kernel.run_kernel() is not None
        batched = executor and args.segments and args.batches  # batches need the segments in C
        copier += ", parts queued behind a thread copied as one batch" if batched else ", each part alone"
        how = "each segment planned in C" if args.segments else "from 1 MiB parts"
        if executor:
            copier += f", compiled executor ({host_kernel.stores_used()} stores, {how})"
        elif not args.per_run_copies:
            copier += ", numpy gathers only"
    return (
        f"host tier {device.type}: {geom.layers} layers of {shape} {geom.dtype}, "
        f"{geom.bytes_per_block} B/block, {page} B/page, "
        f"{common.size_label(total)} per measurement, "
        f"median of {args.repeat}, {copier}, {args.chunks_per_job} chunk(s) per job"
        f"\n{common.describe_machine(machine)}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = pick_device(args.device)
    os.environ[host_kernel.ENV_SWITCH] = "1" if args.kernel and not args.per_run_copies else "0"
    if args.per_run_copies:
        HostSegmentCopier.build = classmethod(lambda cls, *a: None)  # type: ignore[method-assign]
    if args.per_run_copies or not args.segments:
        host_copier.segment_runner = lambda *a, **k: None  # type: ignore[assignment]
    if not args.batches:
        host_copier.BATCH_PARTS = 0  # a thread's batch is the part it waited for
    geom = Geometry(
        args.layers, args.block_size, args.kv_heads, args.head_dim, args.dtype, args.kv_split
    )
    sizes = usable_sizes(args.sizes, geom)
    num_blocks = args.total // geom.bytes_per_block
    kv_caches = make_kv_caches(geom, num_blocks, device, args.seed, shared=args.shared_buffer)
    layout = KVBlockLayout.from_kv_caches(kv_caches, num_blocks)
    refs = References(num_blocks * geom.bytes_per_block, device)
    cells = run_cells(args, layout, sizes, refs)
    machine = common.machine_info(packages=("torch", "numpy"))
    print_cells(cells, describe_run(args, geom, device, refs.total, machine))
    results = {
        "geometry": asdict(geom),
        "bytes_per_block": geom.bytes_per_block,
        "device": device.type,
        "cells": [asdict(c) for c in cells],
    }
    common.save_results(args, results, machine)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
