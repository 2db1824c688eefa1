"""Route tiercache's log records into vLLM's log, inside a vLLM process.

vLLM configures only the ``vllm`` logger; records of ``tiercache.*`` loggers
would otherwise fall through to Python's last-resort handler, which prints
warnings and errors only. :func:`adopt_vllm_logging` gives the ``tiercache``
logger vLLM's handlers once, so our INFO lines (chunk geometry, hand-offs,
expiries) appear beside vLLM's, with its format.

The level is the config's ``log_level`` (YAML, or ``TIERCACHE_LOG_LEVEL``);
by default the ``vllm`` logger's (``VLLM_LOGGING_LEVEL``). With
``VLLM_CONFIGURE_LOGGING=0``, or when the user gave the ``tiercache`` logger
handlers of their own, nothing changes.
"""

from __future__ import annotations

import logging


def adopt_vllm_logging(level: str | None = None) -> None:
    """Give the ``tiercache`` logger vLLM's handlers, at ``level`` or vLLM's (idempotent)."""
    ours = logging.getLogger("tiercache")
    theirs = logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return  # configured already, by us or by the user; or vLLM logs nowhere itself
    wanted = logging.getLevelName(level) if level else theirs.getEffectiveLevel()
    if not isinstance(wanted, int):
        raise ValueError(f"log_level {level!r}: not a logging level (DEBUG, INFO, WARNING, ERROR)")  # noqa: TRY004
    ours.setLevel(wanted)
    for handler in theirs.handlers:
        if handler.level > wanted:
            handler.setLevel(wanted)  # vLLM's handler filters by level too; vLLM's logger still filters its own
        ours.addHandler(handler)
    ours.propagate = False  # the handlers are vLLM's: the root logger must not print it again
