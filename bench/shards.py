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

Run from the repository root: ``python -m bench.shards`` (``--help``).
Results: a table on stdout and ``bench/results/shards.json``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
from tqdm import tqdm

from bench.common import describe_machine, machine_info, print_table, summarize, write_result
from tiercache.layout import KVBlockLayout
from tiercache.shards import HeadSlicer

MODELS = {  # name: (KV heads, layers, head size), float32 KV (bf16 halves every size)
    "tiny": (2, 4, 64),
    "llama-8b": (8, 32, 128),
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.shards",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Example: python -m bench.shards --model llama-8b --tp 1 2 --chunk-tokens 256",
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="llama-8b", help="head count, layers, head size")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4], help="TP sizes (a rank's share of the heads)")
    parser.add_argument("--chunk-tokens", type=int, default=256, help="tokens per chunk")
    parser.add_argument("--block-size", type=int, default=32, help="tokens per engine block")
    parser.add_argument("--seconds", type=float, default=0.5, help="time per measurement")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions (the table shows medians)")
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
    med = {k: summarize(v)["median"] for k, v in samples.items()}
    return {"tp": tp, "layout": layout, "local_heads": local, "chunk_bytes": chunk.nbytes,
            "shard_bytes": slicer.shard_bytes, **{f"{k}_gbps": v / 1e9 for k, v in med.items()},
            "cut_ratio": med["cut"] / med["memcpy"], "join_ratio": med["join"] / med["memcpy"]}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    machine = machine_info(["numpy", "torch"])
    print(describe_machine(machine))
    cases = [(tp, layout) for tp in args.tp for layout in ("LBHNC", "LBNHC")]
    results = [measure(args, tp, layout) for tp, layout in tqdm(cases, desc="shards", unit="case")]
    rows = [(r["tp"], r["layout"], r["local_heads"], f"{r['chunk_bytes'] >> 10} KiB", f"{r['shard_bytes'] >> 10} KiB",
             f"{r['memcpy_gbps']:.2f}", f"{r['cut_gbps']:.2f}", f"{r['join_gbps']:.2f}",
             f"{r['cut_ratio']:.2f}", f"{r['join_ratio']:.2f}") for r in results]
    print_table(["tp", "layout", "heads", "chunk", "shard", "memcpy GB/s", "cut GB/s", "join GB/s",
                 "cut/memcpy", "join/memcpy"], rows,
                f"store shards, {args.model}, {args.chunk_tokens}-token chunks (medians of {args.repeat})")
    path = write_result("shards", results, vars(args), machine)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
