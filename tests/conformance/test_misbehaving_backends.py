"""The engine side against misbehaving lower tiers (tiercache/testing/conformance_faults.py).

Each faulty backend of tiercache/testing/faulty_backends.py, named by import
path as a config would name it, must end as a recompute: never wrong bytes in
the blocks, never a wait past the load deadline, never an exception. Two
honest backends (the disk tier, and the wrong-bytes backend's memory store
read back honestly) show the checks pass loads that arrive. Negative control:
with the core's integrity check switched off, the wrong-bytes backend's
garbage reaches the blocks, so the check is what catches it (the backend does
not frame: a plugin's own framing is the only other line of defence).
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import ClassVar

import pytest
import torch
from tiercache.backends.disk.backend import DiskBackend, DiskSettings

from tiercache import faults
from tiercache.backend import Backend, BackendContext
from tiercache.config.schema import load_config
from tiercache.transfer.device import CopySegment
from tiercache.tiers.registry import backend_class, create_backend
from tiercache.testing import faulty_backends as fb
from tiercache.testing.conformance_faults import EngineSideChecks
from tiercache.testing.pipeline_rig import PipelineRig, rig_key


def by_path(path: str, **options: object) -> Callable[[BackendContext], Backend]:
    """How a config naming ``backend: <path>`` builds the tier's backend."""
    config = load_config(tiers=[{"name": "cpu", "backend": "cpu", "capacity": "1MiB"},
                                {"name": "lower", "backend": path, "capacity": "1GiB", "options": options}])
    return lambda ctx: create_backend(config.tiers[1], ctx)


class TestNeverReports(EngineSideChecks):
    expect_loads = False

    def make_backend(self, context: BackendContext) -> Backend:
        return by_path(fb.NEVER_REPORTS)(context)


class TestRaisesFromEveryCall(EngineSideChecks):
    expect_loads = False

    def make_backend(self, context: BackendContext) -> Backend:
        return by_path(fb.RAISES)(context)


class TestWrongBytes(EngineSideChecks):
    expect_loads = False

    def make_backend(self, context: BackendContext) -> Backend:
        return by_path(fb.WRONG_BYTES)(context)


class _Honest(fb.WrongBytesBackend):
    def submit_get(self, job_id, keys, views) -> None:  # type: ignore[no-untyped-def]
        self._get_now(job_id, keys, views)


class TestHonestUnframedMemory(EngineSideChecks):
    """An unframed plugin that answers honestly: the core's check lets its loads through."""

    def make_backend(self, context: BackendContext) -> Backend:
        return _Honest(fb.FaultySettings(), context)


class TestDisk(EngineSideChecks):
    root: ClassVar[pathlib.Path]

    @pytest.fixture(autouse=True)
    def _root(self, tmp_path: pathlib.Path) -> None:
        type(self).root = tmp_path

    def make_backend(self, context: BackendContext) -> Backend:
        return DiskBackend(DiskSettings(root=self.root / "disk", io_threads=1, fsync="none"), context)


def test_the_faulty_backends_are_found_by_import_path() -> None:
    for path, name in ((fb.NEVER_REPORTS, "never_reports"), (fb.RAISES, "raises"), (fb.WRONG_BYTES, "wrong_bytes")):
        assert backend_class(path).name == name


def test_without_the_core_check_wrong_bytes_reach_the_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fb.WrongBytesBackend, "verifies_integrity", True)  # pretend it frames: no core check
    rig = PipelineRig(lambda ctx: fb.WrongBytesBackend(fb.FaultySettings(), ctx), 0.5, 0.5)
    try:
        k = rig_key(1)
        expected = rig.blocks([3, 4])
        assert rig.store_and_demote(k, 0, (3, 4)).ok
        _, _, res = rig.load((k,), (CopySegment(2, 0, (9, 10)),), ("lower",))
        assert res.ok_keys == (k,)
        assert not all(torch.equal(g, w) for g, w in zip(rig.blocks([9, 10]), expected))  # wrong KV in the blocks
    finally:
        rig.close()
    faults.reset_for_tests()
