"""Raw NIXL UCX READs: the hardware ceiling that P/D transfers are judged against.

Two ends, both plain NIXL (no tiercache code on the data path):

* :func:`serve_target` (a child process): a NIXL agent with ``nbytes`` of random
  bytes registered, which writes ``(agent metadata, address, nbytes)`` to a file
  (or a pipe) and progresses until told to stop;
* :func:`read_in_worker` (called *inside a vLLM worker* through
  ``LLM.collective_rpc``, see the engine runner's ``worker_call`` rounds): READs
  one hand-off's worth of that memory into a buffer of the worker's own, with
  chunk-sized descriptors and transfer handles made once, and returns how long
  each READ took. It measures the ceiling in the very process, on the very core
  and between the very steps where the connector's own READs run, so a ratio
  against it does not charge the engine's surroundings to the data path.

State: :func:`read_in_worker` keeps its agent, buffer and handles in this
module's ``_READERS`` (one per target file and error mode) for the life of the
worker process; only the thread vLLM runs RPCs on touches it.
"""

from __future__ import annotations

import os
import pickle
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np


def raw_agent(name: str, error_handling: str) -> Any:
    """A NIXL agent with one UCX backend (``error_handling``: ``none`` or ``peer``), no progress thread."""
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(backends=[], enable_prog_thread=False))
    agent.create_backend("UCX", {"ucx_error_handling_mode": error_handling})
    return agent


def serve_target(conn: Connection, nbytes: int, error_handling: str, info_file: str | None = None,
                 cpu: int | None = None) -> None:
    """Child process: register ``nbytes`` of random bytes, publish them, progress until ``conn`` says stop.

    The description ``(metadata, address, nbytes)`` goes back through ``conn``
    and, when ``info_file`` is given, into that file (pickled, written atomically).
    """
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})
    agent = raw_agent(f"tiercache-raw-target-{os.getpid()}", error_handling)
    buf = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    agent.register_memory([(int(buf.ctypes.data), nbytes, 0, "")], "DRAM")
    info = (agent.get_agent_metadata(), int(buf.ctypes.data), nbytes)
    if info_file:
        tmp = Path(info_file + ".tmp")
        tmp.write_bytes(pickle.dumps(info))
        os.replace(tmp, info_file)
    conn.send(info[:2])
    progress_until_stopped(agent, conn)


def progress_until_stopped(agent: Any, conn: Connection) -> None:
    """A target's loop: progress ``agent`` until ``conn`` says stop (as a tiercache producer does between
    steps; needed for UCX error mode peer)."""
    while not conn.poll(0.0005):
        agent.get_new_notifs()
    conn.recv()


def reader_end(name: str, error_handling: str, nbytes: int, metadata: bytes) -> tuple[Any, np.ndarray, str]:
    """A reading agent, an ``nbytes`` buffer registered with it and the target's agent added: (agent, buffer, peer).

    The buffer is touched (ones), so the READs into it pay no first-touch faults.
    """
    agent = raw_agent(name, error_handling)
    local = np.ones(nbytes, dtype=np.uint8)
    agent.register_memory([(int(local.ctypes.data), nbytes, 0, "")], "DRAM")
    return agent, local, agent.add_remote_agent(metadata)


@dataclass
class _Reader:
    """One worker's end: its agent, its buffer (as large as the target's) and prepared handles."""

    agent: Any
    peer: str
    local: np.ndarray
    remote_addr: int
    nbytes: int
    handles: dict[tuple[int, int], list[Any]] = field(default_factory=dict)  # (chunk_bytes, chunks) -> one per slot
    turns: dict[tuple[int, int], int] = field(default_factory=dict)  # (chunk_bytes, chunks) -> READs so far


_READERS: dict[tuple[str, str], _Reader] = {}


def _reader(info_file: str, error_handling: str) -> _Reader:
    key = (info_file, error_handling)
    if key not in _READERS:
        metadata, remote_addr, nbytes = pickle.loads(Path(info_file).read_bytes())
        agent, local, peer = reader_end(f"tiercache-raw-reader-{os.getpid()}-{len(_READERS)}", error_handling,
                                        nbytes, metadata)
        _READERS[key] = _Reader(agent, peer, local, remote_addr, nbytes)
    return _READERS[key]


def slot_reads(agent: Any, peer: str, local_addr: int, remote_addr: int, chunk_bytes: int, chunks: int,
               slots: int) -> list[Any]:
    """One prepared READ per hand-off-sized slot: slot ``s`` is ``chunks`` descriptors of ``chunk_bytes``.

    Slot ``s`` starts ``s * chunks * chunk_bytes`` into both buffers (registered with ``agent``).
    Each is posted once, untimed, before it is returned (connection set-up, page tables).
    """
    size, handles = chunk_bytes * chunks, []
    for slot in range(slots):
        offsets = [slot * size + i * chunk_bytes for i in range(chunks)]
        mine = agent.get_xfer_descs([(local_addr + o, chunk_bytes, 0) for o in offsets], "DRAM")
        theirs = agent.get_xfer_descs([(remote_addr + o, chunk_bytes, 0) for o in offsets], "DRAM")
        handles.append(agent.initialize_xfer("READ", mine, theirs, peer))
    for handle in handles:
        post_transfer(agent, handle)
    return handles


def post_transfer(agent: Any, handle: Any) -> None:
    """Post a prepared transfer (READ or WRITE) and spin until it is done (RuntimeError if it fails)."""
    state = agent.transfer(handle)
    while state not in ("DONE", "ERR"):
        state = agent.check_xfer_state(handle)
    if state == "ERR":
        raise RuntimeError("raw NIXL transfer failed")


def _handles(reader: _Reader, chunk_bytes: int, chunks: int) -> list[Any]:
    """One prepared READ per hand-off-sized slot of the target; all made (and posted once, untimed) at first use."""
    key = (chunk_bytes, chunks)
    if key not in reader.handles:
        slots = reader.nbytes // (chunk_bytes * chunks)
        if slots < 1:
            raise ValueError(f"target holds {reader.nbytes} bytes, less than one READ of {chunks} x {chunk_bytes}")
        reader.handles[key] = slot_reads(reader.agent, reader.peer, int(reader.local.ctypes.data),
                                         reader.remote_addr, chunk_bytes, chunks, slots)
    return reader.handles[key]


def read_in_worker(worker: Any, info_file: str, error_handling: str, chunk_bytes: int, chunks: int,
                   reads: int = 1) -> list[float]:
    """Inside a vLLM worker: ``reads`` raw READs of ``chunks`` x ``chunk_bytes``; seconds of each.

    Each READ takes the next hand-off-sized slot of the target in turn (as many
    as fit), so that successive READs do not re-read what the CPU's cache holds.
    ``worker`` is the vLLM worker ``collective_rpc`` passes; it is not used.
    """
    del worker
    reader = _reader(info_file, error_handling)
    handles = _handles(reader, chunk_bytes, chunks)
    times: list[float] = []
    for _ in range(reads):
        turn = reader.turns.get((chunk_bytes, chunks), 0)
        reader.turns[(chunk_bytes, chunks)] = turn + 1
        started = time.perf_counter()
        post_transfer(reader.agent, handles[turn % len(handles)])
        times.append(time.perf_counter() - started)
    return times
