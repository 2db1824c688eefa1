"""What a P/D consumer knows of one handed-off chunk: its producer, where the producer holds it, how to check it.

Made by the consumer's scheduler from the hand-off params
(connector/pd/consumer.py) and carried to its worker in the load job
(:class:`tiercache.jobs.FromReader`'s ``where``); read by
:class:`tiercache.pd.peer_tier.NixlPeerTier` and its read plans. Pure data.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PeerSource:
    """Which producer handed a request's chunks off: its side channel, its request id and release token."""

    host: str
    port: int
    request_id: str
    tp_size: int = 0  # the producer's TP size (0: ours); another: our heads' sub-runs (tiercache.pd.heads)
    release_token: str = ""  # echoed in the read notice: only then does the producer release the hand-off


@dataclass(frozen=True)
class PeerChunk:
    """One handed-off chunk: its producer and where the producer holds it.

    Mode via_host: ``slot`` is the producer's host slot. Mode direct: ``slot``
    is -1 and ``blocks`` are the producer's KV blocks of the chunk. ``tag``: the
    key's :func:`tiercache.pd.channel.key_tag`, computed by the scheduler that
    learned the hand-off (off the worker's READ path); 0: computed at the read.
    ``verify``: each block read must match the producer's page hash
    (:mod:`tiercache.pd.page_hashes`), else the chunk fails; the scheduler
    stores only verified chunks (unless ``pd.store_unverified``).
    """

    source: PeerSource
    slot: int
    blocks: tuple[int, ...] = ()
    tag: int = 0
    verify: bool = False
