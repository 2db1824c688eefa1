"""Multi-turn conversations for bench/serve.py, sent through vLLM's own load generator.

vLLM 0.32's load generator has no multi-turn dataset (its multi-turn tool is
in vLLM's source tree, not in the wheel), but it runs any list of prompts
(its ``custom`` dataset: a JSONL file of ``{"prompt": ...}``) and, with
``--save-detailed``, saves every request's generated text in the order sent
(``--disable-shuffle``). So a conversation is driven turn by turn: turn 0 is
CONVERSATIONS random prompts of PREFIX_LEN words; turn ``t + 1``'s prompt is
turn ``t``'s prompt, then the answer the server generated for it, then
SUFFIX_LEN new random words (the user's next message). Every turn is one
load-generator run over all conversations, CONCURRENCY in flight; the next
turn starts when the last answer is in. A turn's prompt repeats everything
the conversation said so far, decode tokens included, so a server that keeps
(or offloads and brings back) the KV of earlier turns prefills only the new
words.

The word tokenizer of the test models (tiercache/testing/word_tokenizer.py)
makes text and tokens interchangeable: token ``i`` is the word ``w<i>`` and
words are split on whitespace, so a prompt built from text tokenizes to the
previous turn's tokens, the answer's tokens and the new words, exactly.

The figures of a multi-turn run are those of all its turns together
(:func:`merge_turns`): requests per second over the summed turn durations,
TTFT percentiles over every request. Needs no engine to test
(tests/unit/test_serve_turns.py).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench import serve_stack
from tiercache.testing.word_tokenizer import word_of

WORKLOAD = "multi_turn"


def random_words(rng: random.Random, vocab_size: int, n: int) -> str:
    """``n`` random words of the word tokenizer (token ids drawn from the whole vocabulary)."""
    return " ".join(word_of(rng.randrange(vocab_size)) for _ in range(n))


def first_prompts(conversations: int, prefix_len: int, vocab_size: int, seed: int) -> list[str]:
    """Turn 0: one prompt of ``prefix_len`` random words per conversation (none shares a prefix)."""
    rng = random.Random(seed)
    return [random_words(rng, vocab_size, prefix_len) for _ in range(conversations)]


def next_prompts(prompts: Sequence[str], answers: Sequence[str], suffix_len: int, vocab_size: int,
                 seed: int) -> list[str]:
    """Turn ``t + 1``: each prompt, then its answer, then ``suffix_len`` new words."""
    if len(prompts) != len(answers):
        raise ValueError(f"{len(answers)} answers for {len(prompts)} prompts")
    rng = random.Random(seed)
    out = []
    for prompt, answer in zip(prompts, answers):
        words = answer.split()
        if not words:
            raise ValueError("an empty answer: the server generated no text for a turn")
        out.append(" ".join([prompt, *words, random_words(rng, vocab_size, suffix_len)]))
    return out


def write_turn(prompts: Sequence[str], path: Path) -> Path:
    """The turn as vLLM's ``custom`` dataset: one ``{"prompt": ...}`` per line, in conversation order."""
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def turn_args(base_url: str, served_name: str, model: Path, dataset: Path, *, conversations: int,
              output_len: int, concurrency: int, seed: int, result_dir: Path, result_name: str) -> list[str]:
    """The ``vllm bench serve`` options of one turn: the custom dataset in order, greedy, fixed output length,
    every request's generated text saved."""
    return [
        "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
        "--model", served_name, "--tokenizer", str(model),
        "--dataset-name", "custom", "--dataset-path", str(dataset), "--disable-shuffle", "--skip-chat-template",
        "--custom-output-len", str(output_len), "--num-prompts", str(conversations), "--no-oversample",
        "--max-concurrency", str(concurrency), "--request-rate", "inf", "--ignore-eos", "--temperature", "0",
        "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--ready-check-timeout-sec", "0", "--num-warmups", "0",
        "--save-result", "--save-detailed", "--result-dir", str(result_dir), "--result-filename", result_name,
    ]


def answers_of(result: dict[str, Any], prompts: Sequence[str]) -> list[str]:
    """The generated texts of one turn, in conversation order (checked: every request answered)."""
    texts = result.get("generated_texts") or []
    errors = [e for e in result.get("errors") or [] if e]
    if len(texts) != len(prompts) or errors or int(result.get("failed") or 0):
        raise RuntimeError(f"a turn of {len(prompts)} requests came back with {len(texts)} texts, "
                           f"{result.get('failed')} failed: {errors[:1]}")
    lens = result.get("input_lens") or []
    if lens and lens != [len(p.split()) for p in prompts]:
        raise RuntimeError("the turn's prompt lengths differ from the prompts sent (order or tokenizer)")
    return [str(t) for t in texts]


def merge_turns(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """All turns as one load-generator result: the keys serve_report.summarize_run reads."""
    if not results:
        raise ValueError("no turns")
    ttfts = [t * 1000.0 for r in results for t in r.get("ttfts") or [] if t]
    duration = sum(float(r["duration"]) for r in results)
    completed = sum(int(r.get("completed") or 0) for r in results)
    return {
        "duration": duration,
        "completed": completed,
        "failed": sum(int(r.get("failed") or 0) for r in results),
        "total_input_tokens": sum(int(r.get("total_input_tokens") or 0) for r in results),
        "request_throughput": completed / duration if duration else 0.0,
        # as the load generator computes them (numpy's linear interpolation)
        "median_ttft_ms": float(np.percentile(ttfts, 50)) if ttfts else float("nan"),
        "p99_ttft_ms": float(np.percentile(ttfts, 99)) if ttfts else float("nan"),
        "turns": [{k: r.get(k) for k in ("duration", "completed", "request_throughput", "median_ttft_ms",
                                         "total_input_tokens")} for r in results],
    }


def max_prompt_tokens(prefix_len: int, suffix_len: int, output_len: int, turns: int) -> int:
    """The last turn's prompt: the first prompt, then an answer and new words per earlier turn."""
    return prefix_len + (turns - 1) * (output_len + suffix_len)


def run_conversations(server: serve_stack.OpenAIServer, served_name: str, model: Path, *, vocab_size: int,
                      conversations: int, turns: int, prefix_len: int, suffix_len: int, output_len: int,
                      concurrency: int, seed: int, work: Path, bar: Any, timeout: float) -> dict[str, Any]:
    """Every conversation, turn by turn, through the load generator; all turns merged (:func:`merge_turns`)."""
    prompts = first_prompts(conversations, prefix_len, vocab_size, seed)
    results: list[dict[str, Any]] = []
    for turn in range(turns):
        name = f"turns-c{concurrency}-{turn}"
        options = turn_args(server.base, served_name, model, write_turn(prompts, work / f"{name}.jsonl"),
                            conversations=conversations, output_len=output_len, concurrency=concurrency,
                            seed=seed + turn, result_dir=work, result_name=f"{name}.json")
        result = serve_stack.run_load(options, work / "loadgen.log", bar, timeout)
        answers = answers_of(result, prompts)
        results.append(result)
        if turn + 1 < turns:
            prompts = next_prompts(prompts, answers, suffix_len, vocab_size, seed + 7919 * (turn + 1))
    return merge_turns(results)
