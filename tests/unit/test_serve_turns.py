"""bench/serve_turns.py without an engine: conversations turn by turn, as vLLM's load generator reads them.

A turn's prompt must tokenize to the previous turn's tokens, the answer's and
the new words' (the word tokenizer, loaded as the server loads it), or the
multi-turn cell would measure nothing reusable; vLLM 0.32's own ``custom``
dataset must read a turn file in conversation order with those lengths, and
its own argument parser must accept a turn's options. The merged figures and
the ratios pair a multi-turn run with the multi-turn ideal of its cell, never
with the prefix-repetition ideal.
"""

from __future__ import annotations

import pathlib
import random

import numpy as np
import pytest

from bench import serve_report, serve_turns

VOCAB = 512


def test_a_turn_is_the_last_prompt_its_answer_and_new_words(tiny_dir: pathlib.Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    first = serve_turns.first_prompts(3, 40, VOCAB, seed=5)
    assert first == serve_turns.first_prompts(3, 40, VOCAB, seed=5) != serve_turns.first_prompts(3, 40, VOCAB, seed=6)
    assert len(set(first)) == 3 and all(len(tok(p).input_ids) == 40 for p in first)
    rng = random.Random(1)
    answer_ids = [[rng.randrange(VOCAB) for _ in range(8)] for _ in first]
    answers = [" " + tok.decode(ids) for ids in answer_ids]  # as the server returns them: a leading space
    second = serve_turns.next_prompts(first, answers, 5, VOCAB, seed=9)
    for prompt, nxt, ids in zip(first, second, answer_ids):
        tokens = tok(nxt).input_ids
        assert len(tokens) == 40 + 8 + 5
        assert tokens[:48] == tok(prompt).input_ids + ids  # the whole conversation so far, answer included
    with pytest.raises(ValueError, match="answers"):
        serve_turns.next_prompts(first, answers[:2], 5, VOCAB, seed=9)
    with pytest.raises(ValueError, match="empty"):
        serve_turns.next_prompts(first[:1], [" "], 5, VOCAB, seed=9)
    assert serve_turns.max_prompt_tokens(40, 5, 8, turns=3) == 40 + 2 * 13


def test_vllms_custom_dataset_reads_a_turn_in_order(tiny_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    from transformers import AutoTokenizer
    from vllm.benchmarks.datasets.datasets import CustomDataset
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    prompts = serve_turns.first_prompts(6, 30, VOCAB, seed=3)
    path = serve_turns.write_turn(prompts, tmp_path / "turn.jsonl")
    options = serve_turns.turn_args("http://127.0.0.1:9", "tiny", tiny_dir, path, conversations=6, output_len=4,
                                    concurrency=2, seed=0, result_dir=tmp_path, result_name="t.json")
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(options)
    assert args.dataset_name == "custom" and args.disable_shuffle and args.skip_chat_template and args.save_detailed
    dataset = CustomDataset(dataset_path=str(path), random_seed=args.seed, disable_shuffle=args.disable_shuffle)
    samples = dataset.sample(AutoTokenizer.from_pretrained(str(tiny_dir)), num_requests=6, output_len=4,
                             skip_chat_template=True, no_oversample=True)
    assert [s.prompt for s in samples] == prompts and [s.prompt_len for s in samples] == [30] * 6
    shuffled = CustomDataset(dataset_path=str(path), random_seed=args.seed)  # control: vLLM's default order
    assert [row["prompt"] for row in shuffled.data] != prompts


def loadgen(ttfts: list[float], duration: float, texts: list[str], input_lens: list[int]) -> dict:
    return {"duration": duration, "completed": len(ttfts), "failed": 0, "ttfts": ttfts, "errors": [""] * len(ttfts),
            "generated_texts": texts, "input_lens": input_lens, "total_input_tokens": sum(input_lens),
            "request_throughput": len(ttfts) / duration, "median_ttft_ms": 1000 * float(np.median(ttfts))}


def test_answers_come_back_checked_and_turns_merge() -> None:
    prompts = ["w1 w2 w3", "w4 w5"]
    turn = loadgen([0.5, 0.1], 2.0, [" w7", " w8 w9"], [3, 2])
    assert serve_turns.answers_of(turn, prompts) == [" w7", " w8 w9"]
    with pytest.raises(RuntimeError, match="lengths"):  # answers in another order than the prompts
        serve_turns.answers_of({**turn, "input_lens": [2, 3]}, prompts)
    with pytest.raises(RuntimeError, match="failed"):
        serve_turns.answers_of({**turn, "failed": 1, "errors": ["", "boom"]}, prompts)
    merged = serve_turns.merge_turns([turn, loadgen([0.2, 0.3, 0.9], 4.0, ["a"] * 3, [5, 5, 5])])
    every = [500.0, 100.0, 200.0, 300.0, 900.0]
    assert merged["request_throughput"] == pytest.approx(5 / 6.0)
    assert merged["median_ttft_ms"] == pytest.approx(300.0) == pytest.approx(np.percentile(every, 50))
    assert merged["p99_ttft_ms"] == pytest.approx(np.percentile(every, 99))
    assert merged["total_input_tokens"] == 20 and len(merged["turns"]) == 2


def test_a_multi_turn_run_is_measured_against_the_multi_turn_ideal() -> None:
    def run(case: str, workload: str, rps: float, p50: float) -> dict:
        result = {"request_throughput": rps, "median_ttft_ms": p50, "p99_ttft_ms": p50, "completed": 8}
        out = serve_report.summarize_run(case, 1024, 2, result, {})
        if workload == serve_report.MULTI_TURN:
            out.update(workload=workload, turns=[{}] * 4)
        return out

    runs = serve_report.add_ratios([
        run("ideal", serve_report.PREFIX_REPETITION, 1.0, 100.0),
        run("ideal", serve_report.MULTI_TURN, 0.5, 400.0),
        run("host", serve_report.PREFIX_REPETITION, 0.9, 110.0),
        run("host", serve_report.MULTI_TURN, 0.45, 480.0),
    ])
    host_turns = runs[3]
    assert host_turns["throughput_ratio"] == pytest.approx(0.9) and host_turns["ttft_p50_ratio"] == pytest.approx(1.2)
    assert runs[2]["throughput_ratio"] == pytest.approx(0.9) and runs[2]["ttft_p50_ratio"] == pytest.approx(1.1)
    rows = serve_report.table_rows(runs)
    assert [r[1] for r in rows] == ["1k, c=2", "1k 4 turns, c=2", "1k, c=2", "1k 4 turns, c=2"]
    assert serve_report.cell_label(1024, 8, serve_report.MULTI_TURN) == "1k multi-turn, c=8"
