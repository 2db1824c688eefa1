"""A model's KV-cache groups as tiercache serves them, and the copy segments of one chunk across them.

vLLM's hybrid KV-cache manager (HMA) splits a model's layers into KV-cache
groups, one kind of attention each, with the same page size, so that every KV
tensor is shared by one layer of each group: a block id names a block of the
shared pool, and the group that owns it says whose layer's KV it holds. Each
request has one block table per group; a sliding-window group's table holds
vLLM's null block wherever its blocks left the window (vLLM freed them).

tiercache serves full-attention and sliding-window groups (:func:`engine_groups`;
anything else raises :class:`UnsupportedKVGroups`):

* **One chunk covers every group.** A chunk's slot holds ``blocks_per_chunk``
  blocks per group, group ``g``'s at chunk positions ``g * bpc ..`` (its bytes
  are the shared tensors' pages of that group's blocks); the key stays the
  tokens' key (the namespace names the group structure), so a hit is as long
  for every group, and one lookup answers for all of them.
* **Stores skip null blocks** (:func:`chunk_segments`): a sliding-window block
  vLLM already freed is not stored; its slot positions hold nothing useful.
  A hit ending at token ``L`` needs a window group's blocks covering
  ``[L - window, L)`` only, and those were all inside the window, so
  allocated, when their chunks were stored (a store runs in the step that
  completes its chunk; vLLM frees a block only once it is a whole window
  behind the tokens computed before that step).
* **Loads write only the blocks vLLM allocated**: for a window group, vLLM's
  table for the loaded range holds null blocks outside the window; they are
  skipped, so a window group moves at most a window's blocks per hit, not the
  prefix's.

Failures: vLLM 0.32 refuses failed *blocks* from a connector once a model
has several KV-cache groups (it raises, and the engine dies), and takes failed
*requests* (``failed_recving``) for async loads only. So a hybrid model's loads
are async whatever ``load_mode`` says, and every failed load is reported per
request (connector/worker_faults.py ``_fail_load``): vLLM recomputes it from
token 0.

P/D: mode ``via_host`` hands a hybrid model's chunks over like any other (the
consumer's reader reads one entry per run of blocks, tiercache/pd/peer_tier.py);
mode ``direct`` (the producer's blocks named per key) is refused at start-up.

Pure functions of vLLM's configs and block tables; scheduler thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tiercache.config.schema import ConfigError
from tiercache.jobs import CopySegment

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

FULL = "full"
SLIDING_WINDOW = "sliding_window"


class UnsupportedKVGroups(ConfigError):
    """The model has KV-cache groups tiercache cannot serve (state layers, chunked local attention...)."""


@dataclass(frozen=True)
class KVGroup:
    kind: str  # FULL or SLIDING_WINDOW
    window: int = 0  # tokens, for SLIDING_WINDOW

    def describe(self) -> str:
        return f"{self.kind}:{self.window}" if self.kind == SLIDING_WINDOW else self.kind


def describe_groups(groups: Sequence[KVGroup]) -> str:
    """The namespace's field: "" for one full-attention group (keys as before hybrid models)."""
    if len(groups) == 1 and groups[0].kind == FULL:
        return ""
    return ",".join(g.describe() for g in groups)


def engine_groups(kv_cache_config: KVCacheConfig) -> tuple[tuple[KVGroup, ...], list[Any]]:
    """The groups tiercache will serve, and the layer specs of one group (all groups' pages are alike).

    Raises :class:`UnsupportedKVGroups` naming the group types it cannot serve.
    """
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        FullAttentionSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    groups = [g for g in kv_cache_config.kv_cache_groups if getattr(g, "enable_kv_transfer", True)]
    if not groups:
        raise UnsupportedKVGroups("tiercache: the model has no KV-cache group to transfer")
    kinds: list[KVGroup] = []
    specs_of: list[list[Any]] = []
    for group in groups:
        spec = group.kv_cache_spec
        layer_specs = (list(spec.kv_cache_specs.values()) if isinstance(spec, UniformTypeKVCacheSpecs)
                       else [spec] * len(group.layer_names))
        if all(isinstance(s, SlidingWindowSpec) for s in layer_specs):
            kinds.append(KVGroup(SLIDING_WINDOW, int(layer_specs[0].sliding_window)))
        elif all(isinstance(s, FullAttentionSpec) for s in layer_specs) or (
                len(groups) == 1 and all(isinstance(s, AttentionSpec) for s in layer_specs)):
            kinds.append(KVGroup(FULL))  # one group of any attention: every block kept, as before
        else:
            names = sorted({type(s).__name__ for s in layer_specs})
            raise UnsupportedKVGroups(
                f"tiercache serves full-attention and sliding-window KV-cache groups; this model's "
                f"group {len(kinds)} is {'/'.join(names)} (groups: "
                f"{[type(g.kv_cache_spec).__name__ for g in groups]})")
        specs_of.append(layer_specs)
    pages = {sum(s.page_size_bytes for s in specs) for specs in specs_of}
    if len(pages) != 1:
        raise UnsupportedKVGroups(
            f"tiercache needs every KV-cache group to hold the same bytes per block (vLLM's shared "
            f"tensors); this model's groups hold {sorted(pages)}")
    return tuple(kinds), specs_of[0]


def chunk_segments(slot: int, group_block_ids: Sequence[Sequence[int]], chunk: int, lo: int, hi: int,
                   bpc: int, null_block: int) -> list[CopySegment]:
    """The copy segments of request blocks ``lo .. hi - 1`` (all inside chunk ``chunk``), every group.

    Group ``g``'s block at request position ``b`` goes to chunk position
    ``g * bpc + b - chunk * bpc``; null blocks (and positions past a table's
    end) are skipped, so each run of allocated blocks is one segment.
    """
    segments: list[CopySegment] = []
    base = chunk * bpc
    for g, ids in enumerate(group_block_ids):
        run: list[int] = []
        first = 0
        for b in range(lo, min(hi, len(ids))):
            block = ids[b]
            if block == null_block:
                if run:
                    segments.append(CopySegment(slot, first, tuple(run)))
                    run = []
                continue
            if not run:
                first = g * bpc + b - base
            run.append(block)
        if run:
            segments.append(CopySegment(slot, first, tuple(run)))
    return segments
