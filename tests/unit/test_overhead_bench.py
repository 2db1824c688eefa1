"""bench/overhead.py's statistics: the geometric-mean overhead and its bootstrap interval."""

from __future__ import annotations

import random
from pathlib import Path

from bench.overhead import engine_spec, overhead


def test_a_constant_ratio_is_the_overhead_with_a_zero_width_interval() -> None:
    pairs = [(t, t * 1.05) for t in (1.0, 2.0, 1.5, 0.7)]
    mid, low, high = overhead([pairs], seed=0)
    assert abs(mid - 0.05) < 1e-12 and abs(low - 0.05) < 1e-12 and abs(high - 0.05) < 1e-12


def test_the_interval_holds_the_true_overhead_and_narrows_with_more_prompts() -> None:
    rng = random.Random(3)

    def pairs(n: int) -> list[tuple[float, float]]:
        out = []
        for _ in range(n):
            base = rng.uniform(1.0, 2.0) * rng.lognormvariate(0, 0.05)  # the machine's own noise, shared
            out.append((base * rng.lognormvariate(0, 0.01), base * 1.003 * rng.lognormvariate(0, 0.01)))
        return out

    few, many = overhead([pairs(10)], seed=1), overhead([pairs(100), pairs(100)], seed=1)
    for mid, low, high in (few, many):
        assert low <= 0.003 <= high and low <= mid <= high
    assert many[2] - many[1] < few[2] - few[1]
    assert many[2] - many[1] < 0.01  # what the issue asks to show: narrower than 1 %


def test_both_engines_of_a_pass_get_the_same_prompts_behind_barriers_on_their_own_core() -> None:
    class Args:
        dtype, length, chunk_tokens = "float32", 256, 256

    prompts = [[5] * 256, [6] * 256]
    specs = {kind: engine_spec(kind, core, Path("/m"), prompts, Args())
             for kind, core in (("none", 0), ("tiercache", 1))}
    for kind, core in (("none", 0), ("tiercache", 1)):
        spec = specs[kind]
        assert spec["cpus"] == [core] and spec["env"]["VLLM_CPU_OMP_THREADS_BIND"] == str(core)
        assert spec["in_process"] is False
        timed = [r for r in spec["rounds"] if not r.get("warmup")]
        assert [r["prompts"] for r in timed] == [[p] for p in prompts]
        assert [r["barrier"] for r in timed] == ["p0", "p1"]
    assert specs["none"]["kv_transfer_config"] is None and specs["tiercache"]["kv_transfer_config"]


def test_passes_weigh_the_same_so_a_faster_core_cancels_out() -> None:
    # the same +2 % overhead measured on a core 5 % faster (pass 1) and one 5 % slower (pass 2),
    # with unequal pass sizes: pooling the pairs would be biased towards the bigger pass
    fast = [(1.0, 1.02 * 0.95) for _ in range(10)]
    slow = [(1.0, 1.02 * 1.05) for _ in range(30)]
    mid, low, high = overhead([fast, slow], seed=2)
    assert abs(mid - (((1.02 * 0.95) * (1.02 * 1.05)) ** 0.5 - 1)) < 1e-9
    assert abs(mid - 0.02) < 0.002 and low <= mid <= high
