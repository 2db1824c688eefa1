"""Start-up agreement between the scheduler and the workers on the namespace (connector/namespace_check.py)."""

from __future__ import annotations

import dataclasses
import logging
import pickle
from typing import Any

import pytest

pytest.importorskip("vllm")

from tiercache.config.schema import config_from_extra  # noqa: E402
from tiercache.connector.engine_info import ChunkGeometry, EngineGeometry  # noqa: E402
from tiercache.connector.metadata import TierCacheConnectorMetadata, TierCacheWorkerMetadata  # noqa: E402
from tiercache.connector.namespace_check import (  # noqa: E402
    NamespaceMismatch,
    SchedulerGate,
    WorkerIdentity,
    WorkerNamespace,
    namespace_digest,
    namespace_fields,
    with_identity,
)

MODEL = {"source": "local", "revision": "", "config": "c1", "weight_files": "1 files, 10 B, x", "weight_content": "w1",
         "dtype": "torch.float32"}
VIEW = {"kv_layout": "LBHNC", "cache_dtype": "auto", "vllm": "0.32"}
ATTENTION = {**VIEW, "backends": "CPU_ATTN", "pages": "float32[B,H,32,128]/order=0123", "kernel_block_size": "32"}


def geometry(world_size: int = 2) -> tuple[Any, ChunkGeometry]:
    config = config_from_extra({"chunk_tokens": 128, "tiers": [{"name": "cpu", "backend": "cpu", "capacity": "4MiB"}]})
    engine = EngineGeometry(model="/models/tiny", kv_dtype="torch.float32", kv_layout="LBHNC", block_size=32,
                            tp_size=world_size, world_size=world_size, bytes_per_block=4096, hash_algo="sha256")
    return config, ChunkGeometry.build(config, engine)


def worker(rank: int, model: dict | None = None, attention: dict | None = None, world_size: int = 2) -> WorkerIdentity:
    config, geo = geometry(world_size)
    model, attention = model or MODEL, attention or ATTENTION
    config, geo = with_identity(config, geo, model, attention)
    return WorkerIdentity((0, rank), dict(model), dict(attention), namespace_fields(config, geo),
                          namespace_digest(config, geo))


class FakeScheduler:
    def __init__(self, config: Any, geo: ChunkGeometry) -> None:
        self.keys = geo.keyspace(config)
        self.bound: Any = None
        self.lookups = 0

    def bind_kv_cache_manager(self, manager: Any) -> None:
        self.bound = manager

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        self.lookups += 1
        return 128, False

    def build_connector_meta(self, scheduler_output: Any) -> TierCacheConnectorMetadata:
        return TierCacheConnectorMetadata()

    def update_connector_output(self, meta: Any) -> None:
        pass


def gate(world_size: int = 2) -> SchedulerGate:
    config, geo = geometry(world_size)
    g = SchedulerGate(config, geo, dict(MODEL), dict(VIEW), FakeScheduler)
    g.bind_kv_cache_manager("kv-cache-manager")
    return g


def test_agreeing_workers_start_the_scheduler_with_their_attention_identity() -> None:
    g = gate()
    assert g.state == "waiting"
    g.handshake({(0, 0): worker(0), (0, 1): worker(1)})
    assert g.state == "ready" and g.inner.bound == "kv-cache-manager"
    config, geo = with_identity(*geometry(), MODEL, ATTENTION)
    assert g.inner.keys.digest == geo.keyspace(config).digest  # the workers' layout is in the scheduler's keys
    assert g.get_num_new_matched_tokens(object(), 0) == (128, False)
    assert g.keys is g.inner.keys  # the rest of the scheduler's API passes through


def test_the_identities_change_the_namespace_digest() -> None:
    config, geo = geometry()
    digests = set()
    for model, attention in [(MODEL, ATTENTION), ({**MODEL, "weight_content": "w2"}, ATTENTION),
                             (MODEL, {**ATTENTION, "backends": "FLASH_ATTN"})]:
        c, g = with_identity(config, geo, model, attention)
        digests.add(g.keyspace(c).digest)
    assert len(digests) == 3


def test_a_worker_with_other_weights_refuses_start_up_naming_the_field() -> None:
    g = gate()
    other = worker(1, model={**MODEL, "weight_content": "w2"})
    with pytest.raises(NamespaceMismatch) as err:
        g.handshake({(0, 0): worker(0), (0, 1): other})
    message = str(err.value)
    assert "model.weight_content: scheduler 'w1', worker (0, 1) 'w2'" in message, message
    assert "worker (0, 0)" not in message
    assert g.state == "waiting" and g.inner is None


def test_workers_that_registered_different_layouts_refuse_start_up() -> None:
    g = gate()
    hnd = worker(1, attention={**ATTENTION, "pages": "float32[B,H,32,128]/order=0213"})
    with pytest.raises(NamespaceMismatch) as err:
        g.handshake({(0, 0): worker(0), (0, 1): hnd})
    assert "attention.pages: worker (0, 0)" in str(err.value)


def test_a_worker_disagreeing_with_the_schedulers_view_refuses_start_up() -> None:
    g = gate()
    fp8 = {**ATTENTION, "cache_dtype": "fp8_e4m3"}
    with pytest.raises(NamespaceMismatch) as err:
        g.handshake({(0, 0): worker(0, attention=fp8), (0, 1): worker(1, attention=fp8)})
    assert "attention.cache_dtype: scheduler 'auto', worker (0, 0) 'fp8_e4m3'" in str(err.value)


def test_a_namespace_field_computed_differently_is_named() -> None:
    g = gate()
    odd = worker(1)
    odd.namespace = {**odd.namespace, "block_size": 16}
    odd.digest = "0" * 16
    with pytest.raises(NamespaceMismatch) as err:
        g.handshake({(0, 0): worker(0), (0, 1): odd})
    assert "namespace.block_size: scheduler 32, worker (0, 1) 16" in str(err.value)


def test_without_the_handshake_the_workers_report_it_and_lookups_miss_until_then(caplog: Any) -> None:
    g = gate()
    g.handshake({(0, 0): object()})  # another connector's handshake (a MultiConnector)
    assert g.state == "reports"
    assert g.get_num_new_matched_tokens(object(), 0) == (0, False)
    meta = g.build_connector_meta(None)
    assert meta.namespace_settled is False and not meta.loads and not meta.stores

    sides = []
    for rank in (0, 1):
        side = WorkerNamespace(None, None, dict(MODEL), handshake=False)  # type: ignore[arg-type]
        side.identity = worker(rank)
        assert side.handshake_metadata() is None
        side.saw(meta)
        sides.append(side)
    reports = [side.attach(None) for side in sides]
    merged = reports[0].aggregate(reports[1])
    merged = pickle.loads(pickle.dumps(merged))  # it crosses a process boundary
    g.update_connector_output(merged)
    assert g.state == "ready"
    assert g.build_connector_meta(None).namespace_settled is True
    sides[0].saw(g.build_connector_meta(None))
    assert sides[0].attach(None) is None  # settled: no more reports


def test_a_mismatch_found_at_run_time_disables_tiercache_without_raising(caplog: Any) -> None:
    g = gate()
    assert g.get_num_new_matched_tokens(object(), 0) == (0, False)  # serving, no handshake came: fallback
    assert g.state == "reports"
    report = TierCacheWorkerMetadata()
    report.namespace_reports[(0, 0)] = worker(0)
    g.update_connector_output(report)
    assert g.state == "reports"  # one of two workers so far
    report = TierCacheWorkerMetadata()
    report.namespace_reports[(0, 1)] = worker(1, model={**MODEL, "config": "c2"})
    with caplog.at_level(logging.ERROR, logger="tiercache"):
        g.update_connector_output(report)
    assert g.state == "disabled"
    assert "model.config" in caplog.text
    assert g.get_num_new_matched_tokens(object(), 0) == (0, False)
    assert g.build_connector_meta(None).namespace_settled is True  # the workers stop reporting
    assert g.request_finished(object(), []) == (False, None) and g.take_events() == [] and g.reset()


def test_worker_identity_is_handshake_metadata_and_pickles() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata

    w = worker(0)
    assert isinstance(w, KVConnectorHandshakeMetadata)
    assert pickle.loads(pickle.dumps(w)) == w
    assert dataclasses.asdict(w)["model"] == MODEL


def test_identity_fields_go_into_the_namespace_and_replace_the_model_path() -> None:
    config, geo = geometry()
    same_config, keyed = with_identity(config, geo, MODEL, ATTENTION)
    assert same_config is config
    ns = keyed.keyspace(config).namespace
    assert ns.model_identity and ns.attention_identity
    assert keyed.keyspace(config).digest != geo.keyspace(config).digest
    # another checkpoint content: another digest; the same content at another path: the same
    _, other = with_identity(config, geo, {**MODEL, "weight_content": "other"}, ATTENTION)
    assert other.keyspace(config).digest != keyed.keyspace(config).digest
    moved = dataclasses.replace(keyed, engine=dataclasses.replace(keyed.engine, model="/elsewhere"))
    assert moved.keyspace(config).digest == keyed.keyspace(config).digest
    fields = namespace_fields(config, keyed)
    assert fields["model_identity"] and fields["attention_identity"] and fields["tenant_salt"] == ""


def test_only_the_digest_must_match() -> None:
    """A field the digest leaves out (the TP size, with head shards) may differ; the digest may not."""
    g = gate()
    w0, w1 = worker(0), worker(1)
    w1.namespace = {**w1.namespace, "not_in_the_digest": 1}
    g.handshake({(0, 0): w0, (0, 1): w1})
    assert g.state == "ready"
    g = gate()
    w1 = worker(1)
    w1.digest = "f" * 16
    with pytest.raises(NamespaceMismatch, match=r"namespace digest: scheduler \w+, worker \(0, 1\) f+ \(equal fields\)"):
        g.handshake({(0, 0): w0, (0, 1): w1})
