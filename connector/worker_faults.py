"""The worker's side of fault containment: jobs that cannot run end as recomputes, never as errors.

A mixin of :class:`tiercache.connector.worker.TierCacheWorker` (kept apart so
worker.py holds the per-step flow). Three ways a load ends without its bytes,
each reported to vLLM (failed blocks; ``finished_recving`` for an async load,
so its request never waits forever) and to the scheduler's manager:

* *unstarted* (:meth:`_fail_unstarted`): the pipeline refused the job before
  anything began: failed at once, to vLLM and to the manager;
* *given up* (:meth:`_give_up`): a sync load still running when the step must
  go on (the last-resort limit, or an exception in ``start_load_kv``): its
  blocks are reported failed now, the pipeline is told to write them no more
  (device copies in flight are awaited first), and its manager report comes
  from the pipeline when its reads end (the backend owns the staging slots
  until then);
* *past its deadline*: the pipeline does it all (tiercache/transfer/pipeline.py).

:meth:`fail_loads` and :meth:`fail_saves` are what the connector's facade
calls when ``start_load_kv`` or ``wait_for_save`` raised anyway.

Threading: the worker's main thread, like the rest of the worker.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tiercache import faults
from tiercache.backend import JobResult
from tiercache.jobs import DemoteJob, LoadJob, StoreJob

if TYPE_CHECKING:
    from tiercache.connector.metadata import TierCacheConnectorMetadata, TierCacheWorkerMetadata

    from tiercache.transfer.pipeline import WorkerPipeline


class WorkerFaults:
    """Failing jobs cleanly; mixed into TierCacheWorker (see the module docstring)."""

    engine: WorkerPipeline | None
    _loads: dict[int, LoadJob]
    _sync_jobs: set[int]
    _finished_recving: set[str]
    _invalid_blocks: set[int]
    _failed_recving: set[str]
    _by_request: bool
    _report: TierCacheWorkerMetadata
    _given_up: set[int]  # sync loads whose blocks were reported failed before their result
    _step_taken: set[int]  # jobs start_load_kv / wait_for_save took this step (for fail_loads / fail_saves)

    def _absorb(self, results: list[JobResult]) -> None:
        raise NotImplementedError

    def _start_load(self, engine: WorkerPipeline, spec: LoadJob, sync: bool) -> None:
        """Hand one load to the pipeline; one that cannot start fails alone."""
        self._step_taken.add(spec.job_id)
        self._loads[spec.job_id] = spec
        try:
            engine.submit(spec)
        except Exception as exc:  # noqa: BLE001 - nothing of it started (WorkerPipeline.submit)
            faults.record(faults.CONNECTOR_EXCEPTION, exc, where="start_load_kv")
            del self._loads[spec.job_id]
            self._fail_unstarted(spec, sync)

    def _wait_sync(self, engine: WorkerPipeline, job_ids: list[int]) -> None:
        """Sync loads: return once the forward pass will see their blocks hold their KV (or failed)."""
        self._sync_jobs.update(job_ids)
        # CUDA: a job whose device copy still runs is ordered before the compute stream (no host
        # wait); its result comes from a later poll. CPU: every job's result is here.
        results, on_device = engine.wait_before_compute(job_ids)
        self._absorb(results)
        self._give_up([self._loads[i] for i in job_ids
                       if i in self._loads and i not in self._given_up and i not in on_device])

    def _fail_load(self, spec: LoadJob, failed_keys: set[bytes]) -> None:
        """Tell vLLM which part of a load failed: the failed chunks' blocks (vLLM recomputes from the
        first), or, for a hybrid model (vLLM 0.32 takes no failed blocks with several KV-cache groups),
        the request (an async load: vLLM recomputes it from token 0)."""
        if self._by_request:
            self._failed_recving.add(spec.req_id)
            return
        for chunk in spec.chunks:
            if chunk.key in failed_keys:
                self._invalid_blocks.update(chunk.all_block_ids())

    def _fail_unstarted(self, spec: LoadJob, sync: bool) -> None:
        self._fail_load(spec, set(spec.keys))
        if not sync:
            self._finished_recving.add(spec.req_id)
        self._report.add(spec.job_id, spec.keys, 0, 0.0)

    def _give_up(self, specs: list[LoadJob]) -> None:
        if not specs or self.engine is None:
            return
        for spec in specs:
            self._given_up.add(spec.job_id)
            self._sync_jobs.discard(spec.job_id)
            self._invalid_blocks.update(spec.block_ids())
        self.engine.abandon([s.job_id for s in specs])
        self._absorb(self.engine.await_copies())  # no copy may still write those blocks

    def fail_loads(self, meta: TierCacheConnectorMetadata) -> None:
        """``start_load_kv`` raised: every load of ``meta`` ends as a recompute."""
        try:
            for spec in meta.loads:
                if spec.job_id not in self._step_taken:
                    self._fail_unstarted(spec, meta.loads_are_sync)
            if meta.loads_are_sync:
                self._give_up([s for s in meta.loads if s.job_id in self._loads and s.job_id not in self._given_up])
            self._invalid_blocks.update(meta.invalid_block_ids)
            self._finished_recving.update(meta.failed_recvs)
            if self._by_request:
                self._failed_recving.update(meta.failed_recvs)
                self._failed_recving.update(meta.failed_loads)
        except Exception as exc:  # noqa: BLE001
            faults.record(faults.CONNECTOR_EXCEPTION, exc, where="start_load_kv.fallback")

    def _start_save(self, submit: Callable[[Any], None], job: StoreJob | DemoteJob) -> None:
        """Hand one store or demotion to the pipeline; one that raises fails alone (a future miss)."""
        self._step_taken.add(job.job_id)
        try:
            submit(job)
        except Exception as exc:  # noqa: BLE001
            faults.record(faults.CONNECTOR_EXCEPTION, exc, where="wait_for_save")
            self._report.add(job.job_id, job.keys, 0, 0.0)

    def fail_saves(self, meta: TierCacheConnectorMetadata) -> None:
        """``wait_for_save`` raised: the stores and demotions it did not reach fail (future misses)."""
        try:
            for job in [*meta.stores, *meta.demotes]:
                if job.job_id not in self._step_taken:
                    self._report.add(job.job_id, job.keys, 0, 0.0)
        except Exception as exc:  # noqa: BLE001
            faults.record(faults.CONNECTOR_EXCEPTION, exc, where="wait_for_save.fallback")
