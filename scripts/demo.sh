#!/usr/bin/env bash
# Sets up everything (scripts/setup.sh) and runs the demo: a vLLM engine with
# tiercache on a multi-round workload, cold vs warm time-to-first-token.
# Extra arguments go to `tiercache demo` (see `tiercache demo --help`).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$here/scripts/setup.sh"
venv="${TIERCACHE_VENV:-$HOME/.cache/tiercache-venv}"
cd "$here"
exec "$venv/bin/tiercache" demo "$@"
