"""The connector's scheduler half over a real disk tier, no engine: a harness for lookup and load tests.

Engine blocks of ``BLOCK`` tokens and ``BLOCK_BYTES`` bytes, one block per chunk,
a host tier of ``host_slots`` chunks in front of a disk tier under ``root``.
Requests are plain namespaces with what the scheduler half reads of vLLM's.
"""

from __future__ import annotations

import pathlib
from types import SimpleNamespace
from typing import Any

from tiercache.connector.engine_info import ChunkGeometry, EngineGeometry
from tiercache.connector.scheduler import TierCacheScheduler

from tiercache.config.schema import load_config

BLOCK = 32
BLOCK_BYTES = 4096


def disk_scheduler(root: pathlib.Path, host_slots: int, **config: Any) -> TierCacheScheduler:
    """A scheduler half with a host tier of ``host_slots`` chunks and a 1 MiB disk tier under ``root``."""
    cfg = load_config(chunk_tokens=BLOCK, tiers=[
        {"name": "cpu", "backend": "cpu", "capacity": host_slots * BLOCK_BYTES},
        {"name": "ssd", "backend": "disk", "capacity": "1MiB", "options": {"root": str(root)}},
    ], **config)
    engine = EngineGeometry(model="m", kv_dtype="torch.float32", kv_layout="NHD", block_size=BLOCK, tp_size=1,
                            world_size=1, bytes_per_block=BLOCK_BYTES, hash_algo="sha256")
    sched = TierCacheScheduler(cfg, ChunkGeometry.build(cfg, engine))
    sched.bind_kv_cache_manager(SimpleNamespace(get_block_ids=lambda rid: (list(range(1, 9)),), block_pool=None))
    return sched


def request(rid: str, chunks: int, salt: int) -> SimpleNamespace:
    """A prompt of ``chunks`` whole chunks and one token; requests with the same ``salt`` share them."""
    tokens = chunks * BLOCK + 1
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(tokens)), num_prompt_tokens=tokens,
                           num_tokens=tokens, num_computed_tokens=0, kv_transfer_params=None,
                           block_hashes=[bytes([salt, i]) * 16 for i in range(chunks)])


def blocks() -> SimpleNamespace:
    """vLLM's blocks of a request (update_state_after_alloc): blocks 1..8 in the one KV-cache group."""
    return SimpleNamespace(get_block_ids=lambda: (list(range(1, 9)),))


def step_output() -> SimpleNamespace:
    """A scheduler step with nothing scheduled (build_connector_meta)."""
    return SimpleNamespace(num_scheduled_tokens={}, finished_req_ids=set(), preempted_req_ids=None)
