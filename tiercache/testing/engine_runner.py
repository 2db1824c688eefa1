"""Runs a real vLLM engine from a JSON spec, in a subprocess, for end-to-end tests.

This is the engine side: the script
``python -m tiercache.testing.engine_runner --spec spec.json --out result.json``
sets the environment, imports vLLM, builds one ``vllm.LLM``, runs every round
of the spec in order, and writes the result as JSON. The demo also calls its
steps (``apply_env``, ``llm_kwargs``, ``generate``, ``request_record``).

The test side, which starts this script in a fresh process group, enforces a
timeout and returns the result (``run_engine(spec)``, :class:`EngineRun`,
``random_prompts(...)``), lives in :mod:`tiercache.testing.engine_launch`;
its names are re-exported here, where tests and benchmarks import them from.

Spec (JSON object; only ``model_dir`` and ``rounds`` are required)::

    model_dir                str    checkpoint directory (see model_factory.make_model_dir)
    dtype                    str    default "float32"
    block_size               int    multiple of 32, default 32
    max_model_len            int    default 4096
    num_gpu_blocks_override  int    optional: shrink the engine's own KV cache
    max_num_batched_tokens   int    optional: small values force chunked prefill
    max_num_seqs             int    optional
    enable_prefix_caching    bool   default true
    kv_transfer_config       dict   or null; passed as KVTransferConfig(**dict)
    kv_events_config         dict   optional; passed as KVEventsConfig(**dict) (vLLM's KV events publisher)
    seed                     int    default 0
    log_stats                bool   default true (needed for per-request ttft and get_metrics)
    llm_kwargs               dict   optional extra keyword arguments for vllm.LLM
    tiercache_metrics_url    str    optional: scrape tiercache_* samples from this URL after each round
    env                      dict   env vars set before importing vLLM (override the defaults
                                    VLLM_CPU_KVCACHE_SPACE=1, VLLM_CPU_OMP_THREADS_BIND=0)
    in_process               "all" | "core" | false: vLLM processes run inside the runner. "all":
                                    engine core and a TP=1 worker; "core": the engine core (workers
                                    apart: metadata still crosses to them); false: vLLM's usual
                                    processes (as ``vllm serve``). Same tokens; ~7 s less start-up
                                    per process saved. Default "all" without kv_transfer_config,
                                    else "core"; benchmarks and P/D tests set false
    cpus                     list   optional: CPU ids the whole engine (front-end, engine core,
                                    workers; children inherit it) may run on. Without it only
                                    the workers' compute threads are bound (VLLM_CPU_OMP_THREADS_BIND)
    rounds                   list   of rounds, run in order on the same engine:
      {"prompts": [[ids], ...], "max_tokens": int,
       "reset_prefix_cache_before": bool = false,   # LLM.reset_prefix_cache() first
       "reset_connector": bool = false,             # ... with reset_connector=True
       "warmup": bool = false,                      # only recorded, for consumers
       "sequential": bool = false,                  # one request at a time (clean TTFT)
       "barrier": str = null,                       # wait for the test before this round
       "kv_transfer_params": dict | [dict, ...],    # per request (P/D), or one for all
       "kv_transfer_params_file": str}              # ... read from this JSON file at round start
      or {"conversation": {"first_prompt": [ids], "turns": N,
                           "user_tokens_per_turn": [[ids], ...],  # >= N-1 entries
                           "max_tokens": int,
                           "reset_prefix_cache_between_turns": bool = false},
          "reset_prefix_cache_before": ..., "reset_connector": ..., "warmup": ...}
      (turn i > 0 sends prompt(i-1) + output(i-1) + user_tokens_per_turn[i-1]).
      or {"worker_call": "package.module:function", "kwargs": {...}}
      (runs ``function(worker, **kwargs)`` in every vLLM worker through LLM.collective_rpc
      and records what each returned; the engine needs VLLM_ALLOW_INSECURE_SERIALIZATION=1
      in ``env``. Benchmarks use it to measure inside the engine, e.g. raw_nixl.read_in_worker).
    barrier_dir              str    directory for round barriers (set by EngineRun); on reaching
                                    one, the rounds so far are written to NAME.partial.json
    barrier_timeout_s        float  default 300: longest wait at one barrier

A round with ``"barrier": NAME`` lets a test act in the middle of an engine's
life (kill a shared tier, restart it): before the round, the runner creates
``barrier_dir/NAME.reached`` and waits until ``barrier_dir/NAME.go`` exists.
With :class:`EngineRun` the test calls ``wait_for(NAME)``, does its work, then
``release(NAME)``, and the round starts at once.

Result (JSON object)::

    vllm_version, runner_pid, engine_start_s, total_s,
    rounds: [{index, kind ("prompts" | "conversation" | "worker_call"), warmup, reset_prefix_cache_before,
              wall_s, turn_wall_s (conversation only), results (worker_call only: one per worker),
              requests: [{prompt_len, output_token_ids, num_cached_tokens,
                          ttft_s, queued_s, prefill_s,   # null when vLLM gives no metrics
                          decode_s,                      # first token to last: the decode steps
                          prompt_token_ids (conversation only)}],
              metrics: {name[{labels}]: value} | {"error": str}}],
    connector_shutdown: "ok" | "none" (no kv_transfer_config) | the error   (see shut_down_connector)

``metrics`` holds the cumulative ``LLM.get_metrics()`` entries whose name mentions
the KV connector, the prefix cache, external hits or cached prompt tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
from collections.abc import Sequence
from typing import Any

from tiercache.testing.engine_launch import (
    REPO_ROOT,
    EngineRun,
    random_prompts,
    run_engine,
)
from tiercache.testing.engine_metrics import cache_metrics, scrape_tiercache_metrics

__all__ = [
    "DEFAULT_ENV",
    "REPO_ROOT",
    "EngineRun",
    "apply_env",
    "generate",
    "in_process",
    "llm_kwargs",
    "main",
    "random_prompts",
    "request_record",
    "reset_prefix_cache",
    "round_kv_params",
    "run_engine",
    "run_spec",
    "wait_at_barrier",
    "worker_pid",
]

DEFAULT_ENV: dict[str, str] = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "0",
}


def apply_env(spec: dict[str, Any]) -> None:
    if spec.get("cpus"):
        os.sched_setaffinity(0, {int(c) for c in spec["cpus"]})  # before vLLM spawns anything
    for key, value in DEFAULT_ENV.items():
        os.environ.setdefault(key, value)
    if in_process(spec):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    for key, value in (spec.get("env") or {}).items():
        os.environ[str(key)] = str(value)


def in_process(spec: dict[str, Any]) -> str | None:
    """Which of vLLM's processes run in the runner: "all", "core" or None (spec ``in_process``)."""
    value = spec.get("in_process", "core" if spec.get("kv_transfer_config") else "all")
    if value not in ("all", "core", None, False):
        raise ValueError(f'in_process must be "all", "core" or false, got {value!r}')
    return str(value) if value else None


def llm_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    block_size = int(spec.get("block_size", 32))
    if block_size % 32:
        raise ValueError(f"block_size must be a multiple of 32 on CPU, got {block_size}")
    kwargs: dict[str, Any] = {
        "model": spec["model_dir"],
        "skip_tokenizer_init": True,
        "dtype": spec.get("dtype", "float32"),
        "block_size": block_size,
        "max_model_len": int(spec.get("max_model_len", 4096)),
        "enforce_eager": True,
        "seed": int(spec.get("seed", 0)),
        "enable_prefix_caching": bool(spec.get("enable_prefix_caching", True)),
        "disable_log_stats": not bool(spec.get("log_stats", True)),
    }
    for key in ("num_gpu_blocks_override", "max_num_batched_tokens", "max_num_seqs"):
        if spec.get(key) is not None:
            kwargs[key] = int(spec[key])
    if spec.get("kv_transfer_config"):
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer_config"])
    if spec.get("kv_events_config"):
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(**spec["kv_events_config"])
    kwargs.update(spec.get("llm_kwargs") or {})
    layout = in_process(spec)
    if layout == "all" and int(kwargs.get("tensor_parallel_size", 1)) == 1:
        kwargs.setdefault("distributed_executor_backend", "uni")
    elif layout == "core":
        kwargs.setdefault("distributed_executor_backend", "mp")  # workers in processes of their own
    return kwargs


def _timing(metrics: Any) -> dict[str, float | None]:
    """Per-request timings from RequestOutput.metrics (RequestStateStats in vLLM 0.32)."""
    def get(name: str) -> float | None:
        value = getattr(metrics, name, None)
        return float(value) if value else None

    first, sched, queued = get("first_token_ts"), get("scheduled_ts"), get("queued_ts")
    last = get("last_token_ts")
    return {
        "ttft_s": get("first_token_latency"),
        "queued_s": sched - queued if sched and queued else None,
        "prefill_s": first - sched if first and sched else None,
        "decode_s": last - first if last and first else None,
    }


def request_record(output: Any, with_prompt: bool) -> dict[str, Any]:
    prompt = list(output.prompt_token_ids or [])
    record: dict[str, Any] = {
        "prompt_len": len(prompt),
        "output_token_ids": list(output.outputs[0].token_ids),
        "num_cached_tokens": output.num_cached_tokens,
        "kv_transfer_params": getattr(output, "kv_transfer_params", None),
        **_timing(output.metrics),
    }
    if with_prompt:
        record["prompt_token_ids"] = prompt
    return record


def generate(llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int,
             kv_params: Sequence[dict[str, Any] | None] | None = None) -> list[Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def params(kv: dict[str, Any] | None) -> Any:
        extra = {"kv_transfer_params": kv} if kv else None
        return SamplingParams(temperature=0, max_tokens=int(max_tokens), ignore_eos=True,
                              detokenize=False, extra_args=extra)

    batch = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
    per_request = [params(kv) for kv in (kv_params or [None] * len(batch))]
    return llm.generate(batch, per_request, use_tqdm=False)


def reset_prefix_cache(llm: Any, reset_connector: bool = False, timeout_s: float = 5.0,
                       what: str = "reset_prefix_cache()") -> None:
    """``llm.reset_prefix_cache()``, retried until it succeeds; raises if it still fails after ``timeout_s``.

    vLLM's reset fails (returns False) while any KV block is referenced. Right after
    ``LLM.generate`` returns, tiercache's connector may still pin the blocks of the last
    step's stores until every worker reported their copies done (connector/store_pins.py);
    the engine core keeps stepping meanwhile (``has_pending_push_work``), so the pins go
    within a step or two. With ``reset_connector`` each try also resets the connector: the
    try that succeeds comes after every store finished, so none lands after the reset.
    """
    deadline = time.monotonic() + timeout_s
    while not llm.reset_prefix_cache(reset_connector=reset_connector):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} returned False for {timeout_s:g} s: some KV blocks stay referenced")
        time.sleep(0.01)


def round_kv_params(rnd: dict[str, Any], n: int) -> list[dict[str, Any] | None] | None:
    """The round's per-request kv_transfer_params (inline or from a file), or None."""
    value = rnd.get("kv_transfer_params")
    if rnd.get("kv_transfer_params_file"):
        value = json.loads(pathlib.Path(rnd["kv_transfer_params_file"]).read_text())
    if value is None:
        return None
    if isinstance(value, dict):
        return [value] * n
    if len(value) != n:
        raise ValueError(f"kv_transfer_params: {len(value)} entries for {n} prompts")
    return list(value)


def _run_prompts(llm: Any, rnd: dict[str, Any]) -> dict[str, Any]:
    kv = round_kv_params(rnd, len(rnd["prompts"]))
    start = time.perf_counter()
    if rnd.get("sequential"):
        # One request at a time: time-to-first-token is then prefill time, not queueing.
        outputs = [generate(llm, [p], rnd["max_tokens"], [kv[i]] if kv else None)[0]
                   for i, p in enumerate(rnd["prompts"])]
    else:
        outputs = generate(llm, rnd["prompts"], rnd["max_tokens"], kv)
    wall = time.perf_counter() - start
    records = [request_record(o, with_prompt=False) for o in outputs]
    return {"kind": "prompts", "wall_s": wall, "requests": records}


def _run_conversation(llm: Any, conv: dict[str, Any]) -> dict[str, Any]:
    turns = int(conv["turns"])
    user_tokens = conv.get("user_tokens_per_turn") or []
    if len(user_tokens) < turns - 1:
        raise ValueError(f"conversation needs >= {turns - 1} user_tokens_per_turn entries")
    prompt = list(conv["first_prompt"])
    records: list[dict[str, Any]] = []
    turn_walls: list[float] = []
    reset_between = bool(conv.get("reset_prefix_cache_between_turns", False))
    for turn in range(turns):
        if turn:
            prompt = prompt + records[-1]["output_token_ids"] + list(user_tokens[turn - 1])
            if reset_between:
                reset_prefix_cache(llm, what=f"conversation turn {turn}: reset_prefix_cache()")
        start = time.perf_counter()
        (output,) = generate(llm, [prompt], conv["max_tokens"])
        turn_walls.append(time.perf_counter() - start)
        records.append(request_record(output, with_prompt=True))
    return {"kind": "conversation", "wall_s": sum(turn_walls), "turn_wall_s": turn_walls,
            "requests": records}


def _run_worker_call(llm: Any, rnd: dict[str, Any]) -> dict[str, Any]:
    import importlib

    module_name, _, function_name = str(rnd["worker_call"]).partition(":")
    function = getattr(importlib.import_module(module_name), function_name)
    start = time.perf_counter()
    results = llm.collective_rpc(function, kwargs=dict(rnd.get("kwargs") or {}))
    return {"kind": "worker_call", "wall_s": time.perf_counter() - start, "requests": [],
            "results": list(results)}


def worker_pid(worker: Any) -> int:
    """A ``worker_call`` for self-checks: the pid of the process the worker runs in."""
    del worker
    return os.getpid()


def wait_at_barrier(spec: dict[str, Any], name: str, rounds_so_far: list[dict[str, Any]]) -> None:
    """Write the rounds so far, signal ``name``.reached, wait for ``name``.go in barrier_dir."""
    directory = spec.get("barrier_dir")
    if not directory:
        raise ValueError(f"round barrier {name!r} needs barrier_dir (run through EngineRun)")
    base = pathlib.Path(directory)
    _write_json_atomic(base / f"{name}.partial.json", {"rounds": rounds_so_far})
    (base / f"{name}.reached").touch()
    deadline = time.monotonic() + float(spec.get("barrier_timeout_s", 300))
    while not (base / f"{name}.go").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"nobody released barrier {name!r}")
        time.sleep(0.05)
    print(f"[engine_runner] released from barrier {name!r}", flush=True)


def _run_round(llm: Any, index: int, rnd: dict[str, Any], metrics_url: str | None = None) -> dict[str, Any]:
    reset = bool(rnd.get("reset_prefix_cache_before", False))
    if reset:
        reset_prefix_cache(llm, bool(rnd.get("reset_connector", False)), what=f"round {index}: reset_prefix_cache()")
    if "conversation" in rnd:
        result = _run_conversation(llm, rnd["conversation"])
    elif "worker_call" in rnd:
        result = _run_worker_call(llm, rnd)
    else:
        result = _run_prompts(llm, rnd)
    result.update(index=index, warmup=bool(rnd.get("warmup", False)),
                  reset_prefix_cache_before=reset, metrics=cache_metrics(llm),
                  tiercache_metrics=scrape_tiercache_metrics(metrics_url))
    return result


def _write_json_atomic(path: pathlib.Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def run_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the engine and run every round (in this process; call from the script)."""
    apply_env(spec)
    import vllm

    t0 = time.perf_counter()
    llm = vllm.LLM(**llm_kwargs(spec))
    engine_start = time.perf_counter() - t0
    url = spec.get("tiercache_metrics_url")
    rounds = []
    for i, rnd in enumerate(spec["rounds"]):
        if rnd.get("barrier"):
            wait_at_barrier(spec, str(rnd["barrier"]), rounds)
        rounds.append(_run_round(llm, i, rnd, url))
    total_s = time.perf_counter() - t0  # the rounds', not the shutdown's
    return {"vllm_version": vllm.__version__, "runner_pid": os.getpid(), "engine_start_s": engine_start,
            "total_s": total_s, "rounds": rounds, "connector_shutdown": shut_down_connector(llm, spec)}


def shut_down_connector(llm: Any, spec: dict[str, Any]) -> str:
    """Shut every worker's KV connector down (tiercache's waits for its copies and lower-tier writes
    in flight), before the result exists: the launcher kills the engine's processes as soon as it does.

    vLLM's own exit would not do it (on SIGTERM its engine core aborts, workers exit without the
    connector's shutdown) and costs ~5-10 s of waiting per engine. ``"ok"``, ``"none"``, or the error.
    """
    if not spec.get("kv_transfer_config"):
        return "none"
    try:
        llm.collective_rpc("shutdown")  # vLLM's Worker.shutdown: ensure_kv_transfer_shutdown() first
    except Exception as exc:  # noqa: BLE001 - recorded; the rounds' results stand
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def main(argv: list[str] | None = None) -> int:
    """Script entry point: run the spec, write the result."""
    parser = argparse.ArgumentParser(description="Run a vLLM engine over a JSON spec.")
    parser.add_argument("--spec", type=pathlib.Path, required=True)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args(argv)
    result = run_spec(json.loads(args.spec.read_text()))
    _write_json_atomic(args.out, result)
    print(f"[engine_runner] wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
