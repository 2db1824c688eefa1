"""What the KV bytes of a token prefix depend on, beside the tokens: the checkpoint and the attention layout.

Two digests, each over a small dict of named fields (the fields travel in the
start-up check, so a mismatch names what differs):

:func:`model_identity` — the checkpoint and everything that changes the forward
pass (computed the same way by the scheduler and by every worker, from the
``VllmConfig`` alone, once at start-up; no weight is read whole):

* ``source``/``revision``: a local directory or file is identified by its
  content, not its path (two copies of one checkpoint get the same identity; a
  checkpoint replaced at the same path does not). A hub name is resolved to its local
  snapshot in the Hugging Face cache (``local_files_only``: never the network)
  and the snapshot's commit hash is the revision; with no local snapshot
  (ModelScope, ``s3://``, a cache on another machine) the identity falls back
  to ``name@revision`` — then a re-upload under the same revision would not be
  seen (give ``--revision`` a commit hash).
* ``config``: a digest of the bytes of the files that define the model:
  ``config.json``, ``params.json``, ``*quant*.json``, ``*.index.json`` (tensor
  -> file map) and ``*.py`` (remote code); ``hf_config_path``'s file too.
* ``weight_files``: each weight file's name and size (``*.safetensors``,
  ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``, top level only, as vLLM's loader
  globs them).
* ``weight_content``: what tells two checkpoints of equal names and sizes apart
  (random or fine-tuned weights of the same shapes). For a safetensors file:
  its whole header (every tensor's name, dtype, shape and offsets; small) and,
  for *every tensor*, the first and the last 256 bytes of its data: a
  fine-tune changes nearly every element of a tensor it trains, so a change
  confined to one tensor is still seen. Other formats (``.bin``, ``.gguf``):
  33 samples of 4 KiB, evenly spaced, the last one at the end. Limits: a change
  that leaves the sampled bytes equal goes unnoticed (a safetensors tensor edited
  only in its middle, a ``.bin`` edited between samples); mtimes are not used
  (a copy changes them, a rewrite of equal bytes would too).
* ``dtype``, ``quantization``, ``quantization_config``, ``hf_overrides`` (a
  callable override is named by its qualified name, not its code),
  ``load_format`` (and ``seed`` with the dummy loader), ``model_impl``,
  ``runner``/``convert``, ``trust_remote_code``/``code_revision``,
  ``disable_sliding_window``, ``model_weights``, ``model_class_overrides``.

Left out on purpose: the tokenizer (keys are over token ids; another tokenizer
gives other ids, hence other keys), ``max_model_len``, sampling settings.

:func:`attention_identity` — the KV layout as the workers registered it (worker
side; the scheduler learns it at start-up, ``namespace_check``): the attention
backends the layers use, vLLM's resolved KV-cache layout, the KV cache dtype
(``fp8_e4m3`` and ``fp8_e5m2`` are both stored as ``uint8``), the kernel block
size, and each distinct registered tensor's dtype, shape and stride order with
the block count written ``B`` and the local KV-head count ``H`` (so engines of
different TP sizes get the same identity; the heads a rank holds are the
store shard's business, never this digest's), plus vLLM's ``major.minor``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import re
import struct
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from tiercache.layout import block_dim_of, distinct_layers

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)

IDENTITY_DIGEST_BYTES = 16
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
TENSOR_SAMPLE_BYTES = 256  # per safetensors tensor: its first and last bytes
FILE_SAMPLES = 33  # other weight formats: evenly spaced samples ...
FILE_SAMPLE_BYTES = 4096  # ... of this size
MAX_SAFETENSORS_HEADER = 100 << 20  # larger: not a safetensors header we trust; sampled as a plain file
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


# --------------------------------------------------------------------------- common


def identity_digest(fields: Mapping[str, Any]) -> str:
    """A stable hex digest of ``fields`` (canonical JSON, BLAKE2b-16)."""
    canonical = json.dumps(_canonical(dict(fields)), sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(canonical.encode(), digest_size=IDENTITY_DIGEST_BYTES).hexdigest()


def _canonical(value: Any) -> Any:
    """``value`` as plain JSON data that is equal in every process (no addresses, no reprs of objects)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_canonical(v) for v in value]
        return sorted(items, key=json.dumps) if isinstance(value, (set, frozenset)) else items
    if hasattr(value, "model_dump"):  # pydantic
        return _canonical(value.model_dump())
    if hasattr(value, "__dataclass_fields__"):
        import dataclasses

        return _canonical(dataclasses.asdict(value))
    if hasattr(value, "value") and hasattr(value, "name") and type(value).__module__ != "builtins":  # enums
        return f"{type(value).__name__}.{value.name}"
    if callable(value):
        return f"callable:{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__name__)}"
    return _ADDRESS.sub("", f"{type(value).__name__}:{value}")


# --------------------------------------------------------------------------- model


def model_identity(vllm_config: "VllmConfig") -> str:
    """The checkpoint's identity as a hex digest (see the module docstring)."""
    return identity_digest(model_identity_fields(vllm_config))


def model_identity_fields(vllm_config: "VllmConfig") -> dict[str, str]:
    """The named fields :func:`model_identity` digests (short strings: values or sub-digests)."""
    mc = vllm_config.model_config
    lc = vllm_config.load_config
    load_format = str(getattr(lc, "load_format", "auto"))
    fields: dict[str, str] = {}
    fields.update(checkpoint_fields(str(mc.model), getattr(mc, "revision", None), getattr(lc, "download_dir", None)))
    hf_config_path = getattr(mc, "hf_config_path", None)
    if hf_config_path:
        fields["hf_config_path"] = _files_digest(_config_files(pathlib.Path(hf_config_path))) \
            if os.path.exists(hf_config_path) else f"name:{hf_config_path}"
    settings = {
        "dtype": str(mc.dtype),
        "quantization": mc.quantization,
        "quantization_config": getattr(mc, "quantization_config", None),
        "hf_overrides": getattr(mc, "hf_overrides", None) or {},
        "load_format": load_format,
        "seed": mc.seed if load_format == "dummy" else None,  # dummy weights are drawn from it
        "model_impl": getattr(mc, "model_impl", None),
        "runner": getattr(mc, "runner_type", None),
        "convert": getattr(mc, "convert_type", None),
        "trust_remote_code": getattr(mc, "trust_remote_code", None),
        "code_revision": getattr(mc, "code_revision", None),
        "disable_sliding_window": getattr(mc, "disable_sliding_window", None),
        "model_weights": getattr(mc, "model_weights", None) or None,
        "model_class_overrides": getattr(mc, "model_class_overrides", None) or None,
    }
    for name, value in settings.items():
        fields[name] = _short(value)
    return fields


def checkpoint_fields(model: str, revision: str | None = None, download_dir: str | None = None) -> dict[str, str]:
    """``source``, ``revision``, ``config``, ``weight_files``, ``weight_content`` of a checkpoint."""
    path = pathlib.Path(model).expanduser()
    source = "local"
    if not path.exists():
        snapshot = _hub_snapshot(model, revision, download_dir)
        if snapshot is None:
            # Nothing local to look at: the name and the revision are all we have.
            return {"source": "name", "name": model, "revision": revision or ""}
        path, revision, source = snapshot, snapshot.name, "hub"
    weights = _weight_files(path)
    return {
        "source": source,
        "revision": revision or "",
        "config": _files_digest(_config_files(path)),
        "weight_files": _names_and_sizes(weights),
        "weight_content": _content_digest(weights),
    }


def _short(value: Any) -> str:
    """A setting as a short string: itself when short, else a digest of it."""
    text = json.dumps(_canonical(value), sort_keys=True, separators=(",", ":"))
    return text if len(text) <= 64 else "b2:" + hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _hub_snapshot(model: str, revision: str | None, download_dir: str | None) -> pathlib.Path | None:
    """The local Hugging Face snapshot directory of ``model`` at ``revision`` (no network), or None."""
    if os.environ.get("VLLM_USE_MODELSCOPE", "").lower() in ("1", "true") or "://" in model:
        return None
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(repo_id=model, revision=revision, cache_dir=download_dir, local_files_only=True)
    except Exception as exc:  # not cached, not a repo id, hub library missing
        logger.debug("tiercache: no local snapshot of %s@%s: %s", model, revision, exc)
        return None
    return pathlib.Path(folder)


def _config_files(path: pathlib.Path) -> list[pathlib.Path]:
    """The files that define the model (not its weights, not its tokenizer): see the module docstring."""
    if path.is_file():
        return [path] if path.suffix in (".json", ".py") else []
    out = []
    for f in sorted(path.iterdir()):
        name = f.name
        wanted = (
            name in ("config.json", "params.json")
            or name.endswith(".index.json")
            or (name.endswith(".json") and "quant" in name)
            or name.endswith(".py")
        )
        if wanted and f.is_file():
            out.append(f)
    return out


def _weight_files(path: pathlib.Path) -> list[pathlib.Path]:
    if path.is_file():
        return [path]  # a single-file checkpoint (GGUF)
    return [f for f in sorted(path.iterdir()) if f.suffix in WEIGHT_SUFFIXES and f.is_file()]


def _files_digest(files: Iterable[pathlib.Path]) -> str:
    h = hashlib.blake2b(digest_size=8)
    for f in files:
        data = f.read_bytes()
        h.update(f.name.encode() + b"\0" + len(data).to_bytes(8, "big") + data)
    return h.hexdigest()


def _names_and_sizes(files: list[pathlib.Path]) -> str:
    listing = [[f.name, f.stat().st_size] for f in files]
    total = sum(size for _, size in listing)
    h = hashlib.blake2b(json.dumps(listing).encode(), digest_size=8).hexdigest()
    return f"{len(listing)} files, {total} B, {h}"


def _content_digest(files: list[pathlib.Path]) -> str:
    h = hashlib.blake2b(digest_size=8)
    for f in files:
        h.update(f.name.encode() + b"\0")
        try:
            with open(f, "rb") as fh:
                if f.suffix != ".safetensors" or not _sample_safetensors(fh.fileno(), h):
                    _sample_file(fh.fileno(), os.fstat(fh.fileno()).st_size, h)
        except OSError as exc:  # unreadable here: named as such (a process that can read it differs)
            logger.warning("tiercache: cannot sample weight file %s: %s", f, exc)
            h.update(f"unreadable:{exc.errno}".encode())
    return h.hexdigest()


def _sample_safetensors(fd: int, h: Any) -> bool:
    """Hash the header and each tensor's first and last bytes; False when this is no safetensors file."""
    size = os.fstat(fd).st_size
    raw = os.pread(fd, 8, 0)
    if len(raw) < 8:
        return False
    (header_len,) = struct.unpack("<Q", raw)
    if header_len > min(MAX_SAFETENSORS_HEADER, size - 8):
        return False
    header = os.pread(fd, header_len, 8)
    try:
        meta = json.loads(header)
    except ValueError:
        return False
    h.update(b"header" + header)
    base = 8 + header_len
    spans = sorted(
        tuple(v["data_offsets"]) for k, v in meta.items() if k != "__metadata__" and isinstance(v, dict)
    )
    n = TENSOR_SAMPLE_BYTES
    for begin, end in spans:
        length = end - begin
        h.update(os.pread(fd, min(n, length), base + begin))
        if length > n:
            h.update(os.pread(fd, min(n, length - n), base + max(begin + n, end - n)))
    return True


def _sample_file(fd: int, size: int, h: Any) -> None:
    h.update(size.to_bytes(8, "big"))
    if size <= FILE_SAMPLES * FILE_SAMPLE_BYTES:
        h.update(os.pread(fd, size, 0))
        return
    last = size - FILE_SAMPLE_BYTES
    for i in range(FILE_SAMPLES):
        h.update(os.pread(fd, FILE_SAMPLE_BYTES, last * i // (FILE_SAMPLES - 1)))


# --------------------------------------------------------------------------- attention


def attention_identity(
    vllm_config: "VllmConfig",
    kv_cache_config: "KVCacheConfig",
    kv_caches: Mapping[str, "torch.Tensor"] | None = None,
) -> str:
    """The KV layout's identity as a hex digest (see the module docstring and :func:`attention_identity_fields`)."""
    return identity_digest(attention_identity_fields(vllm_config, kv_cache_config, kv_caches))


def scheduler_attention_view(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> dict[str, str]:
    """The attention fields the scheduler knows without the workers (a subset of the workers' fields)."""
    cache = vllm_config.cache_config
    layout = getattr(cache, "kv_cache_layout", None) or getattr(kv_cache_config, "kv_cache_layout", None)
    return {
        "kv_layout": str(layout or "default"),
        "cache_dtype": str(getattr(cache, "cache_dtype", "auto")),
        "vllm": _vllm_minor(),
    }


def attention_identity_fields(
    vllm_config: "VllmConfig",
    kv_cache_config: "KVCacheConfig",
    kv_caches: Mapping[str, "torch.Tensor"] | None = None,
) -> dict[str, str]:
    """The named fields :func:`attention_identity` digests.

    Without ``kv_caches`` (the scheduler) only :func:`scheduler_attention_view`'s
    fields; with them (a worker, in ``register_kv_caches``) also ``backends``,
    ``kernel_block_size`` and ``pages`` (the registered tensors' layout).
    """
    fields = scheduler_attention_view(vllm_config, kv_cache_config)
    if kv_caches is None:
        return fields
    fields["backends"] = _backend_names(vllm_config)
    num_blocks = int(kv_cache_config.num_blocks)
    heads = _local_kv_heads(kv_cache_config)
    tensors = [t for _, t in distinct_layers(kv_caches)]
    pages = sorted({_page_descriptor(t, num_blocks, heads) for t in tensors})
    fields["pages"] = ";".join(pages)
    block_size = int(vllm_config.cache_config.block_size)
    ratios = {_kernel_ratio(t, num_blocks) for t in tensors}
    fields["kernel_block_size"] = ",".join(
        str(block_size // r) if r else "?" for r in sorted(ratios, key=lambda r: r or 0)
    )
    return fields


def _vllm_minor() -> str:
    try:
        import vllm

        return ".".join(str(vllm.__version__).split(".")[:2])
    except Exception:
        return "?"


def _backend_names(vllm_config: "VllmConfig") -> str:
    """The attention backends of the model's attention layers, as this worker built them."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        return ",".join(sorted({b.get_name() for b in get_current_attn_backends(vllm_config)}))
    except Exception as exc:  # vLLM moved it: say so in the identity rather than guess
        logger.warning("tiercache: cannot name the attention backend: %s", exc)
        return "unknown"


def _local_kv_heads(kv_cache_config: "KVCacheConfig") -> set[int]:
    """The KV-head counts of this worker's attention specs (its shard of the heads)."""
    heads: set[int] = set()
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        specs = getattr(spec, "kv_cache_specs", None)
        for s in (specs.values() if isinstance(specs, Mapping) else [spec]):
            n = getattr(s, "num_kv_heads", None)
            if isinstance(n, int):
                heads.add(n)
    return heads


def _kernel_ratio(t: "torch.Tensor", num_blocks: int) -> int | None:
    dim = block_dim_of(tuple(t.shape), num_blocks)
    return None if dim is None else t.shape[dim] // num_blocks


def _page_descriptor(t: "torch.Tensor", num_blocks: int, local_heads: set[int]) -> str:
    """``dtype[B,H,32,128]/order=0123``: the tensor's per-block layout, TP-invariant.

    The block dimension is written ``B``; the first dimension after it whose size
    is the local KV-head count is written ``H`` (vLLM 0.32 registers ``[B, H, N, C]``
    views); the stride order lists the dimensions outermost first.
    """
    shape = tuple(int(s) for s in t.shape)
    block_dim = block_dim_of(shape, num_blocks)
    dims: list[str] = [str(s) for s in shape]
    if block_dim is not None:
        dims[block_dim] = "B"
        for d in range(block_dim + 1, len(shape)):
            if shape[d] in local_heads:
                dims[d] = "H"
                break
    strides = tuple(int(s) for s in t.stride())
    order = sorted(range(len(shape)), key=lambda d: (-strides[d], d))
    return f"{str(t.dtype).removeprefix('torch.')}[{','.join(dims)}]/order={''.join(map(str, order))}"
