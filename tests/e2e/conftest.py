"""Shared fixtures for end-to-end tests: random-weight models, free ports, connector configs.

Every engine runs in a subprocess (tiercache.testing.engine_runner) with a
timeout; nothing here imports vLLM into the pytest process.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from tiercache.testing.ports import free_port  # noqa: F401 - tests import it from here
from tiercache.testing.random_llama import make_model_dir


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/e2e/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model(models_root: pathlib.Path) -> pathlib.Path:
    return make_model_dir("tiny", models_root)


def tiercache_kv_config(
    chunk_tokens: int,
    lower_tiers: list[dict[str, Any]],
    metrics_port: int | None = None,
    host_capacity: str | int = "64MiB",
    kv_role: str = "kv_both",
    **extra: Any,
) -> dict[str, Any]:
    """A ``kv_transfer_config`` dict for TierCacheConnector: a host tier, then ``lower_tiers``.

    ``extra`` goes into tiercache's own config next to ``chunk_tokens`` and ``tiers``.
    """
    config: dict[str, Any] = {
        "chunk_tokens": chunk_tokens,
        "tiers": [{"name": "cpu", "backend": "cpu", "capacity": host_capacity}, *lower_tiers],
        **extra,
    }
    if metrics_port is not None:
        config["metrics"] = {"port": metrics_port}
    return {
        "kv_connector": "TierCacheConnector",
        "kv_connector_module_path": "tiercache.connector.vllm",
        "kv_role": kv_role,
        "kv_connector_extra_config": config,
    }


def engine_spec(model: pathlib.Path, chunk_tokens: int, lower_tiers: list[dict[str, Any]] | None,
                rounds: list[dict[str, Any]], kv_extra: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    """An engine runner spec: the model in float32, 32-token blocks, and (``lower_tiers`` not None)
    tiercache with a host tier, those tiers and its metrics on a free port (``kv_extra``: more
    arguments of :func:`tiercache_kv_config`); ``spec`` adds or overrides keys."""
    port = free_port() if lower_tiers is not None else None
    kv = None if lower_tiers is None else \
        tiercache_kv_config(chunk_tokens, lower_tiers, metrics_port=port, **(kv_extra or {}))
    return {
        "model_dir": str(model),
        "dtype": "float32",
        "block_size": 32,
        "max_model_len": 1024,
        "kv_transfer_config": kv,
        "tiercache_metrics_url": f"http://127.0.0.1:{port}/metrics" if port else None,
        "rounds": rounds,
        **spec,
    }


def cached(result: dict[str, Any], rnd: int) -> list[int]:
    """The tokens vLLM counted as cached for each request of round ``rnd`` of an engine runner result."""
    return [r["num_cached_tokens"] for r in result["rounds"][rnd]["requests"]]


def metric_delta(result: dict[str, Any], rnd: int, prefix: str, label: str = "") -> float:
    """The growth of the tiercache samples named ``prefix*`` (and holding ``label``) during round ``rnd``."""
    def total(i: int) -> float:
        samples = result["rounds"][i]["tiercache_metrics"] if i >= 0 else {}
        return sum(v for k, v in samples.items()
                   if k.startswith(prefix) and label in k and not k.endswith("_created"))

    return total(rnd) - total(rnd - 1)
