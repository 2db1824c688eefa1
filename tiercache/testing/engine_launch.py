"""The test side of an engine run: start the engine runner script, wait, read its result.

vLLM spawns worker processes and keeps global state, so an engine never runs
inside the pytest (or benchmark) process: :func:`run_engine` and
:class:`EngineRun` start the engine runner (the engine side, whose docstring
holds the spec and result formats) in a process group of its own, forked from
a fork server that imported vLLM once (:mod:`tiercache.testing.engine_forkserver`;
``TIERCACHE_ENGINE_FORKSERVER=0``: a fresh ``python -m
tiercache.testing.engine_runner`` each time), drive its round barriers,
enforce a timeout, kill the whole group at the end, and return the parsed
result. :func:`random_prompts` builds token-id prompts for specs. Tests,
benchmarks and the demo call these, mostly through :mod:`tiercache.testing.engine_runner`, which re-exports them.
Standard library only: importing it never imports vLLM.

Threads: one caller thread drives an :class:`EngineRun`.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from tiercache.testing import engine_forkserver

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
LOG_TAIL_CHARS = 4000


def random_prompts(
    n: int,
    length: int,
    vocab: int = 1024,
    seed: int = 0,
    shared_prefix: list[int] | None = None,
) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids in [3, vocab-1], optionally after a shared prefix.

    ``length`` counts the random part only; ids 0-2 (pad/bos/eos) are never drawn.
    """
    rng = random.Random(seed)
    prefix = list(shared_prefix or [])
    return [prefix + [rng.randint(3, vocab - 1) for _ in range(length)] for _ in range(n)]


def _subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    parts = [str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _log_tail(log_path: pathlib.Path) -> str:
    try:
        return log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
    except OSError as exc:
        return f"<no log: {exc}>"


def _kill_group(proc: subprocess.Popen[bytes] | engine_forkserver.ForkedRunner) -> None:
    """SIGKILL the runner's process group (engine core and workers included)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_engine(
    spec: dict[str, Any],
    timeout_s: float = 600,
    workdir: pathlib.Path | None = None,
) -> dict[str, Any]:
    """Run one engine over ``spec`` in a subprocess and return the parsed result.

    Raises RuntimeError (with the last 4000 characters of the log) when the
    process fails, times out, or writes no result. ``workdir`` keeps the spec,
    result and ``engine.log`` there instead of a temporary directory.
    """
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="tiercache-e2e-") as tmp:
            return EngineRun(spec, pathlib.Path(tmp)).result(timeout_s)
    return EngineRun(spec, workdir).result(timeout_s)


class EngineRun:
    """One engine runner subprocess the test can talk to between rounds.

    ``EngineRun(spec, workdir)`` starts the process at once (spec, result,
    ``engine.log`` and the barrier files live in ``workdir``). Rounds with a
    ``"barrier"`` wait for :meth:`release`; :meth:`wait_for` blocks until the
    engine reached one. :meth:`result` waits for the result, kills the process
    group whatever happens, and returns the parsed result.

    Threads: one test thread drives an EngineRun.
    """

    def __init__(self, spec: dict[str, Any], workdir: pathlib.Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.barrier_dir = workdir / "barriers"
        self.barrier_dir.mkdir(exist_ok=True)
        for stale in self.barrier_dir.iterdir():
            stale.unlink()
        spec = {**spec, "barrier_dir": str(self.barrier_dir)}
        self.spec_path, self.out_path = workdir / "spec.json", workdir / "result.json"
        self.log_path = workdir / "engine.log"
        self.spec_path.write_text(json.dumps(spec))
        self.out_path.unlink(missing_ok=True)
        argv = ["--spec", str(self.spec_path), "--out", str(self.out_path)]
        self._started = time.monotonic()
        self.log_path.write_bytes(b"")
        self.proc: subprocess.Popen[bytes] | engine_forkserver.ForkedRunner
        if engine_forkserver.enabled():
            self.proc = engine_forkserver.ForkedRunner(argv, self.log_path, REPO_ROOT, _subprocess_env())
        else:
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen([sys.executable, "-m", "tiercache.testing.engine_runner", *argv],
                                             cwd=REPO_ROOT, env=_subprocess_env(), stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True)

    def wait_for(self, barrier: str, timeout_s: float = 600) -> None:
        """Block until the engine reached ``barrier`` (RuntimeError if it died or timed out)."""
        reached = self.barrier_dir / f"{barrier}.reached"
        deadline = time.monotonic() + timeout_s
        while not reached.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine runner exited (rc={self.proc.returncode}) before barrier "
                                   f"{barrier!r}; log tail:\n{_log_tail(self.log_path)}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"engine did not reach barrier {barrier!r} in {timeout_s:.0f}s; "
                                   f"log tail:\n{_log_tail(self.log_path)}")
            time.sleep(0.05)

    def partial(self, barrier: str) -> dict[str, Any]:
        """The rounds the engine finished before ``barrier`` (after :meth:`wait_for`)."""
        return json.loads((self.barrier_dir / f"{barrier}.partial.json").read_text())

    def release(self, barrier: str) -> None:
        """Let the engine start the round waiting at ``barrier``."""
        (self.barrier_dir / f"{barrier}.go").touch()

    def kill(self) -> None:
        _kill_group(self.proc)
        self.proc.wait()

    def result(self, timeout_s: float = 600) -> dict[str, Any]:
        """Wait for the runner's result (``timeout_s`` counted from its start) and return it.

        The process group is killed as soon as the result exists: the runner shut the KV
        connector down before writing it (engine_runner.shut_down_connector), and what vLLM's
        own exit does after that is ~5-10 s of waiting per engine, nothing a test reads.
        """
        deadline = self._started + timeout_s
        try:
            while not self.out_path.is_file() and self.proc.poll() is None:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"engine runner timed out after {timeout_s:.0f}s; log tail:\n{_log_tail(self.log_path)}")
                time.sleep(0.05)
        finally:
            self.kill()  # the engine core and workers too, whatever happened
        if not self.out_path.is_file():
            raise RuntimeError(f"engine runner failed (rc={self.proc.returncode}); log tail:\n"
                               f"{_log_tail(self.log_path)}")
        return json.loads(self.out_path.read_text())
