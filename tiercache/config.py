"""tiercache configuration: typed, frozen, validated before anything is allocated.

Sources, highest precedence first:

1. inline overrides (the keys of vLLM's ``kv_connector_extra_config`` other
   than ``config_file``, or keyword arguments to :func:`load_config`);
2. ``TIERCACHE_*`` environment variables (nested keys with ``__``, e.g.
   ``TIERCACHE_CHUNK_TOKENS=512``, ``TIERCACHE_METRICS__PORT=9400``; lists such
   as ``TIERCACHE_TIERS`` are JSON);
3. the YAML file named by ``config_file``;
4. the defaults below.

Every model forbids unknown keys, so a typo is an error that names the key.
Sizes accept ints or strings like ``"16GiB"``. Engine-dependent checks (the
chunk size must be a multiple of the engine block size) are made by
:meth:`TierCacheConfig.check_engine`, which the connector calls at start-up.
"""

from __future__ import annotations

import contextvars
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from tiercache.sizes import parse_size

ByteSize = Annotated[int, BeforeValidator(parse_size), Field(ge=0)]
PolicyName = Literal["lru", "arc"]

_yaml_path: contextvars.ContextVar[Path | None] = contextvars.ContextVar(
    "tiercache_yaml_path", default=None
)


class ConfigError(ValueError):
    """A configuration problem, raised at start-up with the offending key named."""


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


class FaultConfig(_Frozen):
    """Fault injection for tests and drills; all off by default."""

    fail_loads: bool = Field(
        default=False, description="Every load from the host tier fails (recompute path)."
    )
    corrupt_loads: bool = Field(
        default=False,
        description="Loads succeed but zero the loaded blocks (negative controls only).",
    )


class MetricsConfig(_Frozen):
    port: int | None = Field(
        default=None, ge=0, le=65535, description="Serve Prometheus /metrics on this port."
    )
    host: str = Field(default="127.0.0.1", description="Bind address of the /metrics server.")


class PDConfig(_Frozen):
    """Prefill/decode hand-off (kv_role kv_producer / kv_consumer; see docs/pd.md)."""

    mode: Literal["via_host"] = Field(
        default="via_host",
        description="via_host: the producer's chunks go through its host tier (registered with "
        "NIXL) and its device blocks are freed at once. ('direct', reading the producer's "
        "device blocks, is not implemented yet.)",
    )
    host: str = Field(
        default="127.0.0.1",
        description="Producer: address its side channel binds and advertises to consumers.",
    )
    port: int = Field(
        default=5700, ge=1, le=65535 - 64,
        description="Producer: side-channel TCP port of TP rank 0 (rank r listens on port + r).",
    )
    handoff_timeout_s: float = Field(
        default=120.0, gt=0,
        description="Producer: a hand-off nobody read after this long is released (its memory returns).",
    )
    read_timeout_s: float = Field(
        default=10.0, gt=0,
        description="Consumer: longest wait for a producer (handshake, readiness, the NIXL read); "
        "past it the load fails and the engine recomputes.",
    )
    max_peer_chunks: int = Field(
        default=65536, ge=1,
        description="Consumer: how many announced producer chunks it remembers at once.",
    )


class TierCacheConfig(BaseSettings):
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
        default=(TierConfig(name="cpu", backend="cpu", capacity=4 << 30),),
        min_length=1,
        description="Tier chain, fastest first. The first must be the host (cpu) tier.",
    )
    offload_decode_tokens: bool = Field(
        default=True, description="Also store chunks filled by generated tokens (multi-turn hits)."
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
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    faults: FaultConfig = Field(default_factory=FaultConfig)
    pd: PDConfig | None = Field(
        default=None,
        description="Prefill/decode hand-off settings. kv_producer/kv_consumer engines use the "
        "defaults when absent; a kv_both engine does P/D only when this section is present.",
    )

    @model_validator(mode="after")
    def _check_tiers(self) -> "TierCacheConfig":
        names = [t.name for t in self.tiers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"tiers: duplicate tier names {dupes}")
        if self.tiers[0].backend != "cpu":
            raise ValueError(
                f"tiers.0.backend: the first tier is the host staging tier and must be "
                f"'cpu', got {self.tiers[0].backend!r}"
            )
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _YamlSource(settings_cls))

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


class _YamlSource(PydanticBaseSettingsSource):
    """Reads the YAML file set for the current :func:`load_config` call."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        raise NotImplementedError  # __call__ is used instead

    def __call__(self) -> dict[str, Any]:
        path = _yaml_path.get()
        if path is None:
            return {}
        return _read_yaml(path)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"config_file: cannot read {path}: {exc.strerror or exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config_file: {path} is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config_file: {path} must hold a mapping, not {type(data).__name__}")
    return data


def load_config(config_file: str | Path | None = None, **overrides: Any) -> TierCacheConfig:
    """Build the config from a YAML file, TIERCACHE_* env vars and inline overrides.

    Raises ConfigError naming every offending key (and the allowed values).
    """
    path = Path(config_file).expanduser() if config_file else None
    if path is not None and not path.is_file():
        raise ConfigError(f"config_file: no such file: {path}")
    token = _yaml_path.set(path)
    try:
        return TierCacheConfig(**overrides)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, path)) from None
    finally:
        _yaml_path.reset(token)


def _describe(exc: ValidationError, path: Path | None) -> str:
    where = f" (config_file {path})" if path else ""
    lines = [f"invalid tiercache config{where}:"]
    for err in exc.errors():
        msg = err["msg"]
        if not err["loc"]:  # a cross-field check: its message names the key itself
            lines.append("  " + msg.removeprefix("Value error, "))
            continue
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"  {key}: {msg} (got {err.get('input')!r})")
    return "\n".join(lines)


def config_from_extra(extra: dict[str, Any] | None) -> TierCacheConfig:
    """Build the config from vLLM's ``kv_connector_extra_config`` dict."""
    extra = dict(extra or {})
    config_file = extra.pop("config_file", None)
    return load_config(config_file, **extra)
