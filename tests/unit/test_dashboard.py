"""dashboards/tiercache.json: every query names a metric the code registers.

The names come from the registries themselves (an engine's recorder and the
cache server's), not from a list kept by hand; a misspelt name fails (the
control below), and the dashboard shows the hit rate from lookup and hit tokens.
Its queries are also run against a live Prometheus in tests/e2e/test_prometheus_scrape.py.
"""

from __future__ import annotations

import re

from tiercache.metric_defs import ENGINE_METRICS, exposed_metric_names
from tiercache.testing.dashboard_check import (
    dashboard_queries,
    for_prometheus,
    metric_names_in,
    registered_names,
    unknown_names,
)


def test_every_dashboard_query_names_a_registered_metric() -> None:
    queries = dashboard_queries()
    known = registered_names()
    assert len(queries) > 20
    assert all(metric_names_in(q) for q in queries), [q for q in queries if not metric_names_in(q)]
    assert unknown_names(queries, known) == {}


def test_a_misspelt_metric_is_caught() -> None:
    known = registered_names()
    bad = ['sum(rate(tiercache_hit_token_total[5m]))', 'tiercache_tier_used_bytes / tiercache_server_chunks']
    assert unknown_names(bad, known) == {bad[0]: {"tiercache_hit_token_total"},
                                         bad[1]: {"tiercache_server_chunks"}}


def test_the_catalogue_matches_what_the_recorder_registers() -> None:
    engine_names = {n for n in registered_names() if not n.startswith("tiercache_server_")}
    assert engine_names == set(exposed_metric_names())


def test_the_dashboard_shows_the_hit_rate_and_every_engine_metric() -> None:
    queries = dashboard_queries()
    hit_rate = [q for q in queries if {"tiercache_hit_tokens_total", "tiercache_lookup_tokens_total"} <= metric_names_in(q)
                and "/" in q]
    assert hit_rate, "no hit-rate panel"
    used = {re.sub(r"_(total|bucket|count|sum)$", "", n) for q in queries for n in metric_names_in(q)}
    assert {d.name for d in ENGINE_METRICS} - used == set()

def test_grafana_variables_become_plain_promql() -> None:
    expr = 'sum(rate(tiercache_hit_tokens_total{model_name=~"$model_name"}[$__rate_interval]))'
    assert for_prometheus(expr) == 'sum(rate(tiercache_hit_tokens_total{model_name=~".*"}[1m]))'
