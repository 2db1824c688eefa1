#!/usr/bin/env bash
# Sets up everything (scripts/setup.sh) and runs the whole test suite.
# Extra arguments go to pytest, e.g.  bash scripts/test.sh -k manager -x
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$here/scripts/setup.sh"
venv="${TIERCACHE_VENV:-$HOME/.cache/tiercache-venv}"
cd "$here"
# the compiled copy executor must have been built here (tests/unit/test_host_kernel.py)
export TIERCACHE_REQUIRE_NATIVE="${TIERCACHE_REQUIRE_NATIVE:-1}"
exec "$venv/bin/python" -m pytest -ra --durations=30 tests "$@"
