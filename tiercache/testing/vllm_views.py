"""vLLM 0.32's per-layer KV-cache views, built as its CUDA model runners build them, for layout tests.

vLLM 0.32 allocates one raw ``int8`` buffer and hands ``register_kv_caches`` one
4-D view per attention layer, ``[blocks * ratio, H, N / ratio, C]`` in the KV
dtype (``C``: a head's K then V, ``2 * head_size`` elements), whose strides come
from the resolved :data:`LAYOUTS` entry (a permutation of the logical
``[L, B, H, N, C]`` axes; ``L`` outer: one region per layer, ``B`` outer: every
layer's page of a block side by side, "cross-layer"). ``ratio`` is the
kernel-block split: a manager block of ``N`` tokens seen by the attention kernel
as ``ratio`` blocks of ``N / ratio`` (vLLM does it only for layer-outer layouts).
The call chain both runners share (``GPUModelRunner.initialize_kv_cache`` ->
``initialize_kv_cache_tensors``; the V2 runner's ``attn_utils.init_kv_cache``):
``customize_attention_spec`` per backend, ``get_kv_cache_config_from_groups`` (the
engine core's ``KVCacheTensor`` strides), ``prepare_kernel_block_sizes``, then
``allocate_kv_cache`` -> ``create_kv_cache_views``; the connector gets those views
(``map_kv_caches_to_kernel_blocks`` only re-views packed caches, for the layers).

:func:`build_views` calls exactly that code when vLLM is importable, and
otherwise (the GPU machine has no vLLM) computes the same strides from the
small tables here; tests/unit/test_vllm_layouts.py proves the two equal for
every case. This module imports vLLM only inside the functions that need it.

Also here: how a test reads those views *semantically* (:func:`token_bytes`: a
block's token ``t`` head ``h``), decodes a page copied as raw bytes
(:func:`decode_page`, from vLLM's strides, never tiercache's walk), and which
(backend, layout, ratio) cases vLLM can hand over on CUDA (:func:`why_unreachable`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

# KVCacheLayout (vllm/v1/kv_cache_layout.py): physical order of the logical [L, B, H, N, C] axes
LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),  # HND, layer-outer (FlashInfer's default on Blackwell)
    "LBNHC": (0, 1, 3, 2, 4),  # NHD, layer-outer (vLLM's default)
    "LHBNC": (0, 2, 1, 3, 4),  # heads outside blocks (ROCm backends)
    "BLHNC": (1, 0, 2, 3, 4),  # HND, block-outermost (cross-layer)
    "BLNHC": (1, 0, 3, 2, 4),  # NHD, block-outermost (cross-layer)
    "BHLNC": (1, 2, 0, 3, 4),  # heads outside layers, block-outermost
}
# the FlashInfer-style names, as tiercache's issue and vLLM's VLLM_KV_CACHE_LAYOUT aliases use them
NAMED = {("NHD", False): "LBNHC", ("HND", False): "LBHNC", ("NHD", True): "BLNHC", ("HND", True): "BLHNC"}
# layouts without a contiguous page per layer and block (more than one KV head): tiercache refuses them
NO_LAYER_PAGE = ("LHBNC", "BHLNC")


@dataclass(frozen=True)
class BackendTraits:
    """What decides which views a CUDA attention backend gets (each checked against vLLM's code)."""

    name: str
    module: str
    cls_name: str
    kernel_block_sizes: tuple[int, ...]  # its fixed kernel block sizes; (): any multiple of 16
    layouts: tuple[str, ...]  # layouts it can take on some CUDA GPU
    kv_dtypes: tuple[torch.dtype, ...]
    split_on_gpu: str = ""  # where a backend with no fixed sizes still splits blocks on a GPU


_ALL = ("LBNHC", "LBHNC", "LHBNC", "BLNHC", "BLHNC", "BHLNC")
_HALF = (torch.float16, torch.bfloat16)
BACKENDS: dict[str, BackendTraits] = {
    b.name: b for b in (
        BackendTraits("FLASH_ATTN", "vllm.v1.attention.backends.flash_attn", "FlashAttentionBackend", (), _ALL,
                      (*_HALF, torch.uint8),
                      "FA4 head size 256 (128-token kernel pages), Hopper fp8 head size 512 (64)"),
        # declares no layouts below SM100 (any with a FlashInfer name: not LHBNC), LBHNC/BLHNC on SM100
        BackendTraits("FLASHINFER", "vllm.v1.attention.backends.flashinfer", "FlashInferBackend", (16, 32, 64),
                      ("LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC"), (*_HALF, torch.uint8)),
        BackendTraits("TRITON_ATTN", "vllm.v1.attention.backends.triton_attn", "TritonAttentionBackend", (), _ALL,
                      (*_HALF, torch.uint8)),
        BackendTraits("FLEX_ATTENTION", "vllm.v1.attention.backends.flex_attention", "FlexAttentionBackend", (),
                      ("LBNHC",), _HALF),
    )
}


@dataclass(frozen=True)
class ViewCase:
    """One KV cache as vLLM would register it: backend, layout (a :data:`LAYOUTS` name), kernel split."""

    backend: str = "FLASH_ATTN"
    layout: str = "LBNHC"
    ratio: int = 1  # kernel blocks per manager block
    num_blocks: int = 24
    block_size: int = 64
    kv_heads: int = 2
    head_size: int = 16
    dtype: torch.dtype = torch.float16
    num_layers: int = 3

    @classmethod
    def named(cls, kv_layout: str, cross_layer: bool = False, **kw: Any) -> ViewCase:
        """A case from ``NHD``/``HND`` and whether layers are packed per block (``cross_layer``)."""
        return cls(layout=NAMED[(kv_layout, cross_layer)], **kw)

    @property
    def kernel_block_size(self) -> int:
        return self.block_size // self.ratio

    @property
    def block_outermost(self) -> bool:
        return LAYOUTS[self.layout][0] == 1

    @property
    def page_bytes(self) -> int:
        """One layer's page of one manager block, in bytes."""
        return self.kv_heads * self.block_size * 2 * self.head_size * self.dtype.itemsize

    def layer_names(self) -> list[str]:
        return [f"model.layers.{i}.self_attn.attn" for i in range(self.num_layers)]

    def __str__(self) -> str:
        return f"{self.backend}-{self.layout}-r{self.ratio}-{str(self.dtype).removeprefix('torch.')}"


@dataclass
class KVViews:
    """The views of one case, the buffer under them and vLLM's addressing of it."""

    case: ViewCase
    kv_caches: dict[str, torch.Tensor]
    raw: torch.Tensor  # vLLM's backing int8 buffer
    layer_offsets: tuple[int, ...]  # bytes from raw's start to each layer's block 0
    block_stride: int  # bytes between a layer's consecutive manager blocks
    source: str  # "vllm": built by vLLM's code; "table": by this module's tables
    kv_cache_config: Any = field(default=None, repr=False)  # vLLM's KVCacheConfig ("vllm" only)

    @property
    def num_blocks(self) -> int:
        return self.case.num_blocks

    def page_span(self, layer: int, block: int) -> tuple[int, int]:
        """(byte offset in raw, length) of layer ``layer``'s page of manager block ``block``."""
        return self.layer_offsets[layer] + block * self.block_stride, self.case.page_bytes

    def fill_random(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.raw.copy_(torch.randint(-128, 128, self.raw.shape, dtype=torch.int8, generator=gen))


def build_views(case: ViewCase, device: str | torch.device = "cpu", use_vllm: bool | None = None) -> KVViews:
    """``{layer_name: view}`` as vLLM 0.32 hands it to ``register_kv_caches`` for ``case``.

    ``use_vllm``: None uses vLLM's code when vLLM imports, else the tables. ValueError
    where vLLM refuses the case (a kernel split of a layout that does not allow it).
    """
    if use_vllm is None:
        try:
            import vllm  # noqa: F401
            use_vllm = True
        except ImportError:
            use_vllm = False
    return _vllm_views(case, torch.device(device)) if use_vllm else _table_views(case, torch.device(device))


# ----------------------------------------------------------------------------- vLLM's code


def backend_class(name: str) -> tuple[Any, str]:
    """(the backend class, "") or (a stand-in with the table's static traits, why the module did not import)."""
    traits = BACKENDS[name]
    import importlib

    try:
        return getattr(importlib.import_module(traits.module), traits.cls_name), ""
    except Exception as exc:  # noqa: BLE001 - a CUDA-only extension missing on this machine
        why = f"{traits.module} does not import here ({type(exc).__name__}: {exc})"
    from vllm.v1.attention.backend import MultipleOf

    sizes = list(traits.kernel_block_sizes) or [MultipleOf(16)]
    stand_in = type(f"{traits.cls_name}StandIn", (), {
        "get_name": staticmethod(lambda: traits.name),
        "get_supported_kernel_block_sizes": staticmethod(lambda kv_cache_spec=None: list(sizes)),
        "customize_spec": classmethod(lambda cls, spec: spec),
    })
    return stand_in, why


def _vllm_config(case: ViewCase) -> tuple[Any, Any, Any, list[Any]]:
    """(vllm_config stand-in, KVCacheConfig, AttentionGroup list, layout enum) as the engine core makes them."""
    from types import SimpleNamespace

    from vllm.config import CacheConfig
    from vllm.v1.attention.backends.utils import record_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
    from vllm.v1.worker.utils import AttentionGroup, customize_attention_spec

    backend, _ = backend_class(case.backend)
    spec = customize_attention_spec(backend, FullAttentionSpec(
        block_size=case.block_size, num_kv_heads=case.kv_heads, head_size=case.head_size, dtype=case.dtype))
    cache = CacheConfig(block_size=case.block_size, num_gpu_blocks_override=case.num_blocks)
    record_kv_cache_layout(cache, case.layout)  # as a worker adopts the engine core's layout
    vllm_config = SimpleNamespace(cache_config=cache, attention_config=SimpleNamespace(hisparse_config=None))
    layers = case.layer_names()
    config = get_kv_cache_config_from_groups(vllm_config, [KVCacheGroupSpec(layers, spec)],
                                             case.num_blocks * case.num_layers * spec.page_size_bytes)
    config.kv_cache_layout = case.layout  # what EngineCore sets before handing it to the workers
    groups = [[AttentionGroup(backend, layers, spec, 0)]]
    return vllm_config, config, groups, cache.get_resolved_kv_cache_layout()


def vllm_kernel_block_size(case: ViewCase) -> int:
    """The kernel block size vLLM's ``prepare_kernel_block_sizes`` picks for ``case``'s backend and layout."""
    from vllm.v1.worker.utils import prepare_kernel_block_sizes

    _, config, groups, _ = _vllm_config(case)
    return int(prepare_kernel_block_sizes(config, groups)[0])


def _vllm_views(case: ViewCase, device: torch.device) -> KVViews:
    from vllm.v1.worker.utils import allocate_kv_cache

    _, config, _, layout = _vllm_config(case)
    # kernel_block_sizes as prepare_kernel_block_sizes returns them on a GPU whose backend splits
    kv_caches = allocate_kv_cache(config, device, layout, [case.kernel_block_size])
    (tensor,) = config.kv_cache_tensors
    views = [kv_caches[name] for name in tensor.layers]
    raw = torch.empty(0, dtype=torch.int8, device=device).set_(views[0].untyped_storage())  # allocate_kv_cache's buf
    offsets = tuple(tensor.offset + i * tensor.layer_stride for i in range(len(views)))
    return KVViews(case, {name: kv_caches[name] for name in case.layer_names()}, raw, offsets,
                   tensor.block_stride, "vllm", config)


# ----------------------------------------------------------------------------- the tables


def _strides(shape: tuple[int, ...], order: tuple[int, ...], fixed: tuple[int | None, ...]) -> list[int]:
    """vLLM's ``compute_layout_strides`` without page padding: byte strides of ``[L, B, H, N, C]``."""
    strides, current = [0] * 5, 1
    for dim in reversed(order):
        strides[dim] = fixed[dim] or current
        current = strides[dim] * shape[dim]
    return strides


def _table_views(case: ViewCase, device: torch.device) -> KVViews:
    order = LAYOUTS[case.layout]
    content = 2 * case.head_size * case.dtype.itemsize
    page = case.page_bytes
    per_block = case.num_layers * page  # every kernel page divides a page: no padding
    # the engine core's KVCacheTensor (get_kv_cache_config_from_groups)
    shape = (case.num_layers, case.num_blocks, case.kv_heads, case.block_size, content)
    layer_stride, block_stride = _strides(shape, order, (None, per_block if case.block_outermost else None,
                                                         None, None, None))[:2]
    # the worker's views (create_kv_cache_views)
    ratio = case.ratio
    if ratio > 1 and block_stride != page:
        raise ValueError(f"The resolved KV cache layout ({case.layout}) does not store blocks as dense, "
                         f"unpadded pages (block stride {block_stride} != page {page})")
    logical = (case.num_layers, case.num_blocks * ratio, case.kv_heads, case.kernel_block_size, content)
    strides = _strides(logical, order, (layer_stride, block_stride // ratio, None, None, None))
    raw = torch.zeros(per_block * case.num_blocks, dtype=torch.int8, device=device)
    view5 = torch.as_strided(raw, logical, strides, raw.storage_offset())
    names = case.layer_names()
    kv_caches = {name: view5[i].view(case.dtype) for i, name in enumerate(names)}
    offsets = tuple(i * layer_stride for i in range(case.num_layers))
    return KVViews(case, kv_caches, raw, offsets, block_stride, "table")


# ----------------------------------------------------------------------------- reading the views


def token_bytes(views: KVViews, layer: str) -> torch.Tensor:
    """A copy of layer ``layer`` as ``[num_blocks, H, block_size, C bytes]``: [b, h, t] is token
    ``t`` of manager block ``b``, head ``h`` (kernel block ``b * ratio + t // (N / ratio)``, as
    vLLM's ``map_to_kernel_block_table`` numbers them)."""
    v = views.kv_caches[layer].view(torch.uint8)
    nb, ratio = views.num_blocks, views.case.ratio
    grouped = v.unflatten(0, (nb, ratio)).permute(0, 2, 1, 3, 4)
    return grouped.reshape(nb, v.shape[1], ratio * v.shape[2], v.shape[3]).clone()  # reshape may be a view


def decode_page(page: torch.Tensor, views: KVViews, layer: str) -> torch.Tensor:
    """A page copied as raw bytes (1-D uint8, one layer, one manager block) read back as
    ``[H, block_size, C bytes]``, with the layer view's own strides inside a block."""
    v = views.kv_caches[layer].view(torch.uint8)
    ratio = views.case.ratio
    s = v.stride()
    pages = torch.as_strided(page, (ratio, *v.shape[1:]), (s[0] if ratio > 1 else 0, *s[1:]), page.storage_offset())
    return pages.permute(1, 0, 2, 3).reshape(v.shape[1], ratio * v.shape[2], v.shape[3])


def raw_page(views: KVViews, layer: int, block: int) -> torch.Tensor:
    """Layer ``layer``'s page of manager block ``block``: its bytes in the backing buffer, by vLLM's addressing."""
    start, length = views.page_span(layer, block)
    return views.raw.view(torch.uint8)[start:start + length]


def why_unreachable(case: ViewCase) -> str:
    """Why vLLM 0.32 never hands ``case`` to a connector on CUDA ("" when it can)."""
    traits = BACKENDS[case.backend]
    if case.layout not in traits.layouts:
        return f"{case.backend} takes {', '.join(traits.layouts)} only (supported_kv_cache_layouts)"
    if case.dtype not in traits.kv_dtypes:
        return f"{case.backend} has no {case.dtype} KV cache"
    if case.ratio > 1 and case.block_outermost:
        return ("vLLM never splits block-outermost (cross-layer) blocks: prepare_kernel_block_sizes keeps "
                "the manager size and create_kv_cache_views refuses a split")
    if case.ratio > 1 and case.layout == "LHBNC":
        return "create_kv_cache_views refuses to split LHBNC blocks (not dense pages)"
    if case.ratio > 1 and not traits.kernel_block_sizes and not traits.split_on_gpu:
        return f"{case.backend} takes any multiple of 16 tokens: vLLM never splits its blocks"
    return ""


def all_cases(dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.uint8),
              ratios: tuple[int, ...] = (1, 2, 4), **kw: Any) -> list[ViewCase]:
    """Every backend x layout x ratio x dtype (manager block ``64 * ratio`` tokens: FlashInfer's
    largest kernel block times the ratio, so vLLM's own selection yields that ratio)."""
    return [ViewCase(backend=b, layout=lay, ratio=r, block_size=64 * r, dtype=d, **kw)
            for b in BACKENDS for lay in LAYOUTS for r in ratios for d in dtypes]


def with_layout(case: ViewCase, layout: str, ratio: int | None = None) -> ViewCase:
    """``case`` in another layout (and kernel split), the same manager blocks."""
    return replace(case, layout=layout, ratio=case.ratio if ratio is None else ratio)
