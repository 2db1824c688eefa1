"""The connector's halves when tiercache declines a model: vLLM serves it, tiercache stores nothing.

A model whose KV-cache groups tiercache cannot serve (state layers outside
vLLM's "align" mode or with several pipeline stages, chunked local attention:
connector/kv_groups.py raises ``UnsupportedKVGroups``) must still start: the connector then says so in one
WARNING and runs these null halves. Every lookup is a miss, no job is planned,
nothing is allocated (no host slab), so vLLM behaves as without a connector.
"""

from __future__ import annotations

from typing import Any

from tiercache.connector.metadata import TierCacheConnectorMetadata


class InactiveScheduler:
    """Scheduler half that never hits and plans nothing."""

    block_size = 1
    bpc = 1

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        return None

    def handshake(self, metadata: Any) -> None:
        return None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> TierCacheConnectorMetadata:
        return TierCacheConnectorMetadata()

    def update_connector_output(self, worker_meta: Any) -> None:
        return None

    def request_finished(self, request: Any, block_ids: Any = None) -> tuple[bool, None]:
        return False, None

    def has_pending_work(self) -> bool:
        return False

    def take_events(self) -> list[Any]:
        return []

    def take_counters(self) -> dict[str, float]:
        return {}

    def reset(self) -> bool:
        return True

    def shutdown(self) -> None:
        return None


class InactiveWorker:
    """Worker half that registers nothing and moves nothing."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def register_kv_caches(self, kv_caches: Any) -> None:
        return None

    def handle_preemptions(self, meta: Any) -> None:
        return None

    def start_load_kv(self, meta: Any) -> None:
        return None

    def wait_for_save(self, meta: Any) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        return set(), set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def build_worker_meta(self) -> None:
        return None

    def shutdown(self) -> None:
        return None
