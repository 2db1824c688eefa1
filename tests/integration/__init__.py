"""Integration tests: real files, real filesystems, real subprocesses (no mocks).

:func:`mounted` mounts a small scratch filesystem (tmpfs, ramfs) for a test and
always unmounts it; a test that cannot mount one (not root, no mount(8), a
container without CAP_SYS_ADMIN) is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import subprocess
from collections.abc import Iterator

import pytest


@contextlib.contextmanager
def mounted(fstype: str, target: pathlib.Path, options: str = "") -> Iterator[pathlib.Path]:
    """Mount a fresh ``fstype`` filesystem on ``target`` for the duration of the block."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip(f"mounting {fstype} needs root and mount(8)")
    target.mkdir(parents=True, exist_ok=True)
    cmd = ["mount", "-t", fstype, *(["-o", options] if options else []), fstype, str(target)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount {fstype} ({' '.join(cmd)}): {proc.stderr.strip()}")
    try:
        yield target
    finally:
        for cmd in (["umount", str(target)], ["umount", "-l", str(target)]):  # lazy if busy
            if subprocess.run(cmd, capture_output=True, timeout=30, check=False).returncode == 0:
                break
