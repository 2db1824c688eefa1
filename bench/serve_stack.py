"""What bench/serve.py starts: the model with a tokenizer, the OpenAI server, the stores, vLLM's load generator.

* :func:`prepare_model`: a random-weight test model (tiercache/testing/random_llama.py)
  with the word-level tokenizer of tiercache/testing/word_tokenizer.py, which the
  load generator's ``prefix_repetition`` dataset needs.
* :func:`plan_sizes`: the engine's KV blocks (smaller than the prefix working set),
  the ideal's (every block the run ever makes), the tiers' capacities.
* :func:`kv_transfer_config`: the connector config of each case.
* :class:`OpenAIServer`: ``python -m vllm.entrypoints.openai.api_server`` (what
  ``vllm serve`` runs) in its own process group, with ``VLLM_SERVER_DEV_MODE=1``
  for ``/reset_prefix_cache``; its log in the work folder. Every case's compute
  threads are bound to the same cores (:func:`omp_bind`).
* :func:`run_load`: ``vllm.benchmarks.serve`` (the code of ``vllm bench serve``) in a
  subprocess, its parser built with ``add_cli_args`` on a ``FlexibleArgumentParser``
  (the module has no ``__main__`` guard). A subprocess, not in-process, because
  that module seeds the global RNGs, freezes the GC heap and prints its own
  report and progress bar; its own process keeps those apart from this one, the
  exact command line it ran is the one a user would give ``vllm bench serve``
  (kept in the results), and its progress bar is read from its output to show ours.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tiercache.testing.random_llama import make_model_dir
from tiercache.testing.word_tokenizer import write_word_tokenizer

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 32  # vLLM's CPU backend needs a multiple of 32
LOADGEN = (
    "import sys\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "parser = FlexibleArgumentParser(description='vllm bench serve')\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)
def omp_bind() -> str:
    """The cores every case's compute threads run on (``VLLM_CPU_OMP_THREADS_BIND``): the user's
    setting, else every usable core but the last.

    Without it the cases would not run the same engine: vLLM's CPU platform
    reserves one core per rank for its engine-core process, and one more per
    rank when a ``--kv-transfer-config`` is given (meant for NixlConnector's
    threads, vllm/utils/ompmultiprocessing.py). On two cores that second
    reservation cannot be met, so every case with a connector ran its compute
    threads on both cores, spinning against the engine core and the API server,
    while the cases without one used one core: measured on the tiny model, the
    host tier then served 0.43x the ideal's requests/s instead of 1.00x.
    """
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        return os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    cores = sorted(os.sched_getaffinity(0))
    return ",".join(map(str, cores[:-1] if len(cores) > 1 else cores))


PROGRESS = re.compile(rb"(\d+)/(\d+) \[")
# (the faults by reason go into each run's JSON: a hit lost to a full host tier is staging_no_slot)
METRIC_NAMES = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "tiercache_hit_tokens_total",
                "tiercache_faults_total")


def prepare_model(name: str, root: Path) -> tuple[Path, dict[str, Any]]:
    """``root/<name>/`` with weights, config and tokenizer; and its config."""
    model = write_word_tokenizer(make_model_dir(name, root))
    return model, json.loads((model / "config.json").read_text())


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int = 4) -> int:
    """K and V of every layer for one token (float32: 4 bytes per value)."""
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    kv_heads = int(config.get("num_key_value_heads", heads))
    return 2 * int(config["num_hidden_layers"]) * kv_heads * head_dim * dtype_bytes


@dataclasses.dataclass(frozen=True)
class Sizes:
    """KV sizes for one prefix length; blocks are vLLM's (32 tokens), bytes are tiercache's capacities."""

    block_bytes: int
    working_set_blocks: int  # every prefix once
    engine_blocks: int  # the engine's own KV (--num-gpu-blocks-override): below the working set
    ideal_blocks: int  # every block the run makes: each repeat is a prefix-cache hit
    host_bytes: int  # the host tier of the "host" case: holds every chunk
    small_host_bytes: int  # the host tier in front of disk / Redis / the cache server
    store_bytes: int  # the lower tier (and the cache server's memory): holds every chunk

    def kv_space_gib(self, blocks: int) -> int:
        """VLLM_CPU_KVCACHE_SPACE for ``blocks`` (whole GiB, one spare)."""
        return math.ceil(blocks * self.block_bytes / (1 << 30)) + 1


def plan_sizes(bytes_per_token: int, *, prefix_len: int, suffix_len: int, output_len: int, num_prefixes: int,
               prompts: int, concurrency: int, engine_fraction: float, engine_blocks: int | None,
               host_bytes: int | None, small_host_bytes: int | None) -> Sizes:
    """The sizes of one prefix length (see :class:`Sizes`); given values win over the defaults."""
    block_bytes = bytes_per_token * BLOCK
    per_request = math.ceil((prefix_len + suffix_len + output_len) / BLOCK) + 1
    working = num_prefixes * prefix_len // BLOCK
    engine = engine_blocks or max(math.ceil(working * engine_fraction), (concurrency + 1) * per_request)
    ideal = working + prompts * (math.ceil((suffix_len + output_len) / BLOCK) + 2) + concurrency * per_request
    every_token = (num_prefixes * prefix_len + prompts * (suffix_len + output_len)) * bytes_per_token
    return Sizes(block_bytes=block_bytes, working_set_blocks=working, engine_blocks=engine, ideal_blocks=ideal,
                 host_bytes=host_bytes or 2 * every_token + (64 << 20),
                 small_host_bytes=small_host_bytes or max(working * block_bytes // 4, 1 << 20),
                 store_bytes=2 * every_token + (64 << 20))


def kv_transfer_config(case: str, sizes: Sizes, chunk_tokens: int, workdir: Path,
                       redis_url: str | None = None, server_address: str | None = None) -> dict[str, Any] | None:
    """The ``--kv-transfer-config`` of a case; None for ``none`` and ``ideal`` (no connector)."""
    if case in ("none", "ideal"):
        return None
    if case == "host":
        tiers = [{"name": "cpu", "backend": "cpu", "capacity": sizes.host_bytes}]
    else:
        tiers = [{"name": "cpu", "backend": "cpu", "capacity": sizes.small_host_bytes}]
        if case == "disk":
            root = workdir / "disk-tier"
            root.mkdir(parents=True, exist_ok=True)
            tiers.append({"name": "disk", "backend": "disk", "capacity": sizes.store_bytes,
                          "mode": "write_through", "options": {"root": str(root)}})
        elif case == "redis":
            tiers.append({"name": "redis", "backend": "redis", "capacity": sizes.store_bytes,
                          "options": {"url": redis_url}})
        elif case == "server":
            tiers.append({"name": "server", "backend": "server", "capacity": sizes.store_bytes,
                          "options": {"address": server_address, "data_path": "tcp", "timeout_s": 30}})
        else:
            raise ValueError(f"unknown case {case!r}")
    return {"kv_connector": "TierCacheConnector", "kv_connector_module_path": "tiercache.connector.vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": {"chunk_tokens": chunk_tokens, "tiers": tiers}}


def free_port() -> int:
    """A free loopback port below 32768 (outside the kernel's ephemeral range)."""
    from tests.server.harness import free_port as pick

    return pick()


def _post(url: str, timeout: float = 120) -> Any:
    req = urllib.request.Request(url, b"{}", {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        body = resp.read()
    try:
        return json.loads(body or b"null")
    except ValueError:
        return body.decode(errors="replace")


class OpenAIServer:
    """One ``python -m vllm.entrypoints.openai.api_server`` in its own process group."""

    def __init__(self, model: Path, served_name: str, *, blocks: int, kv_space_gib: int, max_model_len: int,
                 kv_transfer: dict[str, Any] | None, log: Path, dtype: str = "float32") -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", served_name, "--dtype", dtype, "--block-size", str(BLOCK),
            "--max-model-len", str(max_model_len), "--enforce-eager", "--num-gpu-blocks-override", str(blocks),
            "--host", "127.0.0.1", "--port", str(self.port),
        ]
        if kv_transfer is not None:
            self.command += ["--kv-transfer-config", json.dumps(kv_transfer)]
        self.env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib), "VLLM_SERVER_DEV_MODE": "1",
                    "VLLM_CPU_OMP_THREADS_BIND": omp_bind(),
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float) -> OpenAIServer:
        """Start and wait for /health (raises with the log's tail when it exits or times out)."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                         cwd=ROOT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the OpenAI server exited {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2):
                    return self
            except OSError:
                time.sleep(1)
        raise RuntimeError(f"the OpenAI server was not healthy after {timeout:.0f}s:\n{self.tail()}")

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def reset(self) -> None:
        """Empty vLLM's prefix cache and tiercache's host tier (retried while blocks are in use)."""
        deadline = time.monotonic() + 60
        while True:
            reply = _post(f"{self.base}/reset_prefix_cache?reset_external=true")
            if not isinstance(reply, dict) or reply.get("success", True):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"reset_prefix_cache kept failing: {reply}")
            time.sleep(0.5)

    def metrics(self) -> dict[str, float]:
        """The counters the report uses, from /metrics (empty when it cannot be read)."""
        from bench.serve_report import parse_metrics

        try:
            with urllib.request.urlopen(self.base + "/metrics", timeout=30) as resp:
                return parse_metrics(resp.read().decode(errors="replace"), METRIC_NAMES)
        except OSError:
            return {}

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL after 30 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def load_args(server: OpenAIServer, served_name: str, model: Path, *, prefix_len: int, suffix_len: int,
              output_len: int, num_prefixes: int, prompts: int, concurrency: int, seed: int,
              result_dir: Path, result_name: str) -> list[str]:
    """The ``vllm bench serve`` options of one run: prefix_repetition, greedy, fixed output length."""
    return [
        "--backend", "openai", "--base-url", server.base, "--endpoint", "/v1/completions",
        "--model", served_name, "--tokenizer", str(model),
        "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(prefix_len),
        "--prefix-repetition-suffix-len", str(suffix_len), "--prefix-repetition-num-prefixes", str(num_prefixes),
        "--prefix-repetition-output-len", str(output_len), "--num-prompts", str(prompts),
        "--max-concurrency", str(concurrency), "--request-rate", "inf", "--ignore-eos", "--temperature", "0",
        "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        # no ready-check request: it would send the first prompt once before the run (a free hit)
        "--ready-check-timeout-sec", "0", "--num-warmups", "0",
        "--save-result", "--result-dir", str(result_dir), "--result-filename", result_name,
    ]


def run_load(options: Sequence[str], log: Path, bar: tqdm | None, timeout: float) -> dict[str, Any]:
    """Run the load generator with ``options``; its result JSON. ``bar`` follows its request count."""
    result = Path(options[options.index("--result-dir") + 1]) / options[options.index("--result-filename") + 1]
    result.unlink(missing_ok=True)
    total = int(options[options.index("--num-prompts") + 1])
    if bar is not None:
        bar.reset(total=total)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-c", LOADGEN, *options]
    deadline = time.monotonic() + timeout
    with open(log, "ab") as out:
        out.write(("$ vllm bench serve " + " ".join(options) + "\n").encode())
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
        assert proc.stdout is not None
        counting = False
        try:
            for chunk in iter(lambda: proc.stdout.read1(4096), b""):  # type: ignore[union-attr]
                out.write(chunk)
                done = [int(n) for n, of in PROGRESS.findall(chunk) if int(of) == total]
                if bar is not None and done:
                    if not counting:  # its first bar: the imports are over, the requests start now
                        counting = True
                        bar.reset(total=total)
                    bar.n = max(done)
                    bar.refresh()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the load generator ran past {timeout:.0f}s; see {log}")
            proc.wait()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if proc.returncode != 0 or not result.is_file():
        raise RuntimeError(f"the load generator failed (exit {proc.returncode}); see {log}")
    return json.loads(result.read_text())
