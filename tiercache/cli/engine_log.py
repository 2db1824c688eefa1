"""Send everything an engine prints to a log file while the command keeps the screen.

vLLM logs from this process and from the engine-core and worker processes it
starts, and libraries below it (torch, Triton, C++ warnings) write straight to
the file descriptors. Those children inherit descriptors 1 and 2, so
:func:`log_to_file` redirects the descriptors themselves, not only
``sys.stdout``: the warm-up tracebacks, progress bars and shutdown lines all
land in the file. The command writes its own progress and results to the
``console`` stream it gets back (the terminal it was started on).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO


@contextmanager
def log_to_file(path: Path) -> Iterator[TextIO]:
    """Redirect fds 1 and 2 to ``path`` (truncated) for the block; yield the original stdout."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    console = os.fdopen(os.dup(saved_out), "w", buffering=1, encoding="utf-8", errors="replace")
    log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        yield console
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
        for fd in (saved_out, saved_err, log_fd):
            os.close(fd)
        console.close()


def tail(path: Path, lines: int = 25) -> str:
    """The last ``lines`` lines of a log file ('' when it cannot be read)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])
