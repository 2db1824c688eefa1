"""The worker's P/D role: a producer's side-channel endpoint, a consumer's peer tier, and their per-step hooks.

Made by :class:`~tiercache.connector.worker.TierCacheWorker` when P/D is on
(tiercache.connector.pd.roles: the hooks, and the null object used when it is
off). What it adds to the worker's step:

* **Producer** (kv_role ``kv_producer``, or ``kv_both`` with ``pd``): a
  :class:`~tiercache.pd.producer.ProducerEndpoint` serves consumers' handshakes
  (authenticated with ``pd.secret``) and read notices (checked against the
  release key of each step's metadata) on its side channel and registers the
  host slab (mode via_host) or the KV blocks (mode direct) with NIXL. Every host slot a store
  or a staged load is about to write gets its tag cleared first
  (``slot_filling``), and named again once the copy finished
  (:meth:`PDWorker.job_done`), so a consumer never READs a half-written slot.
  Mode direct marks the blocks of each prefill the scheduler names, right
  after the forward pass that wrote them (:meth:`PDWorker.after_stores`).
  Mode via_host waits for the step's stores, so a consumer may read them the
  moment the request finishes (an idle engine runs no later step).
* **Consumer** (kv_role ``kv_consumer``, or ``kv_both`` with ``pd``): a
  :class:`~tiercache.pd.peer_tier.NixlPeerTier` is the pipeline's block reader
  for tier ``peer``: load chunks from it (:class:`tiercache.jobs.FromReader`,
  the producer memory named in ``where``) are READ straight into the blocks.

Threading: the worker's main thread; the endpoint's side-channel thread is
its own (tiercache.pd.producer).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tiercache.connector.pd.roles import CONSUMER_ROLES, PRODUCER_ROLES, HostSlabSettings, WorkerPD
from tiercache.connector.pd.step import PDStepMeta, PDWorkerReport

from tiercache.backend import JobResult
from tiercache.config.pd import parse_producer
from tiercache.config.schema import PDConfig
from tiercache.jobs import FromTier, LoadJob, StoreJob
from tiercache.layout import SlotLayout
from tiercache.pd.blocks import BlockRegions
from tiercache.pd.handoff import fingerprint
from tiercache.pd.heads import page_heads
from tiercache.pd.peer_tier import PEER_TIER, NixlPeerTier
from tiercache.pd.producer import ProducerEndpoint
from tiercache.pd.side_channel import ChannelLimits
from tiercache.pd.trust import ProducerTrust
from tiercache.transfer.huge_pages import collapse_tensors

if TYPE_CHECKING:
    import torch
    from tiercache.connector.engine_info import ChunkGeometry

    from tiercache.keys import KeySpace
    from tiercache.layout import KVBlockLayout
    from tiercache.transfer.engine import TransferEngine
    from tiercache.transfer.pipeline import BlockReader, WorkerPipeline

logger = logging.getLogger(__name__)


class PDWorker(WorkerPD):
    """P/D on a worker: the producer endpoint and/or the consumer's peer tier (kv_both: both)."""

    def __init__(self, settings: PDConfig, kv_role: str, geometry: ChunkGeometry, rank: int) -> None:
        self.settings = settings
        self.is_producer = kv_role in PRODUCER_ROLES
        self.is_consumer = kv_role in CONSUMER_ROLES
        self.geometry = geometry
        self.rank = rank
        self.endpoint: ProducerEndpoint | None = None
        self.peer: NixlPeerTier | None = None
        self._stores: dict[int, StoreJob] = {}  # producer: stores whose slots get named when they finish
        self._staged_slots: dict[int, list[tuple[bytes, int]]] = {}  # producer: staged loads' slots, likewise

    def host_slab(self, prefault: bool | None, layout: SlotLayout | None) -> HostSlabSettings:
        # NIXL READs land in (consumer) or are served from (producer) host slots: prefaulted;
        # a via_host producer's consumers READ a few runs per region from a planes slab
        planes = self.settings.mode == "via_host" and self.is_producer
        return HostSlabSettings(True if prefault is None else prefault, self.settings.huge_pages,
                                layout or ("planes" if planes else "slots"))

    def register(self, kv_caches: dict[str, torch.Tensor], layout: KVBlockLayout, transfer: TransferEngine,
                 keyspace: KeySpace, num_blocks: int) -> dict[str, BlockReader]:
        pd = self.settings
        if pd.huge_pages:  # before NIXL registers them: a READ from (producer) or into (consumer) them
            report = collapse_tensors(kv_caches.values())
            if report.requested_bytes:
                logger.info("tiercache P/D: KV tensors in host memory: %s", report.describe())
        if transfer.host.huge_pages is not None:
            logger.info("tiercache P/D: host slab: %s", transfer.host.huge_pages.describe())
        # the handshake also checks that both sides' NIXL agents can talk to each other
        fp = {**fingerprint(keyspace.namespace), "nixl_error_handling": pd.nixl_error_handling}
        blocks = BlockRegions.from_layout(layout)
        engine = self.geometry.engine  # pages by KV head: hand-offs between TP sizes (tiercache.pd.heads)
        heads = page_heads(kv_caches, num_blocks, engine.kv_heads, engine.tp_size, self.rank, engine.local_kv_heads)
        readers: dict[str, BlockReader] = {}
        key = pd.secret_key()  # the side channel's shared secret (empty: none, loopback only)
        if self.is_producer:
            progress = pd.busy_progress if pd.busy_progress is not None else pd.nixl_error_handling == "peer"
            planes = transfer.planes
            self.endpoint = ProducerEndpoint(transfer.host.slab.data_ptr(), self.geometry.slot_bytes,
                                             self.geometry.host_slots, fp, pd.host, pd.port + self.rank,
                                             pd.nixl_error_handling, progress,
                                             blocks if pd.mode == "direct" else None,
                                             BlockRegions.from_planes(planes) if planes is not None else None,
                                             page_heads=heads, key=key, pages=blocks.pages,
                                             limits=ChannelLimits(pd.max_connections, pd.max_connections_per_peer,
                                                                  pd.handshake_timeout_s, pd.idle_timeout_s))
        if self.is_consumer:
            self.peer = NixlPeerTier(self.geometry.slot_bytes, fp, self.rank, pd.read_timeout_s,
                                     pd.nixl_error_handling, num_blocks, key=key,
                                     trust=ProducerTrust(pd.trusted_producers, has_secret=bool(key)))
            self.peer.expose_blocks(blocks)  # hand-offs are READ straight into the blocks
            self.peer.page_heads = heads
            named = (parse_producer(entry) for entry in pd.trusted_producers)
            self.peer.warm_up([(host, port) for host, port in named if port is not None], pd.warm_up_s)
            readers[PEER_TIER] = self.peer
        return readers

    def before_loads(self, meta: PDStepMeta | None, loads: Sequence[LoadJob], report: PDWorkerReport) -> None:
        endpoint = self.endpoint
        if endpoint is None:
            return
        meta = meta or PDStepMeta()
        endpoint.set_release_key(meta.release_key)  # read notices must carry the hand-off's token
        endpoint.set_holding(meta.handoffs_held)
        for rid in meta.direct_unmarks:
            endpoint.release_blocks(rid)  # vLLM frees these blocks itself: nothing to report
        for rid in meta.direct_released:
            endpoint.release_blocks(rid)  # cleared here (now or at the read): the scheduler unpins
            report.blocks_released[rid] = {self.rank}
        for job in loads:  # a staged load writes host slots too: unreadable until its copy ends
            filled = [(c.key, c.source.slot) for c in job.chunks if isinstance(c.source, FromTier)]
            if filled:
                endpoint.slot_filling([slot for _, slot in filled])
                self._staged_slots[job.job_id] = filled

    def before_stores(self, meta: PDStepMeta | None, stores: Sequence[StoreJob]) -> None:
        endpoint = self.endpoint
        if endpoint is None:
            return
        # Mode direct: the forward pass just wrote these prompts' KV; consumers may read
        # them as soon as the request finishes, without another step here.
        for rid, hold in (meta.direct_holds if meta is not None else {}).items():
            endpoint.hold_blocks(rid, hold.keys, hold.blocks)
        for job in stores:  # unreadable from now until the copy into them ends (job_done)
            endpoint.slot_filling(job.slots())
            self._stores[job.job_id] = job

    def after_stores(self, stores: Sequence[StoreJob], pipeline: WorkerPipeline) -> list[JobResult]:
        if self.endpoint is None or not stores or self.settings.mode != "via_host":
            return []
        # A producer's step ends with its chunks in host memory (mode via_host): a
        # consumer may ask for them the moment the request finishes, and an idle
        # engine runs no further step that would notice the copies completing.
        return pipeline.wait_for([job.job_id for job in stores])

    def poll(self, report: PDWorkerReport) -> None:
        if self.endpoint is not None:
            # Each step: the hand-offs consumers reported read (the side-channel thread
            # heard them meanwhile); mode direct: their blocks go back to vLLM.
            for rid in self.endpoint.service():
                report.handoffs_read.setdefault(rid, set()).add(self.rank)
                if self.endpoint.release_blocks(rid):  # mode direct: tags cleared, the scheduler unpins
                    report.blocks_released[rid] = {self.rank}
        if self.peer is not None:
            report.transfers += self.peer.take_transfers()

    def job_done(self, result: JobResult) -> None:
        """Producer: host slots whose copy finished may now be read by consumers."""
        if self.endpoint is None:
            return
        failed = set(result.failed_keys)
        store = self._stores.pop(result.job_id, None)
        pairs = list(zip(store.keys, store.slots())) if store else []  # a hybrid model's key has several segments
        pairs += self._staged_slots.pop(result.job_id, [])
        ok = [(k, slot) for k, slot in pairs if k not in failed]
        if ok:
            self.endpoint.slot_filled([k for k, _ in ok], [slot for _, slot in ok])

    def close(self) -> None:
        if self.peer is not None:
            self.peer.close()  # a block reader, not a TierIO backend: closed here
            self.peer = None
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
