"""Store shards: cutting a chunk into per-head shards and joining them back, next to memcpy.

Every chunk a TP rank with more than one KV head writes to a lower tier is cut
into one shard per head (:class:`tiercache.shards.HeadSlicer`, what
:class:`tiercache.tiers.sharded_backend.ShardedBackend` does on every put), and
joined back from them on every get. This measures both against the ceiling
measured in the same run: ``numpy.copyto`` of the same bytes (one chunk into
another buffer), as a ratio.

Geometries: the KV tensors are built as vLLM 0.32 registers them, one
``[blocks, heads, tokens, content]`` view per layer, head-major (LBHNC, the CPU
backend) or token-major (LBNHC, CUDA's default). ``--model`` picks the head
count, layers and head size; ``--tp`` how many of the heads one rank holds.
A rank with one head needs no cut at all (the wrapper passes the slot's view).

Run from the repository root: ``python -m bench shards`` (``--help``).
Results: a table on stdout and ``bench/results/shards.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

if __package__ in (None, ""):  # run as a script (python bench/<name>.py): import `bench`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from tiercache.layout import KVBlockLayout
from tiercache.shards import HeadSlicer

MODELS = {  # name: (KV heads, layers, head size), float32 KV (bf16 halves every size)
    "tiny": (2, 4, 64),
    "llama-8b": (8, 32, 128),
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = common.BenchParser(
        "shards", __doc__,
        ceiling="numpy.copyto of the same chunk into another buffer (a memcpy), in the same run",
        examples=("--model llama-8b --tp 1 2 --chunk-tokens 256",),
        out="shards", quick={"model": "tiny", "tp": [1, 2], "seconds": 0.05, "repeat": 1},
    )
    add = parser.add_argument
    add("--model", choices=sorted(MODELS), default="llama-8b",
        help="head count, layers, head size (default %(default)s)")
    add("--tp", type=int, nargs="+", default=[1, 2, 4],
        help="TP sizes: a rank's share of the heads (default 1 2 4)")
    add("--chunk-tokens", type=int, default=256, help="tokens per chunk (default %(default)s)")
    add("--block-size", type=int, default=32, help="tokens per engine block (default %(default)s)")
    add("--seconds", type=float, default=0.5, help="seconds per measurement (default %(default)s)")
    parser.add_repeat(3, "repetitions (the table shows medians)")
    return parser.parse_args(argv)


def kv_caches(heads: int, layers: int, head_size: int, blocks: int, block_size: int, layout: str) -> dict[str, torch.Tensor]:
    out = {}
    for layer in range(layers):
        t = torch.randn(blocks, heads, block_size, 2 * head_size)
        out[f"l{layer}"] = t if layout == "LBHNC" else t.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    return out


def rate(fn: Callable[[], None], nbytes: int, seconds: float) -> float:
    fn()
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        done += 1
    return done * nbytes / (time.perf_counter() - start)


def measure(args: argparse.Namespace, tp: int, layout: str) -> dict[str, float]:
    total, layers, head_size = MODELS[args.model]
    local = max(1, total // tp)
    bpc = args.chunk_tokens // args.block_size
    caches = kv_caches(local, layers, head_size, bpc, args.block_size, layout)
    slicer = HeadSlicer.from_kv_caches(caches, bpc, local, bpc)
    regions = KVBlockLayout.from_kv_caches(caches, bpc).regions
    chunk = np.concatenate([r.numpy().reshape(-1) for r in regions])
    other = np.empty_like(chunk)
    shards = [np.empty(slicer.shard_bytes, dtype=np.uint8) for _ in range(local)]

    def cut() -> None:
        for head, buf in enumerate(shards):
            slicer.cut(chunk, head, buf)

    def join() -> None:
        for head, buf in enumerate(shards):
            slicer.join(buf, head, other)

    cut()
    join()
    assert np.array_equal(other, chunk), "join(cut(chunk)) differs from chunk"
    samples: dict[str, list[float]] = {"memcpy": [], "cut": [], "join": []}
    for _ in range(args.repeat):
        samples["memcpy"].append(rate(lambda: np.copyto(other, chunk), chunk.nbytes, args.seconds))
        samples["cut"].append(rate(cut, chunk.nbytes, args.seconds))
        samples["join"].append(rate(join, chunk.nbytes, args.seconds))
    med = {k: common.summarize(v)["median"] for k, v in samples.items()}
    return {"tp": tp, "layout": layout, "local_heads": local, "chunk_bytes": chunk.nbytes,
            "shard_bytes": slicer.shard_bytes, **{f"{k}_gbps": v / 1e9 for k, v in med.items()},
            "cut_ratio": med["cut"] / med["memcpy"], "join_ratio": med["join"] / med["memcpy"]}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    machine = common.machine_info(["numpy", "torch"])
    print(common.describe_machine(machine))
    cases = [(tp, layout) for tp in args.tp for layout in ("LBHNC", "LBNHC")]
    cases_bar = tqdm(cases, desc="shards", unit="case", disable=args.no_progress)
    results = [measure(args, tp, layout) for tp, layout in cases_bar]
    rows = [(r["tp"], r["layout"], r["local_heads"], common.kib_label(r["chunk_bytes"]), common.kib_label(r["shard_bytes"]),
             f"{r['memcpy_gbps']:.2f}", f"{r['cut_gbps']:.2f}", f"{r['join_gbps']:.2f}",
             f"{r['cut_ratio']:.2f}", f"{r['join_ratio']:.2f}") for r in results]
    common.print_table(["tp", "layout", "heads", "chunk", "shard", "memcpy GB/s", "cut GB/s", "join GB/s",
                 "cut/memcpy", "join/memcpy"], rows,
                f"store shards, {args.model}, {args.chunk_tokens}-token chunks (medians of {args.repeat})")
    common.save_results(args, results, machine)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
