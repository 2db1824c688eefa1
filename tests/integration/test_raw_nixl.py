"""The raw NIXL ceiling's two ends (tiercache.testing.raw_nixl), between two real processes.

bench/pd.py calls :func:`read_in_worker` inside a vLLM decode worker; here it is
called in the test process (``worker`` is unused) against a :func:`serve_target`
child, as the bench does. Checks: the bytes arrive, each READ takes a different
hand-off-sized slot in turn, a READ larger than the target is refused, and the
target stops when told (checked as the fixture ends).
"""

from __future__ import annotations

import multiprocessing as mp
import pathlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nixl._api")

from tiercache.testing import raw_nixl  # noqa: E402

CHUNK, CHUNKS, SLOTS = 64 << 10, 4, 3
TARGET_BYTES = CHUNK * CHUNKS * SLOTS


@pytest.fixture
def target(tmp_path: pathlib.Path) -> Iterator[tuple[str, Any]]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    info = str(tmp_path / "target.pickle")
    proc = ctx.Process(target=raw_nixl.serve_target, args=(child, TARGET_BYTES, "none", info), daemon=True)
    proc.start()
    try:
        assert parent.poll(60), "the target never registered its memory"
        parent.recv()
        yield info, proc
    finally:
        parent.send("stop")
        proc.join(timeout=10)
        raw_nixl._READERS.clear()
    assert proc.exitcode == 0  # it stopped when told


def test_reads_land_slot_after_slot(target: tuple[str, Any]) -> None:
    info, proc = target
    times = raw_nixl.read_in_worker(None, info, "none", CHUNK, CHUNKS, reads=SLOTS + 1)
    assert len(times) == SLOTS + 1 and all(t > 0 for t in times)
    reader = raw_nixl._READERS[(info, "none")]
    # the target's bytes: the same generator serve_target draws from
    want = np.random.default_rng(0).integers(0, 256, TARGET_BYTES, dtype=np.uint8)
    assert np.array_equal(reader.local, want)  # every slot was READ (the untimed first pass and the turns)
    assert reader.turns[(CHUNK, CHUNKS)] == SLOTS + 1
    reader.local[:] = 0
    raw_nixl.read_in_worker(None, info, "none", CHUNK, CHUNKS, reads=1)  # turn 4: slot 1
    size = CHUNK * CHUNKS
    assert np.array_equal(reader.local[size:2 * size], want[size:2 * size])
    assert not reader.local[:size].any() and not reader.local[2 * size:].any()


def test_a_read_larger_than_the_target_is_refused(target: tuple[str, Any]) -> None:
    info, _proc = target
    with pytest.raises(ValueError, match="less than one READ"):
        raw_nixl.read_in_worker(None, info, "none", CHUNK, CHUNKS * SLOTS + 1)
