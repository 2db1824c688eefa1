"""tiercache configuration: typed, frozen, validated before anything is allocated.

Sources, highest precedence first:

1. inline overrides (the keys of vLLM's ``kv_connector_extra_config`` other
   than ``config_file`` and ``preset``, or keyword arguments to
   :func:`load_config`; dotted keys such as ``metrics.port`` set one key of a
   section);
2. ``TIERCACHE_*`` environment variables (nested keys with ``__``, e.g.
   ``TIERCACHE_CHUNK_TOKENS=512``, ``TIERCACHE_METRICS__PORT=9400``; lists such
   as ``TIERCACHE_TIERS`` are JSON);
3. the YAML file named by ``config_file``, or the packaged preset named by
   ``preset`` (``TIERCACHE_PRESET``; tiercache/config/presets.py);
4. the defaults below.

The one-key sizes ``cpu_size``, ``disk_size``, ``disk_path``
(tiercache/config/shorthands.py) are applied last, to the tier list the
sources above produced.

Every model forbids unknown keys, so a typo is an error that names the key.
Sizes accept ints or strings like ``"16GiB"``. Engine-dependent checks (the
chunk size must be a multiple of the engine block size) are made by
:meth:`TierCacheConfig.check_engine`, which the connector calls at start-up.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic_settings import SettingsConfigDict

from tiercache.config.pd import PDConfig as PDConfig  # re-exported: its home before it grew
from tiercache.config.presets import resolve_config_file
from tiercache.config.shorthands import expand_dotted, expand_sizes
from tiercache.config.sizes import parse_size

# ConfigError is defined in yaml_config (shared with the server's config); callers import it here.
from tiercache.config.yaml_file import ConfigError, YamlBackedSettings, load_settings

ByteSize = Annotated[int, BeforeValidator(parse_size), Field(ge=0)]
PolicyName = Literal["lru", "arc"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]


def _upper(value: Any) -> Any:
    return value.strip().upper() if isinstance(value, str) else value


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TierConfig(_Frozen):
    """One storage tier. The first tier in the list is the host-memory staging tier."""

    name: str = Field(description="Unique tier name, used in metrics and stats.")
    backend: str = Field(
        default="cpu", description="Backend plugin name (built-in or entry point)."
    )
    capacity: ByteSize = Field(description="Byte budget this tier never exceeds.")
    policy: PolicyName = Field(default="lru", description="Eviction policy of this tier.")
    mode: Literal["write_through", "write_back"] = Field(
        default="write_through",
        description="Lower tiers: receive every chunk the host tier stores (write_through), or "
        "the host tier's coldest chunks when it runs full (write_back).",
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="Backend-specific settings, validated by the backend."
    )


HOST_BACKEND = "cpu"  # the host tier: the core's own slab, first in every chain, never a plugin


def check_host_first(tiers: Sequence[TierConfig], host_is: str) -> None:
    """ValueError unless tier 0 is the host tier and no other tier is (``host_is`` says what it is)."""
    if tiers[0].backend != HOST_BACKEND:
        raise ValueError(
            f"tiers.0.backend: the first tier is {host_is} and must be {HOST_BACKEND!r}, got {tiers[0].backend!r}"
        )
    for index, tier in enumerate(tiers[1:], start=1):
        if tier.backend == HOST_BACKEND:
            raise ValueError(
                f"tiers.{index}.backend: {HOST_BACKEND!r} is the host tier (tiercache's own memory, not a "
                f"backend plugin) and can only be the first tier; a lower tier names a backend plugin "
                f"such as 'disk' (and {HOST_BACKEND!r} is the default when backend is not given)"
            )


class HostTierOptions(_Frozen):
    """``options`` of the host (cpu) tier, the first in ``tiers``."""

    prefault: bool | None = Field(
        default=None,
        description="Touch every page of the host slab at start-up, committing the whole capacity "
        "at once. Otherwise pageable memory is committed as chunks arrive, and each first write "
        "into a page costs a page fault: a NIXL read into never-touched slots ran about 40x slower "
        "(docs/PERFORMANCE.md), host copies several times slower. Default: on for an engine in a "
        "P/D role, off otherwise. A pinned slab (CUDA) is always committed.",
    )
    layout: Literal["slots", "planes"] | None = Field(
        default=None,
        description="How chunks sit in the host slab. slots: each chunk's bytes in one run "
        "(lower tiers read and write slots in place). planes: one plane per KV region (a "
        "layer's K or V), so chunks in consecutive slots are one run per region: a P/D consumer "
        "READs a hand-off in a few large NIXL descriptors instead of one per chunk and region "
        "(8 instead of 504 for 2048 tokens of an 8-region model in 32-token chunks), at the cost of a gather/scatter "
        "copy when chunks move to or from a lower tier. Default: planes for a producer in "
        "pd.mode via_host, slots otherwise.",
    )


class FaultConfig(_Frozen):
    """Fault injection for tests and drills; all off by default."""

    fail_loads: bool = Field(
        default=False, description="Every load from the host tier fails (recompute path)."
    )
    corrupt_loads: bool = Field(
        default=False,
        description="Loads succeed but zero the loaded blocks (negative controls only).",
    )
    store_incomplete_chunks: bool = Field(
        default=False,
        description="Store a hybrid model's chunks even when a window group lacks blocks a later hit loads, "
        "and load without checking (a negative control only: the stale slot positions reach vLLM).",
    )
    partial_chunk_short_block: bool = Field(
        default=False,
        description="Store each partial chunk one block short of what its key names, and load it whole "
        "(a negative control only: the block a later hit loads was never stored).",
    )
    corrupt_loads_group: int | None = Field(
        default=None, ge=0,
        description="Loads succeed but zero the loaded blocks of this KV-cache group only (a hybrid "
        "model's negative control: one group's KV wrong must change the output).",
    )


class DeadlineConfig(_Frozen):
    """How long a job may wait on a lower tier before it is failed (docs/architecture.md, Faults)."""

    load_s: float = Field(
        default=5.0, gt=0, le=3600,
        description="A load's reads from lower tiers (disk, LMDB, Redis, the cache server, plugins) "
        "end within this many seconds: past it the chunks still owed are failed and vLLM recomputes "
        "them (in load_mode sync, the step waits at most this long). A late read lands in its host "
        "staging slot only, which stays reserved until the backend reports.",
    )
    store_s: float = Field(
        default=30.0, gt=0, le=3600,
        description="A demotion (host tier -> lower tier) not reported within this many seconds marks "
        "its tier stalled: further jobs of that tier fail at once (misses, no waiting) until the late "
        "ones are reported. A demotion the backend never received is failed at once.",
    )
    lookup_s: float = Field(
        default=1.0, gt=0, le=60,
        description="A shared tier (Redis, the cache server) that has not said which chunks it holds "
        "within this many seconds holds none of them for that request (a miss); the request waits "
        "for the answer at most this long. Also the longest a lookup waits for a chunk still being "
        "written into the host tier (another request staging it) before it recomputes that chunk.",
    )
    lookup_wait_s: float = Field(
        default=0.005, ge=0, le=1.0,
        description="How long the scheduler waits for the shared tiers' answer when it first asks "
        "about a request (0: never; vLLM then asks again next step, a forward pass later). A store "
        "on this host or rack answers within a few milliseconds, so the hit is scheduled at once.",
    )


class MetricsConfig(_Frozen):
    port: int | None = Field(
        default=None, ge=0, le=65535,
        description="Serve Prometheus /metrics on this port: the cache server's metrics; an engine's are "
        "on vLLM's /metrics, and also here when set (one engine per port).",
    )
    host: str = Field(default="127.0.0.1", description="Bind address of the /metrics server.")
    instance: str | None = Field(
        default=None, min_length=1,
        description="Value of the cache_instance label on an engine's metrics (default: the host name).",
    )


DEFAULT_TIERS = (TierConfig(name="cpu", backend="cpu", capacity=4 << 30),)


class TierCacheConfig(YamlBackedSettings):
    """The whole tiercache configuration (frozen once built)."""

    model_config = SettingsConfigDict(
        env_prefix="TIERCACHE_",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
    )

    chunk_tokens: int = Field(
        default=256, gt=0, description="Tokens per chunk; a multiple of the engine block size."
    )
    tiers: tuple[TierConfig, ...] = Field(
        default=DEFAULT_TIERS,
        min_length=1,
        description="Tier chain, fastest first. The first must be the host (cpu) tier.",
    )
    cpu_size: ByteSize | None = Field(
        default=None, description="Shorthand: the host tier's capacity (wins over tiers[0].capacity)."
    )
    disk_size: ByteSize | None = Field(
        default=None,
        description="Shorthand: the disk tier's capacity; adds a disk tier (at disk_path, default "
        "/var/tmp/tiercache/disk) when the tier list has none.",
    )
    disk_path: str | None = Field(
        default=None, description="Shorthand: the disk tier's root directory (with disk_size to add one)."
    )
    offload_decode_tokens: bool = Field(
        default=True, description="Also store chunks filled by generated tokens (multi-turn hits)."
    )
    partial_chunks: bool = Field(
        default=True,
        description="Also store the full blocks a request fills past its last full chunk under a "
        "partial-chunk key (again at each block it fills once its prompt is computed), so a conversation's "
        "next turn reuses its KV up to the last full block instead of the last full chunk (not for P/D "
        "roles or state-layer models).",
    )
    namespace_salt: str = Field(
        default="", description="Tenant salt mixed into every key's namespace digest."
    )
    load_failure_policy: Literal["recompute", "fail"] = Field(
        default="recompute",
        description="What vLLM does with a failed load: recompute the blocks, or fail the request.",
    )
    load_mode: Literal["sync", "async"] = Field(
        default="sync",
        description="sync: a hit is loaded right before the forward pass that needs it (lowest "
        "time-to-first-token); async: the request waits off the batch until its load is done "
        "(other requests keep running meanwhile).",
    )
    copy_threads: int | None = Field(
        default=None,
        ge=1,
        le=16,
        description="Host-side copy threads on the CPU platform (default: 2, at most the usable cores).",
    )
    cuda_copy: Literal["auto", "vllm_batch", "driver_batch", "gather", "per_run"] = Field(
        default="auto",
        description="How a job's pages move between GPU KV blocks and the host tier: vllm_batch (vLLM's "
        "swap_blocks_batch, one cuMemcpyBatchAsync per job), driver_batch (the same driver call through "
        "ctypes, no CUDA vLLM needed; CUDA >= 12.8), gather (one device gather kernel into a "
        "staging buffer, then one DMA per contiguous host range), per_run (one copy per run of "
        "consecutive blocks per layer: slow, for comparison); auto = vllm_batch where the installed "
        "vLLM has it, else gather. Ignored on the CPU platform.",
    )
    log_level: Annotated[LogLevel | None, BeforeValidator(_upper)] = Field(
        default=None,
        description="Level of tiercache's own log lines, which go to vLLM's log (default: vLLM's level, "
        "VLLM_LOGGING_LEVEL). DEBUG shows each P/D read's timings.",
    )
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    deadlines: DeadlineConfig = Field(default_factory=DeadlineConfig)
    faults: FaultConfig = Field(default_factory=FaultConfig)
    pd: PDConfig | None = Field(
        default=None,
        description="Prefill/decode hand-off settings. kv_producer/kv_consumer engines use the "
        "defaults when absent; a kv_both engine does P/D only when this section is present.",
    )

    @model_validator(mode="before")
    @classmethod
    def _apply_sizes(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return expand_sizes(data, [t.model_dump() for t in DEFAULT_TIERS])

    @model_validator(mode="after")
    def _check_tiers(self) -> TierCacheConfig:
        names = [t.name for t in self.tiers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"tiers: duplicate tier names {dupes}")
        check_host_first(self.tiers, "the host staging tier")
        try:
            HostTierOptions(**self.tiers[0].options)
        except ValidationError as exc:
            wrong = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise ValueError(f"tiers.0.options (host tier): {wrong} (allowed: prefault)") from None
        return self


    def check_engine(self, block_size: int) -> None:
        """Raise ConfigError if this config cannot run with the engine's block size."""
        if block_size <= 0 or self.chunk_tokens % block_size:
            raise ConfigError(
                f"chunk_tokens: {self.chunk_tokens} is not a multiple of the engine "
                f"block size {block_size} (try {max(1, self.chunk_tokens // block_size or 1) * block_size})"
            )

    @property
    def host_tier(self) -> TierConfig:
        return self.tiers[0]

    @property
    def host_options(self) -> HostTierOptions:
        return HostTierOptions(**self.host_tier.options)


def load_config(
    config_file: str | Path | None = None, *, preset: str | None = None, **overrides: Any
) -> TierCacheConfig:
    """Build the config from a YAML file or packaged preset, TIERCACHE_* env vars and inline overrides.

    Without ``config_file`` and ``preset``, ``TIERCACHE_PRESET`` names the preset.
    Raises ConfigError naming every offending key (and the allowed values).
    """
    if config_file is None and preset is None:
        preset = os.environ.get("TIERCACHE_PRESET") or None
    source = resolve_config_file(config_file, preset)
    return load_settings(TierCacheConfig, source, expand_dotted(overrides), title="invalid tiercache config")


def config_from_extra(extra: dict[str, Any] | None) -> TierCacheConfig:
    """Build the config from vLLM's ``kv_connector_extra_config`` dict."""
    extra = dict(extra or {})
    config_file = extra.pop("config_file", None)
    preset = extra.pop("preset", None)
    return load_config(config_file, preset=preset, **extra)
