"""What tiercache needs to know about the vLLM engine, read once from its configs.

Both halves of the connector compute the same :class:`EngineGeometry` from the
same ``KVCacheConfig``, so the scheduler's slot count and the worker's slab
always agree; the worker then checks it against the real KV tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.config import VllmConfig
from vllm.v1.kv_cache_interface import KVCacheConfig

from tiercache.config.schema import ConfigError, TierCacheConfig
from tiercache.connector.kv_groups import STATE, KVGroup, block_bytes, describe_groups, engine_groups
from tiercache.keys import KeySpace, Namespace
from tiercache.shards import ShardSet, group_shards, head_shards, rank_shards


@dataclass(frozen=True)
class EngineGeometry:
    model: str
    kv_dtype: str
    kv_layout: str
    block_size: int
    tp_size: int
    world_size: int
    bytes_per_block: int  # one engine block, all layers, this worker's shard
    hash_algo: str
    kv_heads: int = 0  # global KV heads (MLA: 1, its latent is replicated); 0: unknown
    local_kv_heads: int = 1  # the KV heads one TP rank's pages hold
    pp_size: int = 1
    # content identities (connector/model_identity.py), set at start-up by namespace_check.with_identity
    model_identity: str = ""
    attention_identity: str = ""
    # the KV-cache groups (connector/kv_groups.py): one full-attention group unless the model is hybrid
    kv_groups: tuple[KVGroup, ...] = (KVGroup("full"),)

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> "EngineGeometry":
        # raises UnsupportedKVGroups (a ConfigError) for groups tiercache cannot serve
        kv_groups, layer_specs = engine_groups(kv_cache_config)
        cache = vllm_config.cache_config
        parallel = vllm_config.parallel_config
        hash_block = getattr(kv_cache_config, "hash_block_size", None)
        if hash_block not in (None, cache.block_size):
            raise ConfigError(
                f"engine hash_block_size {hash_block} differs from block_size {cache.block_size}"
            )
        return cls(
            model=str(vllm_config.model_config.model),
            kv_dtype=str(layer_specs[0].dtype),
            kv_layout=str(getattr(kv_cache_config, "kv_cache_layout", None) or "default"),
            block_size=cache.block_size,
            tp_size=parallel.tensor_parallel_size,
            world_size=parallel.world_size,
            bytes_per_block=block_bytes(kv_cache_config, kv_groups, layer_specs),
            hash_algo=str(getattr(cache, "prefix_caching_hash_algo", "sha256")),
            # a state-layer model's chunks are rank shards: a recurrent state is cut by channel, not KV head
            kv_heads=0 if any(g.kind == STATE for g in kv_groups) else _global_kv_heads(vllm_config),
            local_kv_heads=int(getattr(layer_specs[0], "num_kv_heads", 1)),
            pp_size=parallel.pipeline_parallel_size,
            kv_groups=kv_groups,
        )

    def shard_set(self, tp_rank: int, pp_rank: int = 0, head_sliceable: bool = True) -> ShardSet:
        """A worker's store shards (tiercache.shards): by head, or by rank if pages cannot be cut."""
        if self.kv_heads > 0 and head_sliceable:
            return head_shards(self.kv_heads, self.tp_size, tp_rank, pp_rank, self.pp_size)
        return rank_shards(self.tp_size, tp_rank, pp_rank, self.pp_size)

    def group_shard_set(self) -> ShardSet:
        """The scheduler's: a chunk is in a lower tier when every head's shard is."""
        if self.kv_heads > 0:
            return group_shards(self.kv_heads, self.pp_size)
        return rank_shards(self.tp_size, 0, 0, self.pp_size)


def parallel_rank() -> tuple[int, int]:
    """This worker's (pp_rank, tp_rank), as vLLM keys handshake metadata; 0 for a group not set up
    (the scheduler process, unit tests)."""
    from vllm.distributed import parallel_state

    def rank_in(group: str) -> int:
        try:
            return int(getattr(parallel_state, group)().rank_in_group)
        except Exception:  # noqa: BLE001 - no such group in this process
            return 0

    return rank_in("get_pp_group"), rank_in("get_tp_group")


def _global_kv_heads(vllm_config: VllmConfig) -> int:
    model = vllm_config.model_config
    if getattr(model, "use_mla", False):
        return 1
    try:
        return int(model.get_total_num_kv_heads())
    except Exception:  # noqa: BLE001 - an unusual model config: fall back to rank shards
        return 0


@dataclass(frozen=True)
class ChunkGeometry:
    """The engine geometry combined with tiercache's config: chunk sizes, slots, keys."""

    engine: EngineGeometry
    chunk_tokens: int
    blocks_per_chunk: int  # engine blocks of one KV-cache group per chunk (tokens / block size)
    slot_bytes: int
    host_slots: int

    @property
    def slot_blocks(self) -> int:
        """Engine blocks one chunk slot holds: ``blocks_per_chunk`` per KV-cache group, group ``g``'s
        at positions ``g * blocks_per_chunk ..`` (what the copiers and lower tiers see as a chunk)."""
        return self.blocks_per_chunk * len(self.engine.kv_groups)

    @classmethod
    def build(cls, config: TierCacheConfig, engine: EngineGeometry) -> "ChunkGeometry":
        config.check_engine(engine.block_size)
        bpc = config.chunk_tokens // engine.block_size
        slot_bytes = engine.bytes_per_block * bpc * len(engine.kv_groups)
        host_slots = config.host_tier.capacity // slot_bytes
        if host_slots < 1:
            raise ConfigError(
                f"tiers.0.capacity: {config.host_tier.capacity} bytes holds no chunk "
                f"(one chunk of {config.chunk_tokens} tokens is {slot_bytes} bytes here)"
            )
        return cls(engine, config.chunk_tokens, bpc, slot_bytes, host_slots)

    @property
    def shard_bytes(self) -> int:
        """One store shard: one KV head's bytes of a chunk (a rank's whole chunk for rank shards)."""
        e = self.engine
        if e.kv_heads > 0 and self.slot_bytes % e.local_kv_heads == 0:
            return self.slot_bytes // e.local_kv_heads
        return self.slot_bytes

    def keyspace(self, config: TierCacheConfig) -> KeySpace:
        e = self.engine
        namespace = Namespace(
            model=e.model,
            kv_dtype=e.kv_dtype,
            kv_layout=e.kv_layout,
            block_size=e.block_size,
            chunk_tokens=self.chunk_tokens,
            tp_size=e.tp_size,
            bytes_per_chunk=self.slot_bytes,
            hash_algo=e.hash_algo,
            tenant_salt=config.namespace_salt,
            process_nonce=Namespace.hash_algo_nonce(e.hash_algo),
            kv_heads=e.kv_heads,
            pp_size=e.pp_size,
            shard_bytes=self.shard_bytes,
            model_identity=e.model_identity,
            attention_identity=e.attention_identity,
            kv_groups=describe_groups(e.kv_groups),
        )
        return KeySpace(namespace, self.blocks_per_chunk)
