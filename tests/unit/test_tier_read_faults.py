"""A load whose chunk its lower tier cannot read is a fault that says so (``tier_read_failed``).

Before, such a load was silent in tiercache's log: vLLM recomputed ("Recovered
from KV load failure") and nothing named the tier. bench/serve.py met it when a
cache server sized by whole chunks evicted the per-head shards a lookup had
just found: every load from it failed, and only vLLM's line said anything. The
worker pipeline with a real disk tier: a load of a chunk the tier holds is no
fault (the control); a load of one it does not hold is counted once, with the
tier named, and its blocks are left as they were.
"""

from __future__ import annotations

import pathlib

import pytest

from tiercache import faults
from tiercache.backends.disk.backend import DiskBackend
from tiercache.backends.disk.settings import DiskSettings
from tiercache.testing.pipeline_rig import TIER, PipelineRig
from tiercache.testing.pipeline_rig import rig_key as key
from tiercache.transfer.device import CopySegment


def test_a_chunk_its_tier_does_not_hold_is_a_named_fault(tmp_path: pathlib.Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    faults.reset_for_tests()
    rig = PipelineRig(lambda ctx: DiskBackend(DiskSettings(root=tmp_path, fsync="none"), ctx), 5.0, 5.0)
    try:
        assert rig.store_and_demote(key(1), 0, (3, 4)).ok
        _, _, held = rig.load((key(1),), (CopySegment(2, 0, (9, 10)),), (TIER,))
        assert held.ok_keys == (key(1),) and faults.take().get(faults.TIER_READ_FAILED) is None  # control
        rig.mark([11, 12])
        with caplog.at_level("WARNING", logger="tiercache.faults"):
            _, _, res = rig.load((key(2),), (CopySegment(3, 0, (11, 12)),), (TIER,))
        assert res.failed_keys == (key(2),) and rig.marked([11, 12])
        assert faults.take().get(faults.TIER_READ_FAILED) == 1
        assert any(f"tier {TIER}" in r.getMessage() and "tier_read_failed" in r.getMessage() for r in caplog.records)
    finally:
        rig.close()
