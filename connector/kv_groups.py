"""A model's KV-cache groups as tiercache serves them, and the copy segments of one chunk across them.

vLLM's hybrid KV-cache manager (HMA) splits a model's layers into KV-cache
groups, one kind of attention each, with the same page size, so that every KV
tensor is shared by one layer of each group: a block id names a block of the
shared pool, and the group that owns it says whose layer's KV it holds. Each
request has one block table per group; a sliding-window group's table holds
vLLM's null block wherever its blocks left the window (vLLM freed them).

tiercache serves full-attention, sliding-window and state groups (vLLM's
MambaSpec in "align" mode: Mamba, linear attention, short convolutions) (:func:`engine_groups`;
anything else raises :class:`UnsupportedKVGroups`, and so do state groups with
several pipeline stages: :func:`refuse_unserved_state_layers`):

* **One chunk covers every group.** A chunk's slot holds ``blocks_per_chunk``
  blocks per group, group ``g``'s at chunk positions ``g * bpc ..`` (its bytes
  are the shared tensors' pages of that group's blocks); the key stays the
  tokens' key (the namespace names the group structure), so a hit is as long
  for every group, and one lookup answers for all of them.
* **A chunk is stored only with every block a later hit may load**
  (:func:`kept_from`, :func:`chunk_complete`): a hit ending at token ``L``
  needs a window group's blocks covering ``[L - window + 1, L)`` only. Hits
  end at most one token before the end of their last chunk, so a window
  group's blocks a whole window before a chunk's end are never loaded
  again: a store leaves them out (a window-aware store: with a
  window shorter than a chunk, part of the window group's blocks is not
  copied), and needs every block from there to the chunk's end allocated in
  every group. A request whose table lacks one (vLLM's null block: a prefix
  of the request hit vLLM's own cache, which gives a window group only the
  blocks inside the window; or a P/D consumer's loaded blocks) does not store
  that chunk: its slot would hold stale bytes where a later hit loads.
  Control: ``faults.store_incomplete_chunks``.
* **A state group's block is the state at its end**, kept by vLLM only where a
  step ended there. A chunk key stores none of it; the chunk's *state key*
  stores the chunk with the state at its end (its last position), and a hit
  ends at a chunk loaded from its state key (connector/state_chunks.py).
* **Loads write only the blocks vLLM allocated**: for a window group, vLLM's
  table for the loaded range holds null blocks outside the window; they are
  skipped, so a window group moves at most a window's blocks per hit, not the
  prefix's. An allocated block the store left out (vLLM asking for more than
  its window, which it does not) fails the load: recomputed, never stale.

Failures: vLLM 0.32 refuses failed *blocks* from a connector once a model
has several KV-cache groups (it raises, and the engine dies), and takes failed
*requests* (``failed_recving``) for async loads only. So a hybrid model's loads
are async whatever ``load_mode`` says, and every failed load is reported per
request (connector/worker_faults.py ``_fail_load``): vLLM recomputes it from
token 0.

P/D: mode ``via_host`` hands a hybrid model's chunks over like any other (the
consumer's reader reads one entry per run of blocks, tiercache/pd/peer_tier.py);
in mode ``direct`` each key names every group's device blocks, group-major, -1
where the producer holds none (connector/pd/direct_blocks.py).

Pure functions of vLLM's configs and block tables; scheduler thread only.
"""

from __future__ import annotations

import math

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tiercache.config.schema import ConfigError
from tiercache.jobs import CopySegment

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

FULL = "full"
SLIDING_WINDOW = "sliding_window"
STATE = "state"  # recurrent state (vLLM's MambaSpec in "align" mode): Mamba, linear attention, short convs


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
    """The groups tiercache will serve, and the layer specs of one attention group (all groups' pages
    are alike).

    Raises :class:`UnsupportedKVGroups` naming the group types it cannot serve.
    """
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    groups = [g for g in kv_cache_config.kv_cache_groups if getattr(g, "enable_kv_transfer", True)]
    if len(groups) < len(kv_cache_config.kv_cache_groups) and any(
            type(g.kv_cache_spec).__name__ == "MambaSpec" for g in groups):
        # vLLM offers a state by its group id (connector/state_chunks.py): ids must be tiercache's indices
        raise UnsupportedKVGroups("tiercache serves state layers only when every KV-cache group is transferred")
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
        elif all(isinstance(s, MambaSpec) for s in layer_specs) and len(groups) > 1:
            modes = {str(getattr(s, "mamba_cache_mode", "")) for s in layer_specs}
            if modes != {"align"}:
                raise UnsupportedKVGroups(
                    f"tiercache serves state layers (MambaSpec) in vLLM's \"align\" cache mode only (a state "
                    f"at every block end a step reached); this model's group {len(kinds)} is in mode "
                    f"{'/'.join(sorted(modes))} (vLLM's prefix caching off?)")
            kinds.append(KVGroup(STATE))
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
    if all(k.kind == STATE for k in kinds):
        raise UnsupportedKVGroups("tiercache: the model has state layers only (no attention group)")
    # an attention group's specs: the dtype and KV heads tiercache's namespace and shards name
    return tuple(kinds), next(specs for k, specs in zip(kinds, specs_of) if k.kind != STATE)


def block_bytes(kv_cache_config: KVCacheConfig, groups: Sequence[KVGroup], attention_specs: Sequence[Any]) -> int:
    """The bytes one engine block spans in the worker's KV tensors (what one chunk position holds).

    Attention-only models: one group's pages (vLLM shares each tensor among one layer of every
    group). With state groups vLLM 0.32 gives each group its own tensors, so the worker's layout
    covers every layer: the attention pages and each state layer's state (unpadded).
    """
    if not any(g.kind == STATE for g in groups):
        return sum(s.page_size_bytes for s in attention_specs)
    total = 0
    for group in kv_cache_config.kv_cache_groups:
        if not getattr(group, "enable_kv_transfer", True):
            continue
        spec = group.kv_cache_spec
        shapes = getattr(spec, "shapes", None)
        if shapes is None:
            total += spec.page_size_bytes * len(group.layer_names)
        else:
            state = sum(math.prod(shape) * dtype.itemsize for shape, dtype in zip(shapes, spec.dtypes))
            total += state * len(group.layer_names)
    return total


def kept_from(groups: Sequence[KVGroup], chunk: int, end_token: int, bpc: int, block_size: int,
              with_state: bool = False) -> tuple[int, ...]:
    """Per group, the first request block of chunk ``chunk`` a store keeps (and a later hit may load).

    ``end_token``: the token after the chunk's last stored one (its end, or a prompt tail's).
    Full attention: the chunk's first block. A window group: the block holding token
    ``end_token - window`` (never before the chunk's first block): a hit using the chunk
    ends at token ``L >= end_token - 1`` (vLLM computes the last prompt token itself) and
    needs the blocks from the one holding ``L - window + 1`` on. A state group: its last
    block (the state at the chunk's end) for a state key (``with_state``), else none.
    """
    start = chunk * bpc
    floors = []
    for g in groups:
        if g.kind == SLIDING_WINDOW:
            floors.append(max(start, (end_token - g.window) // block_size))
        elif g.kind == STATE:
            floors.append(start + bpc - 1 if with_state else start + bpc)
        else:
            floors.append(start)
    return tuple(floors)


def chunk_complete(group_block_ids: Sequence[Sequence[int]], floors: Sequence[int], end: int,
                   null_block: int) -> bool:
    """Every group has an allocated block at every position ``floors[g] .. end - 1``."""
    return all(lo >= end or (len(ids) >= end and null_block not in ids[lo:end])
               for ids, lo in zip(group_block_ids, floors))


def storable(group_block_ids: Sequence[Sequence[int]], groups: Sequence[KVGroup], extent: Mapping[bytes, tuple[int, int]],
             bpc: int, block_size: int, null_block: int, incomplete_too: bool = False,
             with_state: bool = False) -> dict[bytes, tuple[int, ...]]:
    """The keys a store may take, each with the first block it keeps per group (:func:`kept_from`).

    ``extent``: each key's chunk and end token. A key goes only when every block a
    later hit may load is allocated (``incomplete_too``: regardless; a negative control).
    ``with_state``: the keys are state keys (their state groups' tables hold the state blocks).
    """
    out: dict[bytes, tuple[int, ...]] = {}
    for key, (chunk, end_token) in extent.items():
        floors = kept_from(groups, chunk, end_token, bpc, block_size, with_state)
        if incomplete_too or chunk_complete(group_block_ids, floors, -(-end_token // block_size), null_block):
            out[key] = floors
    return out


def chunk_segments(slot: int, group_block_ids: Sequence[Sequence[int]], chunk: int, lo: int, hi: int,
                   bpc: int, null_block: int, floors: Sequence[int] | None = None) -> list[CopySegment]:
    """The copy segments of request blocks ``lo .. hi - 1`` (all inside chunk ``chunk``), every group.

    Group ``g``'s block at request position ``b`` goes to chunk position
    ``g * bpc + b - chunk * bpc``; null blocks, positions past a table's end
    and positions before ``floors[g]`` (:func:`kept_from`) are skipped, so each
    run of allocated blocks is one segment.
    """
    segments: list[CopySegment] = []
    base = chunk * bpc
    for g, ids in enumerate(group_block_ids):
        run: list[int] = []
        first = 0
        for b in range(max(lo, floors[g]) if floors is not None else lo, min(hi, len(ids))):
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


def load_segments(group_block_ids: Sequence[Sequence[int]], groups: Sequence[KVGroup], chunk: int, lo: int,
                  hi: int, bpc: int, block_size: int, null_block: int,
                  with_state: bool = False, end_token: int | None = None) -> tuple[list[CopySegment], bool]:
    """A load of blocks ``lo .. hi - 1`` of chunk ``chunk``: the segments its store kept, and whether
    they are every block vLLM needs there (False: the store left one out; the load must fail).

    ``with_state``: the chunk is the hit's last, loaded from its state key; each state group's block
    at the chunk's end must be allocated (the state vLLM resumes from). A state group's other
    blocks are never read before the engine writes them, whatever vLLM allocated there.
    ``end_token``: where a partial chunk's store ended (a P/D prompt tail, a partial chunk), whose
    window groups kept blocks from further back than a whole chunk's (:func:`kept_from`); None: whole."""
    end = (chunk + 1) * bpc * block_size if end_token is None else end_token
    floors = kept_from(groups, chunk, end, bpc, block_size, with_state)
    kept = chunk_segments(-1, group_block_ids, chunk, lo, hi, bpc, null_block, floors)
    left_out = any(b != null_block for g, ids, floor in zip(groups, group_block_ids, floors)
                   if g.kind != STATE for b in ids[lo:min(floor, hi)])
    state_missing = with_state and any(
        g.kind == STATE and not (lo <= floor < hi and floor < len(ids) and ids[floor] != null_block)
        for g, ids, floor in zip(groups, group_block_ids, floors))
    return kept, not (left_out or state_missing)


def refuse_unserved_state_layers(groups: Sequence[KVGroup], pp_size: int) -> None:
    """Raise :class:`UnsupportedKVGroups` for a state-layer model where tiercache does not serve state
    layers yet: several pipeline stages (not built). Tensor parallelism is served (rank shards:
    connector/engine_info.py), and so is P/D (connector/pd/state_handoff.py)."""
    if STATE in {g.kind for g in groups} and pp_size > 1:
        raise UnsupportedKVGroups(
            f"tiercache serves state layers (MambaSpec) with one pipeline stage only; this engine has "
            f"{pp_size} (groups: {describe_groups(groups)})")


def state_group_indices(groups: Sequence[KVGroup]) -> tuple[int, ...]:
    """The indices of the state groups (empty for an attention-only model)."""
    return tuple(i for i, g in enumerate(groups) if g.kind == STATE)


def null_block_id(kv_cache_manager: Any) -> int:
    """vLLM's null block id (what a window group's table holds where its blocks were freed); 0 without a pool."""
    pool = getattr(kv_cache_manager, "block_pool", None)
    return int(pool.null_block.block_id) if pool is not None else 0
