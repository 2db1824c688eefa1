"""A KV-events subscriber as a KV-aware router runs one: ZMQ SUB on vLLM's publisher, msgspec decoding.

It decodes the way vLLM's example subscriber does
(examples/online_serving/kv_events_subscriber.py): its own msgspec types
mirroring ``vllm.distributed.kv_events`` (no vLLM import: a router is another
program), one ``msgspec.msgpack.Decoder`` for the batch, and the publisher's
three-frame messages (topic, 8-byte big-endian sequence number, payload).

:class:`EventSubscriber` receives on a thread from before the engine starts
(ZMQ connects when both ends are up; :meth:`wait_connected` says when), keeps every batch with its sequence number, and hands out
the events flat and in publishing order. :class:`PrefixIndex` is the router's
side: it keeps which blocks each medium holds, and matches a prompt's token
ids block by block through the parent chain.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

BlockHash = int | bytes  # vLLM's ExternalBlockHash: 64-bit ints by default, raw bytes on request


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """A tagged event (the tag is the class name, as vLLM's)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventSubscriber:
    """Receives and decodes every batch a publisher sends on ``topic`` until :meth:`stop`."""

    def __init__(self, endpoint: str, topic: str = "", bind: bool = False) -> None:
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        # read by wait_connected only: the publisher reached us (bind), or we reached it
        self._monitor = self._sub.get_monitor_socket(zmq.EVENT_ACCEPTED if bind else zmq.EVENT_CONNECTED)
        if bind:  # vLLM connects its PUB to an endpoint without a wildcard (tcp://127.0.0.1:PORT)
            self._sub.bind(endpoint)
        else:  # ... and binds one with a wildcard (its default tcp://*:5557)
            self._sub.connect(endpoint)
        self._sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.batches: list[tuple[int, KVEventBatch]] = []  # (sequence number, batch), as received
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events-sub", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sub.poll(50):
                continue
            _topic, seq_bytes, payload = self._sub.recv_multipart()
            try:
                self.batches.append((int.from_bytes(seq_bytes, "big"), self._decoder.decode(payload)))
            except msgspec.DecodeError as exc:  # a wire format this subscriber does not know
                self.errors.append(str(exc))

    def wait_connected(self, timeout_s: float = 60, settle_s: float = 0.5) -> None:
        """Block until the publisher and the SUB socket are connected, then ``settle_s`` for its subscription
        to arrive there (a PUB drops what it sends before: start the engine's work after this)."""
        if self._monitor.poll(int(timeout_s * 1000)) == 0:
            raise TimeoutError(f"no connection with a KV events publisher in {timeout_s:.0f}s")
        recv_monitor_message(self._monitor)
        time.sleep(settle_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sub.disable_monitor()
        self._monitor.close(linger=0)
        self._sub.close(linger=0)
        self._context.term()

    def sequence_numbers(self) -> list[int]:
        return [seq for seq, _ in self.batches]

    def events(self) -> list[Event]:
        """Every event received, in publishing order."""
        return [event for _, batch in self.batches for event in batch.events]


class PrefixIndex:
    """A router's view: per medium, the blocks held; a prompt matched through token ids and parents.

    A block is known by ``(parent hash, its tokens)`` -> its hash: exactly what
    BlockStored carries. A removal forgets the block in that medium only.
    """

    def __init__(self) -> None:
        self.by_tokens: dict[tuple[BlockHash | None, tuple[int, ...]], BlockHash] = {}
        self.held: dict[str, dict[BlockHash, int]] = {}  # medium -> hash -> times announced there

    def apply(self, events: Iterable[Event]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                held = self.held.setdefault(event.medium or "", {})
                for h in event.block_hashes:
                    if held.get(h, 0) <= 1:
                        held.pop(h, None)
                    else:
                        held[h] -= 1
            else:  # vLLM's block pool was reset: the engine's own blocks (the tiers announce theirs)
                self.held.pop("GPU", None)

    def _stored(self, event: BlockStored) -> None:
        parent, size = event.parent_block_hash, event.block_size
        held = self.held.setdefault(event.medium or "", {})
        for i, h in enumerate(event.block_hashes):
            self.by_tokens[(parent, tuple(event.token_ids[i * size : (i + 1) * size]))] = h
            held[h] = held.get(h, 0) + 1
            parent = h

    def match(self, token_ids: Sequence[int], block_size: int, medium: str) -> int:
        """How many leading full blocks of ``token_ids`` ``medium`` holds, found by tokens and parents."""
        parent: BlockHash | None = None
        held = self.held.get(medium, {})
        for n in range(len(token_ids) // block_size):
            h = self.by_tokens.get((parent, tuple(token_ids[n * block_size : (n + 1) * block_size])))
            if h is None or h not in held:
                return n
            parent = h
        return len(token_ids) // block_size
