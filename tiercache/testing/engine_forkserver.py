"""Starts engine runner processes from a fork server that imported vLLM once.

An engine runner (:mod:`tiercache.testing.engine_runner`) started as a fresh
``python -m`` process spends ~10 s importing vLLM before it builds anything;
a plain engine's whole life is ~15 s of which the import is two thirds. Here
the runners are forked from Python's ``multiprocessing`` fork server instead,
whose preload (:mod:`tiercache.testing.engine_preload`) imports vLLM once per
test session: a runner starts in well under a second.

What a forked runner shares with a fresh one: the same code path from
``engine_runner.main`` on; its own session and process group (``os.setsid``,
so the launcher can kill the engine with everything vLLM spawned); the
environment, working directory and output the launcher asked for (set in the
child before ``main``). What it does not share: vLLM's own child processes
(engine core, workers) are still started by vLLM with the ``spawn`` method
vLLM's CPU platform forces, so they import vLLM themselves, as in production.

``TIERCACHE_ENGINE_FORKSERVER=0`` in the environment turns this off: every
runner is then a fresh ``python -m tiercache.testing.engine_runner`` process.

Threads: a :class:`ForkedRunner` may be made on any thread (the fork server's
start is locked by ``multiprocessing``) and belongs to the thread that made it.
"""

from __future__ import annotations

import importlib
import multiprocessing
import multiprocessing.context
import os
import pathlib
import sys

PRELOAD_MODULE = "tiercache.testing.engine_preload"
RUNNER_ENTRY = "tiercache.testing.engine_runner:main"
SWITCH_ENV = "TIERCACHE_ENGINE_FORKSERVER"


def enabled() -> bool:
    """Whether runners are forked from the fork server (the default) or started as fresh processes."""
    return os.environ.get(SWITCH_ENV, "1") != "0"


def _context() -> multiprocessing.context.ForkServerContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([PRELOAD_MODULE])  # read once, when the server starts
    return context  # type: ignore[return-value]


def _run_in_child(entry: str, argv: list[str], log_path: str, cwd: str, env: dict[str, str]) -> None:
    """The forked runner's body: become a process group, point stdout/stderr at the log, run
    ``entry`` ("package.module:function", called with ``argv``; its return value is the exit status)."""
    multiprocessing.current_process().daemon = False  # a daemon may not start vLLM's processes
    os.setsid()
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for fd in (1, 2):
        os.dup2(log_fd, fd)
    os.close(log_fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    module_name, _, function_name = entry.partition(":")
    function = getattr(importlib.import_module(module_name), function_name)
    sys.exit(function(argv))


class ForkedRunner:
    """A runner forked from the fork server, with the part of ``subprocess.Popen`` the launcher uses.

    It runs ``entry(argv)`` (default: the engine runner's ``main``) with stdout and stderr
    appended to ``log_path``, in ``cwd``, with exactly ``env`` as its environment.

    Daemon on this side, so a runner a caller forgot is terminated when the caller's process
    exits instead of being waited for; the child clears the flag on its side, as a daemon could
    not start vLLM's own processes. ``pid`` is also the runner's process group id. ``poll()``
    and ``wait()`` return the exit status as Popen does (negative: killed by that signal).
    """

    def __init__(self, argv: list[str], log_path: pathlib.Path, cwd: pathlib.Path,
                 env: dict[str, str], entry: str = RUNNER_ENTRY) -> None:
        self._process = _context().Process(
            target=_run_in_child, args=(entry, argv, str(log_path), str(cwd), env),
            name="tiercache-engine-runner", daemon=True)
        self._process.start()
        assert self._process.pid is not None
        self.pid: int = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self) -> int:
        self._process.join()
        code = self._process.exitcode
        assert code is not None
        return code
