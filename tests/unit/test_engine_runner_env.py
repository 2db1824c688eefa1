"""The engine runner's environment step: ``cpus`` pins the whole engine process before vLLM starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tiercache.testing.engine_runner import REPO_ROOT

PROBE = """
import json, os, sys
from tiercache.testing.engine_runner import apply_env
apply_env(json.loads(sys.argv[1]))
child = os.fork()
if child == 0:  # what vLLM's front-end, engine core and workers inherit
    os.write(1, json.dumps(sorted(os.sched_getaffinity(0))).encode() + b"\\n")
    os._exit(0)
os.waitpid(child, 0)
print(json.dumps({"omp": os.environ["VLLM_CPU_OMP_THREADS_BIND"], "kv": os.environ["VLLM_CPU_KVCACHE_SPACE"]}))
"""


def probe(spec: dict) -> tuple[list[int], dict]:
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(spec)], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=60, check=True).stdout.splitlines()
    return json.loads(out[0]), json.loads(out[1])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to tell pinned from unpinned")
def test_cpus_pin_the_engine_and_its_children() -> None:
    mine = sorted(os.sched_getaffinity(0))
    cpus, env = probe({"cpus": [mine[-1]], "env": {"VLLM_CPU_OMP_THREADS_BIND": str(mine[-1])}})
    assert cpus == [mine[-1]] and env == {"omp": str(mine[-1]), "kv": "1"}
    unpinned, _ = probe({})
    assert unpinned == mine  # without cpus, nothing changes
