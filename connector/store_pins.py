"""Store pins: the engine blocks a planned store reads stay allocated until every rank copied them.

A store (:class:`~tiercache.jobs.StoreJob`) copies engine blocks into a host
slot on the workers' copy threads or stream, after the forward pass that
wrote them, and finishes some time later. Until then vLLM must not hand those
blocks to another request. The scheduler takes a reference on each of them
when it plans the store (:meth:`StorePins.hold`, in ``_plan_store``) and drops
it when the job's record is closed, i.e. once every worker reported the job
(:meth:`StorePins.release`, from ``update_connector_output``), whether the
copy succeeded or failed. A worker reports a store only once its device->host
copy is done (tiercache/transfer/pipeline.py: a store is engine blocks -> host
slot, nothing else; a store that could not start is reported failed without
having read anything). vLLM's own CPU offloader does the same
(``vllm/v1/simple_kv_offload/manager.py``: "touch GPU blocks to prevent
eviction during async copy").

The ordering contract, and the vLLM 0.32 code it relies on:

* ``vllm/v1/core/block_pool.py``: ``BlockPool.touch`` adds a reference (and
  takes a block with none out of the free queue); ``BlockPool.free_blocks``
  drops one and returns the block to the free queue at zero;
  ``BlockPool.get_new_blocks`` hands out only blocks from the free queue. So a
  pinned block is never reallocated, whoever else frees it.
* ``vllm/v1/core/sched/scheduler.py``: ``Scheduler._preempt_request`` frees a
  preempted request's blocks (``_free_request_blocks`` ->
  ``KVCacheManager.free``) without asking the connector, and
  ``Scheduler._free_request`` frees a finished request's blocks right after
  ``request_finished``; both drop only the request's own references.
* ``vllm/v1/worker/gpu/model_runner.py`` (the V2 runner, CUDA's default):
  ``GPUModelRunner.execute_model`` calls ``finish_requests``, ``free_states``,
  ``add_requests`` and ``update_requests`` *before*
  ``kv_connector.pre_forward`` (``vllm/v1/worker/gpu/kv_connector.py``:
  ``handle_preemptions``, ``bind_connector_metadata``, sync
  ``start_load_kv``); ``update_requests`` zeroes
  ``scheduler_output.new_block_ids_to_zero`` and applies
  ``kv_cache_block_copies`` (copy-on-write into new blocks). No worker hook
  runs between a block's reallocation and those writes, so no worker-side
  fence can protect a block being stored: only keeping it allocated can.
  Because the pin is taken in the same ``schedule()`` that plans the store
  (``build_connector_meta``), before any later schedule could reallocate the
  block, this holds for any hook order and with async scheduling.
* ``Scheduler.has_requests`` steps the engine while the connector's
  ``has_pending_push_work`` is true: the connector says so while any pin is
  outstanding (``TierCacheScheduler.has_pending_work``), so that the reports
  that release them arrive even when no request is left.
* ``BlockPool.reset_prefix_cache`` fails while any block is referenced:
  ``LLM.reset_prefix_cache()`` returns False for the step or two after a
  generate call whose last stores are still copying (callers retry, see
  tiercache/testing/engine_runner.py). A connector reset releases nothing (a
  copy may still be reading).

A store planned by a ``build_connector_meta`` that then raised never reaches
the workers (connector/guard.py sends an empty step instead): the next
``build_connector_meta`` closes such jobs as failed and releases their pins
(:meth:`StorePins.withdraw_unsent`).

Scheduler thread only, like everything on vLLM's block pool.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from tiercache.connector.block_pins import BlockPins, VllmBlockPins

if TYPE_CHECKING:
    from tiercache.connector.scheduler_state import JobRecord
    from vllm.v1.core.kv_cache_manager import KVCacheManager


class StorePins:
    """Per store job: the engine blocks it reads, referenced until the job is closed."""

    def __init__(self, pins: BlockPins | None = None) -> None:
        self.pins = pins  # None: no vLLM block pool bound (unit tests), nothing is pinned
        self._held: dict[int, tuple[BlockPins, tuple[int, ...]]] = {}
        self._unsent: list[int] = []  # planned by the build_connector_meta in progress

    def bind(self, pins: BlockPins | None) -> None:
        """Pin the blocks of stores planned from now on in ``pins`` (None: pin nothing)."""
        self.pins = pins

    def bind_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """Pin in vLLM's block pool; a stand-in manager without one (unit tests) pins nothing."""
        pool = getattr(kv_cache_manager, "block_pool", None)
        self.bind(None if pool is None else VllmBlockPins(pool))

    def hold(self, job_id: int, block_ids: Iterable[int]) -> None:
        """A store was planned: reference the blocks it reads."""
        self._unsent.append(job_id)
        if self.pins is None:
            return
        ids = tuple(block_ids)
        self.pins.pin(ids)
        self._held[job_id] = (self.pins, ids)

    def sent(self) -> None:
        """The stores planned so far are in a step's metadata: the workers will report them."""
        self._unsent = []

    def withdraw_unsent(self, jobs: dict[int, JobRecord],
                        finish: Callable[[JobRecord], None]) -> None:
        """Close as failed the stores of a step whose metadata never went out; drop their pins."""
        unsent, self._unsent = self._unsent, []
        for job_id in unsent:
            self.release(job_id)
            rec = jobs.pop(job_id, None)
            if rec is not None:
                rec.failed = set(rec.keys)
                finish(rec)

    def release(self, job_id: int) -> bool:
        """Every worker reported ``job_id`` (or it never reached them): drop its references."""
        held = self._held.pop(job_id, None)
        if held is None:
            return False
        pins, ids = held
        pins.unpin(ids)
        return True

    def release_all(self) -> int:
        """Shutdown: no block is handed out any more. Returns the jobs released."""
        job_ids = list(self._held)
        for job_id in job_ids:
            self.release(job_id)
        return len(job_ids)

    def __len__(self) -> int:
        """Store jobs whose blocks are pinned."""
        return len(self._held)

    def pinned(self) -> Counter[int]:
        """References held, by block id (a block read by two jobs has two)."""
        return Counter(b for _, ids in self._held.values() for b in ids)
