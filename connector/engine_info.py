"""What tiercache needs to know about the vLLM engine, read once from its configs.

Both halves of the connector compute the same :class:`EngineGeometry` from the
same ``KVCacheConfig``, so the scheduler's slot count and the worker's slab
always agree; the worker then checks it against the real KV tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.config import VllmConfig
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheConfig, UniformTypeKVCacheSpecs

from tiercache.config import ConfigError, TierCacheConfig
from tiercache.keys import KeySpace, Namespace


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

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> "EngineGeometry":
        groups = [g for g in kv_cache_config.kv_cache_groups if getattr(g, "enable_kv_transfer", True)]
        if len(groups) != 1:
            kinds = [type(g.kv_cache_spec).__name__ for g in groups]
            raise ConfigError(
                f"tiercache supports models with one KV-cache group (plain full attention); "
                f"this model has {len(groups)}: {kinds}"
            )
        spec = groups[0].kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            layer_specs = list(spec.kv_cache_specs.values())
        else:
            layer_specs = [spec] * len(groups[0].layer_names)
        if not all(isinstance(s, AttentionSpec) for s in layer_specs):
            raise ConfigError(
                f"tiercache supports attention KV caches only, got {type(spec).__name__}"
            )
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
            bytes_per_block=sum(s.page_size_bytes for s in layer_specs),
            hash_algo=str(getattr(cache, "prefix_caching_hash_algo", "sha256")),
        )


@dataclass(frozen=True)
class ChunkGeometry:
    """The engine geometry combined with tiercache's config: chunk sizes, slots, keys."""

    engine: EngineGeometry
    chunk_tokens: int
    blocks_per_chunk: int
    slot_bytes: int
    host_slots: int

    @classmethod
    def build(cls, config: TierCacheConfig, engine: EngineGeometry) -> "ChunkGeometry":
        config.check_engine(engine.block_size)
        bpc = config.chunk_tokens // engine.block_size
        slot_bytes = engine.bytes_per_block * bpc
        host_slots = config.host_tier.capacity // slot_bytes
        if host_slots < 1:
            raise ConfigError(
                f"tiers.0.capacity: {config.host_tier.capacity} bytes holds no chunk "
                f"(one chunk of {config.chunk_tokens} tokens is {slot_bytes} bytes here)"
            )
        return cls(engine, config.chunk_tokens, bpc, slot_bytes, host_slots)

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
        )
        return KeySpace(namespace, self.blocks_per_chunk)
