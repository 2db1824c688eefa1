"""The conformance kit's fault half: what the *engine side* does with a backend, however it behaves.

:class:`BackendConformance` (conformance.py) holds a backend to its contract.
This kit holds tiercache to its own: whatever a lower tier does (answers
honestly, never reports, raises from every call, returns other bytes with an
"ok"), a load through the worker pipeline ends by the load deadline, and its
chunks either arrive byte-exact in their blocks or are failed (vLLM
recomputes them) with the blocks untouched; the pipeline keeps working
afterwards. A backend author runs it against a backend too::

    from tiercache.testing.conformance_faults import EngineSideChecks

    class TestMyStoreFaults(EngineSideChecks):
        def make_backend(self, context):
            return MyStoreBackend(MyStoreBackend.settings_model(...), context)

``expect_loads`` says what an honest backend's loads do (arrive); the kit's
own misbehaving backends (tiercache/testing/faulty_backends.py) set it to
False: their loads must be recomputed.

Threading: the test's thread only.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import pytest
import torch

from tiercache import faults
from tiercache.backend import Backend, BackendContext
from tiercache.testing.pipeline_rig import PipelineRig, rig_key
from tiercache.transfer.device import CopySegment


class EngineSideChecks:
    """Subclass and implement :meth:`make_backend`; see the module docstring."""

    #: Whether the backend's loads arrive (an honest backend) or must be recomputed (a faulty one).
    expect_loads: ClassVar[bool] = True
    #: The pipeline's deadlines in these tests, and the scheduling slack allowed on top.
    load_deadline_s: ClassVar[float] = 0.5
    slack_s: ClassVar[float] = 0.5

    def make_backend(self, context: BackendContext) -> Backend:
        raise NotImplementedError("an engine-side suite must implement make_backend()")

    @pytest.fixture
    def rig(self) -> Iterator[PipelineRig]:
        faults.reset_for_tests()
        rig = PipelineRig(self.make_backend, self.load_deadline_s, self.load_deadline_s)
        yield rig
        rig.close()

    def test_a_staged_load_arrives_exact_or_is_recomputed_by_the_deadline(self, rig: PipelineRig) -> None:
        k = rig_key(1)
        expected = rig.blocks([3, 4])
        demoted = rig.store_and_demote(k, 0, (3, 4))
        rig.transfer.host.slab[0].zero_()  # only the lower tier may hold it now
        rig.mark([9, 10])
        _, waited, res = rig.load((k,), (CopySegment(2, 0, (9, 10)),), ("lower",))
        assert waited < self.load_deadline_s + self.slack_s, f"the load took {waited:.2f}s"
        if res.ok_keys:
            assert all(torch.equal(g, w) for g, w in zip(rig.blocks([9, 10]), expected)), \
                "a load reported ok put other bytes into the blocks"
        else:
            assert res.failed_keys == (k,) and rig.marked([9, 10]), "a failed load wrote into the blocks"
        assert bool(res.ok_keys) == (self.expect_loads and demoted.ok), \
            f"expected the load to {'arrive' if self.expect_loads else 'be recomputed'}: {res}"

    def test_the_pipeline_keeps_serving_after_the_backend_misbehaved(self, rig: PipelineRig) -> None:
        k, other = rig_key(1), rig_key(2)
        rig.store_and_demote(k, 0, (3, 4))
        rig.transfer.host.slab[0].zero_()
        rig.load((k,), (CopySegment(2, 0, (9, 10)),), ("lower",))
        expected = rig.blocks([5, 6])
        assert rig.store(other, 1, (5, 6)).ok  # the host tier's own path, after the fault
        rig.mark([11, 12])
        _, _, res = rig.load((other,), (CopySegment(1, 0, (11, 12)),), (None,))
        assert res.ok_keys == (other,)
        assert all(torch.equal(g, w) for g, w in zip(rig.blocks([11, 12]), expected))
        rig.pipe.delete({"lower": [k]})  # housekeeping never raises into the worker either
        rig.pipe.poll()
