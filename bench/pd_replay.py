"""Replay P/D hand-off READs between two plain processes, with tiercache's own memory and descriptors.

A decode engine's NIXL READ of a hand-off, without vLLM around it: a
"producer" process on core 0 holds a 2 GiB KV cache (torch tensors, collapsed
onto 2 MiB pages as ``pd.huge_pages`` does) and, for ``--source planes``, a
2 GiB host slab in layout ``planes`` (``HostSlab``, prefaulted on huge pages)
filled from that KV cache by ``copy_plane_segments``, exactly as a via_host
producer stores chunks. A "consumer" process on core 1 holds its own KV cache
and READs hand-offs into it with the descriptors ``paired_descs`` builds (8 per
hand-off of 63 blocks: one per region), one transfer handle per READ, as
``NixlPeerTier`` does. Next to it, the raw ceiling: the same bytes as
``--raw-chunks`` equal descriptors with a handle made once (bench/pd.py's raw
figure). Both READ 16 different hand-offs in turn.

Use it to tell whether a slow in-engine READ (bench/pd.py, debug log) is the
data path's or the engine's: here nothing but the READ runs. ``--spinner``
adds a process that spins on ``sched_yield`` on the consumer's core, as
vLLM's shared-memory queue readers do between steps.

    python bench/pd_replay.py                      # planes, then direct's source, then raw
    python bench/pd_replay.py --spinner --reads 400
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

if __package__ in (None, ""):  # run as a script (python bench/<name>.py): import `bench`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import BenchParser

REGIONS_PER_LAYER, LAYERS = 2, 4
BLOCKS = 4096  # 64 KiB pages x 8 regions x 4096 blocks: 2 GiB
HANDOFF_BLOCKS = 63  # 2048 tokens of 32-token blocks, less the last one
HANDOFFS = 16
PRODUCER_CORE, CONSUMER_CORE = 0, 1


def _agent(name: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(backends=[], enable_prog_thread=False))
    agent.create_backend("UCX", {"ucx_error_handling_mode": "none"})
    return agent


def _pin(core: int) -> None:
    if hasattr(os, "sched_setaffinity") and core < (os.cpu_count() or 1):
        os.sched_setaffinity(0, {core})


def _kv_cache() -> tuple[dict[str, torch.Tensor], Any]:
    """A vLLM-shaped KV cache ((2, blocks, 32, 8, 64) float32 per layer: 64 KiB pages), on huge pages."""
    from tiercache.layout import KVBlockLayout
    from tiercache.transfer.huge_pages import collapse_tensors

    kv = {f"layer.{i}": torch.zeros((REGIONS_PER_LAYER, BLOCKS, 32, 8, 64)) for i in range(LAYERS)}
    collapse_tensors(kv.values())
    return kv, KVBlockLayout.from_kv_caches(kv, BLOCKS)


def _producer(conn: Any, source: str) -> None:
    """Child: KV (and slab) registered with NIXL; sends its agent and block description; waits."""
    _pin(PRODUCER_CORE)
    from tiercache.layout import slab_planes
    from tiercache.pd.blocks import BlockRegions
    from tiercache.transfer.device import CopyJob, CopySegment, copy_segments
    from tiercache.transfer.host_slab import HostSlab

    kv, layout = _kv_cache()
    for tensor in kv.values():
        tensor.normal_()
    agent = _agent(f"replay-producer-{os.getpid()}")
    host = None
    if source == "planes":
        host = HostSlab(BLOCKS, layout.slot_bytes(1), pin_memory=False, prefault=True, huge_pages=True)
        planes = slab_planes(host.slab, layout.page_bytes, 1)
        agent.register_memory([(host.slab.data_ptr(), host.slab.numel(), 0, "")], "DRAM")
        for h in range(HANDOFFS):  # hand-off h: slots and KV blocks h*63.., as a via_host store writes them
            blocks = range(h * HANDOFF_BLOCKS, (h + 1) * HANDOFF_BLOCKS)
            copy_segments(layout, host.slab, 1, CopyJob(h, "store", tuple(CopySegment(b, 0, (b,)) for b in blocks)),
                          planes=planes)
        regions = BlockRegions.from_planes(planes)
    else:
        regions = BlockRegions.from_layout(layout)
        agent.register_memory(regions.spans(), "DRAM")
    conn.send((agent.get_agent_metadata(), regions.to_wire()))
    conn.recv()
    del host


def _spinner(stop: Any) -> None:
    _pin(CONSUMER_CORE)
    while not stop.is_set():
        os.sched_yield()


def _read_all(agent: Any, handle: Any) -> None:
    state = agent.transfer(handle)
    while state not in ("DONE", "ERR"):
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise RuntimeError("NIXL READ failed")


def replay(source: str, reads: int, raw_chunks: int, spinner: bool) -> dict[str, float]:
    """Per-READ times (ms) of tiercache-shaped READs, and of raw READs of the same bytes."""
    from tiercache.pd.blocks import BlockRegions, paired_descs

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    stop = ctx.Event()
    producer = ctx.Process(target=_producer, args=(child, source), daemon=True)
    producer.start()
    spin = ctx.Process(target=_spinner, args=(stop,), daemon=True) if spinner else None
    try:
        metadata, wire = parent.recv()
        _pin(CONSUMER_CORE)
        if spin is not None:
            spin.start()
        _kv, layout = _kv_cache()
        ours, theirs = BlockRegions.from_layout(layout), BlockRegions.from_wire(wire)
        agent = _agent(f"replay-consumer-{os.getpid()}")
        agent.register_memory(ours.spans(), "DRAM")
        peer = agent.add_remote_agent(metadata)

        def ours_read(i: int) -> float:
            h = i % HANDOFFS
            dst = (i * HANDOFF_BLOCKS) % (BLOCKS - HANDOFF_BLOCKS)
            start = time.perf_counter()
            local, remote = paired_descs(ours, theirs, list(range(dst, dst + HANDOFF_BLOCKS)),
                                         list(range(h * HANDOFF_BLOCKS, (h + 1) * HANDOFF_BLOCKS)))
            handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local, "DRAM"),
                                           agent.get_xfer_descs(remote, "DRAM"), peer)
            _read_all(agent, handle)
            agent.release_xfer_handle(handle)
            return time.perf_counter() - start

        handoff_bytes = HANDOFF_BLOCKS * layout.bytes_per_block
        piece = handoff_bytes // raw_chunks
        raw_handles = []
        for h in range(HANDOFFS):  # the same bytes, equal descriptors, handles made once
            src = [(theirs.addrs[0] + (h * handoff_bytes + c * piece) % (theirs.num_blocks * theirs.pages[0]), piece, 0)
                   for c in range(raw_chunks)]
            dst = [(ours.addrs[0] + (h * handoff_bytes + c * piece) % (ours.num_blocks * ours.pages[0]), piece, 0)
                   for c in range(raw_chunks)]
            raw_handles.append(agent.initialize_xfer("READ", agent.get_xfer_descs(dst, "DRAM"),
                                                     agent.get_xfer_descs(src, "DRAM"), peer))

        def raw_read(i: int) -> float:
            start = time.perf_counter()
            _read_all(agent, raw_handles[i % HANDOFFS])
            return time.perf_counter() - start

        for i in range(HANDOFFS):  # one pass first: connections, page tables
            ours_read(i)
            raw_read(i)
        times: dict[str, list[float]] = {"tiercache": [], "raw": []}
        for i in tqdm(range(reads), desc=f"READs ({source})", unit="READ"):
            times["tiercache"].append(ours_read(i))
            times["raw"].append(raw_read(i))
        for handle in raw_handles:
            agent.release_xfer_handle(handle)
        out = {"bytes": float(handoff_bytes)}
        for name, values in times.items():
            ms = np.asarray(values) * 1e3
            out[f"{name}_median_ms"] = float(np.median(ms))
            out[f"{name}_p90_ms"] = float(np.percentile(ms, 90))
            out[f"{name}_gbps"] = handoff_bytes / float(ms.mean()) / 1e6
        return out
    finally:
        stop.set()
        parent.send("stop")
        producer.join(timeout=10)


def main(argv: list[str] | None = None) -> int:
    parser = BenchParser(
        "pd_replay", __doc__, progress=False,
        ceiling="raw READs of the same bytes in --raw-chunks equal descriptors, with transfer "
        "handles made once (bench/pd.py's raw figure), in the same run",
        examples=("--sources planes kv --reads 200", "--spinner --reads 400"),
    )
    parser.add_argument("--sources", nargs="+", choices=["planes", "kv"], default=["planes", "kv"],
                        help="what the producer exposes: its host slab in layout planes (via_host) or its KV "
                        "cache (mode direct)")
    parser.add_argument("--reads", type=int, default=200, help="timed READs per source (default 200)")
    parser.add_argument("--raw-chunks", type=int, default=63,
                        help="descriptors of the raw READ of the same bytes (default 63: bench/pd.py's)")
    parser.add_argument("--spinner", action="store_true",
                        help="spin on sched_yield on the consumer's core meanwhile (vLLM's queue readers)")
    args = parser.parse_args(argv)
    print(f"{'source':8s} {'READ median ms':>15s} {'p90':>6s} {'GB/s':>6s} {'raw median ms':>14s} {'raw GB/s':>9s} "
          f"{'ratio':>6s}")
    for source in args.sources:
        r = replay(source, args.reads, args.raw_chunks, args.spinner)
        print(f"{source:8s} {r['tiercache_median_ms']:15.2f} {r['tiercache_p90_ms']:6.2f} {r['tiercache_gbps']:6.2f} "
              f"{r['raw_median_ms']:14.2f} {r['raw_gbps']:9.2f} {r['tiercache_gbps'] / r['raw_gbps']:6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
