"""``tiercache demo``: a real vLLM engine with tiercache on a multi-round workload.

Builds a small random-weight Llama (no download), starts vLLM with the
TierCacheConnector and a host tier, and runs rounds of long prompts. Before
every round the engine's own prefix cache is reset, so round 1 is cold and the
later rounds can only hit through tiercache. Prints time-to-first-token per
round, the tokens tiercache served per tier (from its Prometheus counters),
and whether every warm round produced exactly the cold round's tokens.

The screen shows the demo's own progress and table; everything vLLM prints
(its log, warm-up warnings, worker output) goes to a log file the demo names
at the start (``--log``; ``--verbose`` leaves it on the screen instead).
``--hold SECONDS`` keeps the engine up after the table so that
``tiercache inspect engine URL`` (the URL the demo prints) can look at it.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, TextIO

from tqdm import tqdm


@dataclass
class RoundResult:
    name: str
    ttft_s: list[float]
    cached_tokens: int
    prompt_tokens: int
    tier_hits: dict[str, float]
    outputs: list[list[int]]


def _free_port() -> int:
    for port in range(29400, 29500):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port for the metrics endpoint in 29400-29499")


def _tier_hits(url: str) -> dict[str, float]:
    from tiercache.testing.engine_metrics import scrape_tiercache_metrics

    hits: dict[str, float] = {}
    for name, value in scrape_tiercache_metrics(url).items():
        if name.startswith("tiercache_hit_tokens_total"):
            tier = name.split('tier="', 1)[1].split('"', 1)[0]
            hits[tier] = hits.get(tier, 0.0) + value
    return hits


DEFAULT_LOG = pathlib.Path(tempfile.gettempdir()) / "tiercache-demo" / "vllm.log"


def run_demo(args: argparse.Namespace) -> int:
    if args.verbose:
        return _run(args, sys.stdout)
    from tiercache.cli.engine_log import log_to_file, tail

    log = pathlib.Path(args.log or DEFAULT_LOG).resolve()
    print(f"[demo] vLLM's own log goes to {log}", flush=True)
    with log_to_file(log) as console:
        try:
            return _run(args, console)
        except Exception as exc:  # noqa: BLE001 - shown with the log's tail, then exit 1
            print(f"\n[demo] failed: {type(exc).__name__}: {exc}\n[demo] last lines of {log}:\n"
                  f"{tail(log)}", file=console, flush=True)
            return 1


def _run(args: argparse.Namespace, console: TextIO) -> int:
    from tiercache.testing import engine_runner as er
    from tiercache.testing.random_llama import make_model_dir

    def say(text: str) -> None:
        print(text, file=console, flush=True)

    models = pathlib.Path(args.models_dir or pathlib.Path(tempfile.gettempdir()) / "tiercache-models")
    say(f"[demo] building the {args.model} random-weight model under {models} ...")
    model_dir = make_model_dir(args.model, models)
    port = _free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    config_file = pathlib.Path(args.config).resolve() if args.config else None
    extra: dict[str, Any] = {"metrics": {"port": port}, "chunk_tokens": args.chunk_tokens}
    if config_file:
        extra["config_file"] = str(config_file)
    spec: dict[str, Any] = {
        "model_dir": str(model_dir),
        "dtype": args.dtype,
        "block_size": 32,
        "max_model_len": max(2048, args.prompt_tokens + args.max_tokens + 32),
        "in_process": False,  # vLLM's usual processes, as `vllm serve` runs them
        "kv_transfer_config": {
            "kv_connector": "TierCacheConnector",
            "kv_connector_module_path": "tiercache.connector.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        },
    }
    er.apply_env(spec)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    say("[demo] starting vLLM with TierCacheConnector (about half a minute) ...")
    started = time.perf_counter()
    import vllm

    llm = vllm.LLM(**er.llm_kwargs(spec))
    try:
        say(f"[demo] engine up in {time.perf_counter() - started:.1f} s; to watch it from another shell: "
            f"tiercache inspect engine {url} --watch 1")
        er.generate(llm, er.random_prompts(2, 64, seed=999), 2)  # warm the kernels up
        results = _rounds(llm, args, url, console)
        _print_report(results, args, console)
        identical = all(r.outputs == results[0].outputs for r in results)
        say(f"\n[demo] warm rounds produced exactly the cold round's tokens: {identical}")
        if args.hold > 0:
            say(f"[demo] keeping the engine up for {args.hold:g} s (Ctrl-C ends it): "
                f"tiercache inspect engine {url}")
            _hold(args.hold)
    finally:
        _shutdown(llm)
    return 0 if identical else 1


def _hold(seconds: float) -> None:
    """Sleep up to ``seconds``; Ctrl-C (SIGINT) or SIGTERM ends it early.

    Our own handlers for the hold, not KeyboardInterrupt: vLLM's engine client may
    have put its own SIGINT handler in place, and then a Ctrl-C never reached the
    sleep (seen once: the demo held on for its whole --hold).
    """
    ended = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: ended.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        ended.wait(seconds)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _rounds(llm: Any, args: argparse.Namespace, url: str, console: TextIO) -> list[RoundResult]:
    from tiercache.testing import engine_runner as er

    prompts = er.random_prompts(args.prompts, args.prompt_tokens, seed=args.seed)
    results: list[RoundResult] = []
    before = _tier_hits(url)
    bars = {"file": console, "disable": not console.isatty()}  # bars on a terminal; a line per round always
    for index in tqdm(range(args.rounds), desc="rounds", unit="round", **bars):
        er.reset_prefix_cache(llm)  # the engine forgets; tiercache does not (retried: store pins)
        ttfts: list[float] = []
        outputs: list[list[int]] = []
        cached = 0
        started = time.perf_counter()
        for prompt in tqdm(prompts, desc="  prompts", leave=False, unit="req", **bars):
            (out,) = er.generate(llm, [prompt], args.max_tokens)
            rec = er.request_record(out, with_prompt=False)
            ttfts.append(rec["ttft_s"] or float("nan"))
            outputs.append(rec["output_token_ids"])
            cached += rec["num_cached_tokens"] or 0
        after = _tier_hits(url)
        hits = {t: after.get(t, 0.0) - before.get(t, 0.0) for t in after}
        before = after
        name = "cold" if index == 0 else f"warm {index}"
        tqdm.write(f"[demo] round {index + 1}/{args.rounds} ({name}): {len(prompts)} prompts in "
                   f"{time.perf_counter() - started:.1f} s, {cached} prompt tokens cached", file=console)
        results.append(RoundResult(name, ttfts, cached, len(prompts) * args.prompt_tokens, hits, outputs))
    return results


SHUTDOWN_TIMEOUT_S = 60.0


def _shutdown(llm: Any) -> None:
    """Stop the engine core now, so its exit is not reported as 'exited unexpectedly' at interpreter exit.

    Bounded: a shutdown still running after ``SHUTDOWN_TIMEOUT_S`` is reported and the demo
    exits without waiting for it (vLLM's processes end when their parent does).
    """
    def stop() -> None:
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception as exc:  # noqa: BLE001 - best effort; vLLM's finalizer still runs at exit
            print(f"[demo] engine shutdown: {type(exc).__name__}: {exc}", file=sys.stderr)

    stopper = threading.Thread(target=stop, name="demo-engine-shutdown", daemon=True)
    stopper.start()
    stopper.join(SHUTDOWN_TIMEOUT_S)
    if stopper.is_alive():
        print(f"[demo] the engine did not shut down within {SHUTDOWN_TIMEOUT_S:g} s; leaving it", file=sys.stderr)
        sys.stdout.flush()
        os._exit(0)


def _print_report(results: list[RoundResult], args: argparse.Namespace, console: TextIO) -> None:
    def say(text: str) -> None:
        print(text, file=console, flush=True)

    say(
        f"\n{args.prompts} prompts x {args.prompt_tokens} tokens, model {args.model} ({args.dtype}), "
        f"{args.chunk_tokens}-token chunks; engine prefix cache reset before every round\n"
    )
    header = f"{'round':<8} {'mean TTFT':>10} {'p50 TTFT':>9} {'cached/prompt tokens':>21}  tiercache hits by tier"
    say(header)
    say("-" * len(header))
    cold = statistics.fmean(results[0].ttft_s)
    for r in results:
        mean = statistics.fmean(r.ttft_s)
        hits = ", ".join(f"{t}: {int(v)} tok" for t, v in r.tier_hits.items() if v) or "-"
        speed = f"  ({cold / mean:.1f}x faster)" if r is not results[0] and mean > 0 else ""
        say(
            f"{r.name:<8} {mean * 1000:>8.0f}ms {statistics.median(r.ttft_s) * 1000:>7.0f}ms "
            f"{r.cached_tokens:>10}/{r.prompt_tokens:<10}  {hits}{speed}"
        )


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="run a vLLM engine with tiercache on a multi-round workload",
        description=(__doc__ or "").replace("``", "`"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  tiercache demo --model heavy --rounds 3 --prompt-tokens 2048",
    )
    p.add_argument("--model", choices=("tiny", "heavy"), default="heavy",
                   help="test model: heavy (8 layers, 1024 hidden) shows prefill savings; tiny is fastest")
    p.add_argument("--dtype", default="float32", help="engine dtype (float32 is bitwise reproducible)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; the first is cold")
    p.add_argument("--prompts", type=int, default=4, help="distinct prompts per round")
    p.add_argument("--prompt-tokens", type=int, default=1536, help="tokens per prompt")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per prompt")
    p.add_argument("--chunk-tokens", type=int, default=256, help="tiercache chunk size in tokens")
    p.add_argument("--config", help="a tiercache YAML file (default: built-in host tier of 4 GiB)")
    p.add_argument("--models-dir", help="where the random-weight model is written")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--log", metavar="FILE", help=f"where vLLM's own output goes (default {DEFAULT_LOG})")
    p.add_argument("--verbose", action="store_true", help="show vLLM's output on the screen instead of --log")
    p.add_argument("--hold", type=float, default=0.0, metavar="SECONDS",
                   help="keep the engine up this long after the table, to `tiercache inspect engine` it")
    p.set_defaults(func=run_demo)
