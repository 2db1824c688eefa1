"""`tiercache demo` as a user sees it, and `tiercache inspect engine` on the engine it holds up.

Runs the demo small (tiny model, 2 rounds of 2 prompts, ``--hold``) in a
subprocess, as scripts/demo.sh does. The screen must carry the demo's lines,
the result table and the verdict, and none of vLLM's output (its warm-up
tracebacks, its warnings, and the "engine core exited unexpectedly" line a
shutdown at interpreter exit used to print); the log file the demo names must
hold vLLM's output instead. While the demo holds its engine up,
``tiercache inspect engine`` on the URL it prints must show the host tier and
the same hit tokens as the demo's table; Ctrl-C (SIGINT) then ends the demo
with exit 0.
"""

from __future__ import annotations

import pathlib
import re
import signal
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]


def tiercache(*args: str) -> list[str]:
    return [sys.executable, "-m", "tiercache.cli.main", *args]


def test_demo_screen_then_inspect_its_engine(models_root: pathlib.Path, tmp_path: pathlib.Path) -> None:
    log = tmp_path / "demo" / "vllm.log"
    demo = subprocess.Popen(
        tiercache("demo", "--model", "tiny", "--rounds", "2", "--prompts", "2", "--prompt-tokens", "512",
                  "--models-dir", str(models_root), "--log", str(log), "--hold", "300"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 600
        assert demo.stdout is not None
        while time.monotonic() < deadline:
            line = demo.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip("\n"))
            if "[demo] keeping the engine up" in line:
                break
        screen = "\n".join(lines)
        held = re.search(r"tiercache inspect engine (http://\S+)", lines[-1])
        assert held, screen
        inspect = subprocess.run(tiercache("inspect", "engine", held.group(1)), capture_output=True, text=True,
                                 cwd=ROOT, timeout=60, check=False)
        demo.send_signal(signal.SIGINT)  # what Ctrl-C sends: the hold ends, the engine is shut down
        rest, _ = demo.communicate(timeout=120)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    screen += "\n" + rest
    assert demo.returncode == 0, screen
    assert f"[demo] vLLM's own log goes to {log}" in screen
    for text in ("round 1/2 (cold)", "cold", "warm 1", "cpu: ", "exactly the cold round's tokens: True"):
        assert text in screen, text
    for noise in ("Traceback", "WARNING", "exited unexpectedly", "skip_tokenizer_init", "Triton"):
        assert noise not in screen, noise
    logged = log.read_text()
    assert "WARNING" in logged  # vLLM spoke, into the file
    assert "exited unexpectedly" not in logged  # the engine was shut down, not abandoned

    assert inspect.returncode == 0, inspect.stderr
    served = int(re.search(r"cpu: (\d+) tok", screen).group(1))  # type: ignore[union-attr]
    assert f"hits: {served:,} tokens" in inspect.stdout, inspect.stdout
    assert re.search(r"^\s+cpu\s+\S+ \S+\s+\S+ \S+\s+\S+%", inspect.stdout, re.MULTILINE), inspect.stdout
