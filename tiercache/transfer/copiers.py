"""Picks the block copier for where the engine's KV lives: the one place that knows every copier.

:mod:`tiercache.transfer.device` holds the contract the copiers implement and
imports none of them; this module imports the contract and both implementations,
so imports go one way (copiers -> cuda_copier, host_copier -> device). The
copier it returns belongs to its caller (the TransferEngine), which closes it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tiercache.layout import KVBlockLayout
from tiercache.transfer.cuda_batch import CopyMethod
from tiercache.transfer.cuda_copier import CudaStreamCopier
from tiercache.transfer.device import BlockCopier
from tiercache.transfer.host_copier import HostThreadCopier


def make_copier(
    layout: KVBlockLayout,
    slab: torch.Tensor,
    blocks_per_chunk: int,
    copy_threads: int | None = None,
    planes: Sequence[torch.Tensor] | None = None,
    cuda_copy: CopyMethod = "auto",
) -> BlockCopier:
    """The right copier for where the engine's KV lives (``copy_threads``: host KV only;
    ``cuda_copy``: device KV only, see :mod:`tiercache.transfer.cuda_batch`).

    ``planes``: the slab is in layout planes (:func:`tiercache.layout.slab_planes`).
    """
    if layout.device.type == "cuda":
        return CudaStreamCopier(layout, slab, blocks_per_chunk, planes=planes, method=cuda_copy)
    return HostThreadCopier(layout, slab, blocks_per_chunk, threads=copy_threads, planes=planes)
