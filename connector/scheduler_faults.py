"""The scheduler's side of fault containment: what vLLM is told when a scheduler method raised.

A mixin of :class:`tiercache.connector.scheduler.TierCacheScheduler`. The
connector's facade (connector/vllm.py) catches every exception; for the two
methods whose failure vLLM would otherwise act on, it calls these:

* :meth:`fail_alloc` (``update_state_after_alloc`` raised): vLLM allocated
  blocks for tokens tiercache promised. Those blocks are reported failed (vLLM
  recomputes them) and, in ``load_mode: async``, the request is reported
  finished (``failed_recvs``) so it never waits for a load that does not exist;
  a load job already planned for it is withdrawn (pins released).
* :meth:`fallback_meta` (``build_connector_meta`` raised): an empty step for
  the workers, except that every load planned since the last step fails the
  same way (its blocks recomputed, its pins released).

Threading: the scheduler thread, like the rest of the scheduler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tiercache.connector.metadata import TierCacheConnectorMetadata

from tiercache import faults
from tiercache.jobs import LoadJob

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request


class SchedulerFaults:
    """Failing a request's planned load cleanly; mixed into TierCacheScheduler."""

    block_size: int
    _async_loads: bool
    _jobs: dict
    _reqs: dict
    _step_loads: list[LoadJob]
    _step_invalid: list[int]
    _step_failed_recvs: list[str]
    _by_request: bool  # a hybrid model: failures per request (failed_recving), never per block

    def _finish_job(self, rec: object) -> None:
        raise NotImplementedError

    def fail_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """``update_state_after_alloc`` raised: the promised tokens are recomputed."""
        try:
            rid = request.request_id
            for job in [j for j in self._step_loads if j.req_id == rid]:
                self._withdraw(job)
            if num_external_tokens <= 0:
                return
            st = self._reqs.get(rid)
            start = st.lookup_local_tokens if st is not None and st.lookup_local_tokens is not None \
                else request.num_computed_tokens
            bs = self.block_size
            block_ids = blocks.get_block_ids()[0]
            if not self._by_request:  # a hybrid model's: failed_recvs alone (the worker marks them failed)
                self._step_invalid.extend(block_ids[start // bs: -(-(start + num_external_tokens) // bs)])
            if self._async_loads:
                self._step_failed_recvs.append(rid)
        except Exception as exc:  # noqa: BLE001 - nothing more can be done here
            faults.record(faults.CONNECTOR_EXCEPTION, exc, where="update_state_after_alloc.fallback")

    def fallback_meta(self) -> TierCacheConnectorMetadata:
        """``build_connector_meta`` raised: fail this step's planned loads; no stores."""
        loads, self._step_loads = self._step_loads, []
        invalid, self._step_invalid = self._step_invalid, []
        failed_recvs, self._step_failed_recvs = self._step_failed_recvs, []
        try:
            for job in loads:
                if not self._by_request:
                    invalid.extend(job.block_ids())
                if self._async_loads:
                    failed_recvs.append(job.req_id)
                self._withdraw(job, listed=False)
        except Exception as exc:  # noqa: BLE001
            faults.record(faults.CONNECTOR_EXCEPTION, exc, where="build_connector_meta.fallback")
        return TierCacheConnectorMetadata(loads_are_sync=not self._async_loads, invalid_block_ids=invalid,
                                          failed_recvs=failed_recvs)

    def _withdraw(self, job: LoadJob, listed: bool = True) -> None:
        """A load job that will never reach the workers: closed as failed (pins released)."""
        if listed:
            self._step_loads.remove(job)
        rec = self._jobs.pop(job.job_id, None)
        if rec is not None:
            rec.failed = set(rec.keys)
            self._finish_job(rec)
