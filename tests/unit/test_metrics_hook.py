"""Metrics through vLLM's connector hook: the scheduler's recorder -> the stats envelope -> vLLM's /metrics.

A real scheduler counts lookup and hit tokens (the hit rate's two halves); its
changes travel as ``KVConnectorStats.data`` (aggregated as vLLM aggregates
them) into vLLM's own ``KVConnectorProm``, which builds tiercache's families
through ``TierCacheConnector.build_prom_metrics`` in the default registry:
two data-parallel engines give two series on one registry, labelled like
vLLM's own plus ``cache_instance``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

import prometheus_client
from tiercache.connector.engine_info import ChunkGeometry, EngineGeometry
from tiercache.connector.scheduler import TierCacheScheduler
from tiercache.connector.stats import TierCacheStats
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

from tiercache.config.schema import ConfigError, load_config
from tiercache.metric_defs import instance_name
from tiercache.metrics import TierCacheMetrics

BLOCK, TOKENS = 32, 192
PER_BLOCK = 2 * (2 * BLOCK * 2 * 8 * 4)
BLOCK_IDS = [10, 11, 12, 13, 14, 15]


def scheduler(metrics: TierCacheMetrics) -> TierCacheScheduler:
    config = load_config(chunk_tokens=2 * BLOCK, tiers=[{"name": "cpu", "backend": "cpu", "capacity": "1MiB"}])
    engine = EngineGeometry(model="m", kv_dtype="torch.float32", kv_layout="NHD", block_size=BLOCK, tp_size=1,
                            world_size=1, bytes_per_block=PER_BLOCK, hash_algo="sha256")
    sched = TierCacheScheduler(config, ChunkGeometry.build(config, engine), metrics)
    sched.bind_kv_cache_manager(SimpleNamespace(get_block_ids=lambda rid: (BLOCK_IDS,)))  # type: ignore[arg-type]
    return sched


def request(rid: str, seed: int) -> Any:
    hashes = [bytes([seed, i + 1]) * 16 for i in range(TOKENS // BLOCK)]
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(TOKENS)), num_prompt_tokens=TOKENS,
                           num_tokens=TOKENS, num_computed_tokens=0, block_hashes=hashes)


def serve_requests(sched: TierCacheScheduler) -> None:
    """One request that hits two stored chunks (128 tokens) of 192, one that misses, one with a local hit."""
    hit, miss, local = request("hit", 1), request("miss", 2), request("local", 3)
    keys = sched.keys.chunk_keys(hit.block_hashes)
    sched.manager.prepare_store(keys[:2])
    sched.manager.complete_store(keys[:2])
    blocks = SimpleNamespace(get_block_ids=lambda: (BLOCK_IDS,))
    assert sched.get_num_new_matched_tokens(hit, 0) == (128, False)  # type: ignore[arg-type]
    sched.update_state_after_alloc(hit, blocks, 128)  # type: ignore[arg-type]
    assert sched.get_num_new_matched_tokens(miss, 0) == (0, False)  # type: ignore[arg-type]
    # not allocated (no free blocks): vLLM asks again later; counted once, when allocated
    assert sched.get_num_new_matched_tokens(miss, 0) == (0, False)  # type: ignore[arg-type]
    sched.update_state_after_alloc(miss, blocks, 0)  # type: ignore[arg-type]
    assert sched.get_num_new_matched_tokens(local, 64) == (0, False)  # vLLM's own cache had 64 tokens
    sched.update_state_after_alloc(local, blocks, 0)  # type: ignore[arg-type]


def test_lookup_and_hit_tokens_give_the_hit_rate() -> None:
    metrics = TierCacheMetrics(engine="0", model_name="m", instance="box")
    serve_requests(scheduler(metrics))
    assert metrics.sample("tiercache_lookup_tokens_total") == TOKENS + TOKENS + (TOKENS - 64)
    assert metrics.sample("tiercache_hit_tokens_total", tier="cpu") == 128
    assert metrics.take_payload()["counters"]["tiercache_lookup_tokens"] == 3 * TOKENS - 64


def vllm_config(**extra: Any) -> VllmConfig:
    transfer = KVTransferConfig(kv_connector="TierCacheConnector", kv_connector_module_path="tiercache.connector.vllm",
                                kv_role="kv_both", kv_connector_extra_config=extra)
    return VllmConfig(kv_transfer_config=transfer)


def stats_of(metrics: TierCacheMetrics, steps: int = 2) -> dict[str, Any]:
    """The envelope vLLM's scheduler sends for an interval: the scheduler's stats, aggregated."""
    sched = scheduler(metrics)
    serve_requests(sched)
    first = TierCacheStats.from_counters(sched.take_counters(), metrics.take_payload())
    metrics.observe_transfer("host_to_device", 4096, 0.002)
    later = TierCacheStats.from_counters({}, metrics.take_payload())
    assert not later.is_empty()
    return first.aggregate(later).to_dict()


def test_two_engines_on_vllms_metrics_hook() -> None:
    config = vllm_config(metrics={"instance": "rack-7"})
    prom = KVConnectorProm(config, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    prom.observe(stats_of(TierCacheMetrics(engine="0")), engine_idx=0)
    prom.observe(stats_of(TierCacheMetrics(engine="1")), engine_idx=1)
    prom.observe(stats_of(TierCacheMetrics(engine="1")), engine_idx=1)

    def value(name: str, engine: str, **labels: str) -> float | None:
        labels = {"model_name": "m", "engine": engine, "cache_instance": "rack-7", **labels}
        return prometheus_client.REGISTRY.get_sample_value(name, labels)

    assert value("tiercache_lookup_tokens_total", "0") == 3 * TOKENS - 64
    assert value("tiercache_lookup_tokens_total", "1") == 2 * (3 * TOKENS - 64)
    assert value("tiercache_hit_tokens_total", "1", tier="cpu") == 2 * 128
    assert value("tiercache_tier_capacity_bytes", "0", tier="cpu") == 1 << 20  # a gauge: the latest value
    assert value("tiercache_transfer_seconds_count", "1", path="host_to_device") == 2
    assert value("tiercache_transfer_bytes_total", "1", path="host_to_device") == 2 * 4096
    # a second stat logger in this process (vLLM builds one per engine client) registers them again
    again = KVConnectorProm(config, ["model_name", "engine"], {0: ["m", "0"]})
    again.observe(stats_of(TierCacheMetrics()), engine_idx=0)
    assert value("tiercache_lookup_tokens_total", "0") == 3 * TOKENS - 64


def test_the_instance_label_is_configured_or_the_host_name() -> None:
    prom = KVConnectorProm(vllm_config(), ["model_name", "engine"], {0: ["m", "0"]})
    assert prom.prom_metrics._instance == instance_name(None) != ""  # type: ignore[union-attr]
    assert TierCacheMetrics(instance="edge-1").base[2] == "edge-1"
    with pytest.raises(ConfigError, match="metrics.instance"):
        load_config(metrics={"instance": ""})


def test_the_standalone_port_yields_when_taken() -> None:
    metrics = TierCacheMetrics()
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert metrics.serve(taken.getsockname()[1]) is False  # a second engine on the port: no crash
