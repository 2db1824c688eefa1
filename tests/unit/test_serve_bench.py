"""bench/serve.py without an engine: the word tokenizer, the sizes and configs, the table, ratios and plot.

The tokenizer round trip is what vLLM's ``prefix_repetition`` dataset relies
on (random ids -> text -> the same ids), checked on the tiny model's
vocabulary with transformers' ``AutoTokenizer`` (what the server and the load
generator load). The report is fed the result JSONs vLLM's load generator
(``vllm bench serve --save-result``) wrote in a smoke run of
``python -m bench serve --quick`` (tests/unit/data/serve_loadgen_*.json, the
tiny model, 8 prefixes of 512 tokens, 16 prompts, concurrency 2).
"""

from __future__ import annotations

import json
import os
import pathlib
import random
from typing import Any

import pytest

from bench import serve_report, serve_stack
from tiercache.config.schema import config_from_extra
from tiercache.testing.random_llama import config_path
from tiercache.testing.word_tokenizer import write_word_tokenizer

DATA = pathlib.Path(__file__).resolve().parent / "data"
CANNED = {case: DATA / f"serve_loadgen_{case}.json" for case in ("ideal", "none", "host")}


def test_word_tokenizer_round_trips_every_id_of_the_tiny_vocabulary(tiny_dir: pathlib.Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    vocab = json.loads((tiny_dir / "config.json").read_text())["vocab_size"]
    assert tok.vocab_size == vocab == 1024
    every = list(range(vocab))
    random.Random(5).shuffle(every)
    ids = every + [2, 23, 230, 2, 0, 1023]  # "w2" must not match inside "w23"
    text = tok.decode(ids)
    assert text.split() == [f"w{i}" for i in ids]
    assert tok.encode(text, add_special_tokens=False) == ids
    assert tok.encode(text) == ids  # the server's default: nothing is added
    # written again unchanged: the files are left alone
    before = (tiny_dir / "tokenizer.json").stat().st_mtime_ns
    write_word_tokenizer(tiny_dir)
    assert (tiny_dir / "tokenizer.json").stat().st_mtime_ns == before


def test_sizes_put_the_working_set_beyond_the_engine_and_within_the_ideal() -> None:
    heavy = json.loads(config_path("heavy").read_text())
    per_token = serve_stack.kv_bytes_per_token(heavy)
    assert per_token == 16 << 10  # docs: 16 KiB per token in float32
    s = serve_stack.plan_sizes(per_token, prefix_len=1024, suffix_len=32, output_len=32, num_prefixes=32,
                               prompts=96, concurrency=8, engine_fraction=0.75, engine_blocks=None,
                               host_bytes=None, small_host_bytes=None)
    assert (s.working_set_blocks, s.engine_blocks) == (1024, 768)  # the 768 engine blocks
    assert s.ideal_blocks > s.working_set_blocks + 96 * 2
    assert s.small_host_bytes == 128 << 20  # the 128 MiB host tier in front of the disk tier
    assert s.host_bytes > 32 * 1024 * per_token and s.store_bytes > 32 * 1024 * per_token
    assert s.kv_space_gib(s.ideal_blocks) * (1 << 30) >= s.ideal_blocks * s.block_bytes


@pytest.mark.parametrize("case", ["host", "disk", "redis", "server"])
def test_every_case_is_a_valid_tiercache_config(case: str, tmp_path: pathlib.Path) -> None:
    s = serve_stack.plan_sizes(4096, prefix_len=512, suffix_len=32, output_len=8, num_prefixes=8, prompts=16,
                               concurrency=2, engine_fraction=0.75, engine_blocks=None, host_bytes=None,
                               small_host_bytes=None)
    kv = serve_stack.kv_transfer_config(case, s, 256, tmp_path, redis_url="redis://127.0.0.1:12345/0",
                                        server_address="127.0.0.1:23456")
    assert kv is not None
    config = config_from_extra(kv["kv_connector_extra_config"])
    names = [t.name for t in config.tiers]
    assert names == (["cpu"] if case == "host" else ["cpu", case])
    assert serve_stack.kv_transfer_config("none", s, 256, tmp_path) is None
    assert serve_stack.kv_transfer_config("ideal", s, 256, tmp_path) is None


def canned_runs() -> list[dict[str, Any]]:
    runs = []
    for case, path in CANNED.items():
        result = json.loads(path.read_text())
        metrics = {"vllm:prefix_cache_queries_total": float(result["total_input_tokens"]),
                   "vllm:prefix_cache_hits_total": float(result["total_input_tokens"]) / 2}
        if case == "host":
            metrics["tiercache_hit_tokens_total/cpu"] = float(result["total_input_tokens"]) / 4
        runs.append(serve_report.summarize_run(case, 512, 2, result, metrics))
    return serve_report.add_ratios(runs)


def test_ratios_and_table_from_the_load_generators_results() -> None:
    runs = {r["case"]: r for r in canned_runs()}
    ideal, none = runs["ideal"], runs["none"]
    raw = {case: json.loads(path.read_text()) for case, path in CANNED.items()}
    assert ideal["request_throughput"] == raw["ideal"]["request_throughput"]
    assert ideal["ttft_p50_ms"] == raw["ideal"]["median_ttft_ms"] == raw["ideal"]["p50_ttft_ms"]
    assert ideal["ttft_p99_ms"] == raw["ideal"]["p99_ttft_ms"]
    assert ideal["throughput_ratio"] == ideal["ttft_p50_ratio"] == 1.0
    assert none["throughput_ratio"] == pytest.approx(none["request_throughput"] / ideal["request_throughput"])
    assert none["ttft_p50_ratio"] == pytest.approx(none["ttft_p50_ms"] / ideal["ttft_p50_ms"])
    assert ideal["meets_target"] is None and none["meets_target"] is None  # targets are tiercache's
    host = runs["host"]
    met = host["throughput_ratio"] >= 0.95 and host["ttft_p50_ratio"] <= 1.1
    assert host["meets_target"] is met
    assert host["tiercache_hit_fraction"] == {"cpu": 0.25} and host["vllm_hit_fraction"] == 0.5

    rows = serve_report.table_rows(list(runs.values()))
    assert len(rows) == 3 and all(len(row) == len(serve_report.HEADERS) for row in rows)
    by_case = {row[0]: row for row in rows}
    assert by_case["ideal"][1] == "512, c=2"
    assert by_case["ideal"][5:7] == ["1.00x", "1.00x"]
    assert by_case["none"][2] == f"{none['request_throughput']:.2f}"
    assert by_case["none"][3] == f"{none['ttft_p50_ms']:.0f}"
    assert by_case["host"][8] == "cpu 25%" and by_case["host"][9] == ("yes" if met else "NO")
    # without an ideal in the cell there is no ratio
    lone = serve_report.add_ratios([r for r in runs.values() if r["case"] != "ideal"])
    assert all(r["throughput_ratio"] is None for r in lone)
    assert serve_report.table_rows(lone)[0][5] == "-"


def test_metrics_parse_per_tier_and_deltas() -> None:
    text = """# HELP vllm:prefix_cache_hits_total hits
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 640.0
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 1280.0
tiercache_hit_tokens_total{engine="0",tier="cpu"} 256.0
tiercache_hit_tokens_total{engine="0",tier="disk"} 512.0
tiercache_faults_total{engine="0",reason="staging_no_slot"} 3.0
vllm:num_requests_running{engine="0"} 1.0
"""
    names = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "tiercache_hit_tokens_total",
             "tiercache_faults_total")
    after = serve_report.parse_metrics(text, names)
    assert after == {"vllm:prefix_cache_hits_total": 640.0, "vllm:prefix_cache_queries_total": 1280.0,
                     "tiercache_hit_tokens_total/cpu": 256.0, "tiercache_hit_tokens_total/disk": 512.0,
                     "tiercache_faults_total/staging_no_slot": 3.0}
    before = {"vllm:prefix_cache_hits_total": 40.0, "tiercache_hit_tokens_total/cpu": 256.0}
    delta = serve_report.metric_deltas(before, after)
    assert delta["vllm:prefix_cache_hits_total"] == 600.0 and delta["tiercache_hit_tokens_total/cpu"] == 0.0


def test_the_ratios_are_drawn_as_svg_and_png(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("matplotlib")
    written = serve_report.draw_ratios(canned_runs(), tmp_path / "serve_ratios", "canned")
    assert [p.name for p in written] == ["serve_ratios.svg", "serve_ratios.png"]
    assert written[1].read_bytes()[:4] == b"\x89PNG"
    svg = written[0].read_text()
    assert "request throughput / ideal" in svg and "512 prefix, c=2" in svg


def test_every_case_binds_its_compute_threads_to_the_same_cores(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: pathlib.Path) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    cores = sorted(os.sched_getaffinity(0))
    expected = ",".join(map(str, cores[:-1] if len(cores) > 1 else cores))
    servers = [serve_stack.OpenAIServer(tmp_path, "tiny", blocks=8, kv_space_gib=1, max_model_len=64,
                                        kv_transfer=kv, log=tmp_path / "log")
               for kv in (None, {"kv_connector": "TierCacheConnector"})]
    assert [s.env["VLLM_CPU_OMP_THREADS_BIND"] for s in servers] == [expected, expected]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3")  # the user's choice wins
    assert serve_stack.omp_bind() == "0-3"


def test_contained_faults_are_named_per_run_and_quiet_runs_say_nothing() -> None:
    quiet = canned_runs()[0]
    loud = dict(quiet, case="disk", metrics={"tiercache_faults_total/staging_no_slot": 3.0,
                                             "tiercache_faults_total/load_deadline": 0.0})
    assert serve_report.fault_lines([quiet]) == []
    (line,) = serve_report.fault_lines([loud])
    assert line.startswith("faults: disk ") and line.endswith(": staging_no_slot 3")


def test_turns_only_is_refused_without_turns() -> None:
    from bench import serve

    with pytest.raises(SystemExit):
        serve.parse_args(["--turns-only"])
    args = serve.parse_args(["--turns", "4", "--turns-only", "--concurrency", "2", "8"])
    assert args.turns_only and args.turns == 4 and args.concurrency == [2, 8]
