"""Raw NIXL READs of P/D-sized hand-offs from four kinds of source memory, in one run.

Why: a P/D consumer READs from the producer's host slab (mode via_host: an
``mmap`` advised ``MADV_HUGEPAGE`` before its first touch, so it faults in 2 MiB
pages) or from vLLM's KV tensors (mode direct: a ``torch.zeros`` touched on
4 KiB pages, which tiercache collapses into 2 MiB pages in place at start-up,
``MADV_COLLAPSE``, tiercache/transfer/huge_pages.py). This bench asks how much the kind
of source memory alone moves a raw READ, with no engine and no tiercache code
on the data path. One producer process (core 0) holds, each ``--handoffs``
hand-offs long (``--handoff-mib`` a whole number, the slab's slots being 1 MiB):

* ``numpy``: random bytes in a NumPy array (NumPy advises huge pages itself for
  large arrays): the raw ceiling of bench/pd.py, and the reference here;
* ``host slab``: a via_host producer's host tier, made as the connector makes it
  (``tiercache.transfer.host_slab.HostSlab`` with ``prefault`` and ``huge_pages``);
* ``torch collapsed``: a ``torch.zeros`` tensor, touched, then collapsed
  (like vLLM's KV cache on a tiercache P/D engine);
* ``torch small pages``: the same, not collapsed (a P/D engine with
  ``pd.huge_pages: false``).

The consumer (core 1) READs hand-offs of ``--handoff-mib`` in 8 descriptors (as
a 2048-token hand-off of bench/pd.py's heavy model), taking each kind in turn,
each hand-off in turn, ``--rounds`` times, and prints GB/s (median and over
all) and the ratio to ``numpy``. Results go to bench/results/pd_memory.json.

    python bench/pd_memory.py                     # 16 hand-offs of 32 MiB per kind, 30 rounds
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import BenchParser, machine_info, print_table, write_result  # noqa: E402
from tiercache.testing.raw_nixl import (  # noqa: E402
    post_transfer,
    progress_until_stopped,
    raw_agent,
    reader_end,
    slot_reads,
)

KINDS = ("numpy", "host slab", "torch collapsed", "torch small pages")
DESCRIPTORS = 8


def _source_buffers(nbytes: int) -> tuple[dict[str, np.ndarray], str]:
    """The four kinds of memory, ``nbytes`` each (the torch ones kept alive through their NumPy views)."""
    import torch

    from tiercache.transfer.host_slab import HostSlab
    from tiercache.transfer.huge_pages import collapse_tensors

    host = HostSlab(nbytes >> 20, 1 << 20, pin_memory=False, prefault=True, huge_pages=True)
    slab = host.slab.numpy().reshape(-1)  # the view keeps the slab alive

    collapsed = torch.zeros(nbytes, dtype=torch.uint8)
    collapsed.fill_(7)  # touched first, as vLLM's KV cache is by the time tiercache collapses it
    report = collapse_tensors([collapsed])
    small = torch.zeros(nbytes, dtype=torch.uint8)
    small.fill_(7)
    buffers = {"numpy": np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8),
               "host slab": slab, "torch collapsed": collapsed.numpy(), "torch small pages": small.numpy()}
    assert host.huge_pages is not None
    return buffers, f"host slab {host.huge_pages.describe()}; torch {report.describe()}"


def serve(conn: Connection, nbytes: int, cpu: int) -> None:
    """Producer process: register the four buffers, publish them, progress until told to stop."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})
    agent = raw_agent(f"pd-memory-producer-{os.getpid()}", "none")
    buffers, collapsed = _source_buffers(nbytes)
    for buf in buffers.values():
        agent.register_memory([(int(buf.ctypes.data), buf.nbytes, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), {k: int(b.ctypes.data) for k, b in buffers.items()}, collapsed))
    progress_until_stopped(agent, conn)


def main(argv: list[str] | None = None) -> int:
    parser = BenchParser(
        "pd_memory", __doc__, progress=False,
        ceiling="raw NIXL READs from a NumPy buffer (bench/pd.py's raw ceiling), in the same run",
        examples=("--handoff-mib 32 --handoffs 16 --rounds 30",),
    )
    parser.add_argument("--handoff-mib", type=int, default=32, help="bytes per READ, MiB (default 32)")
    parser.add_argument("--handoffs", type=int, default=16,
                        help="different hand-offs per kind, READ in turn so the CPU cache does not serve them")
    parser.add_argument("--rounds", type=int, default=30, help="passes over every kind's hand-offs")
    args = parser.parse_args(argv)
    handoff = args.handoff_mib << 20
    if handoff % DESCRIPTORS:
        parser.error(f"--handoff-mib must split into {DESCRIPTORS} descriptors")

    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    producer = ctx.Process(target=serve, args=(theirs, handoff * args.handoffs, 0), daemon=True)
    producer.start()
    metadata, addrs, collapsed = ours.recv()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {1})
    agent, local, peer = reader_end(f"pd-memory-consumer-{os.getpid()}", "none", handoff * args.handoffs, metadata)
    handles = {kind: slot_reads(agent, peer, int(local.ctypes.data), addrs[kind], handoff // DESCRIPTORS,
                                DESCRIPTORS, args.handoffs) for kind in KINDS}
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for _ in tqdm(range(args.rounds), desc="rounds", unit="round"):
        for kind in KINDS:
            for handle in handles[kind]:
                start = time.perf_counter()
                post_transfer(agent, handle)
                times[kind].append(time.perf_counter() - start)
    ours.send("stop")
    producer.join(10)

    results: dict[str, Any] = {"collapse": collapsed, "kinds": {}}
    for kind in KINDS:
        results["kinds"][kind] = {"median_gbps": handoff / statistics.median(times[kind]) / 1e9,
                                  "gbps": handoff * len(times[kind]) / sum(times[kind]) / 1e9}
    ref = results["kinds"]["numpy"]["gbps"]
    print_table(["source memory", "GB/s (median READ)", "GB/s (all READs)", "vs numpy"],
                [[kind, f"{r['median_gbps']:.2f}", f"{r['gbps']:.2f}", f"{r['gbps'] / ref:.2f}"]
                 for kind, r in results["kinds"].items()],
                title=f"raw NIXL UCX READs of {args.handoff_mib} MiB in {DESCRIPTORS} descriptors, error handling "
                f"none; collapse: {collapsed}")
    path = write_result("pd_memory", results, vars(args), machine_info(["torch", "nixl"]))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
