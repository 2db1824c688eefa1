#!/usr/bin/env bash
# GPU check of tiercache's CUDA path: the GPU tests (tests/gpu: copier methods, layouts,
# pinning, ordering), the host-tier benchmark with the engine KV on the GPU for each copy
# method (bench/host_tier.py --device cuda), the raw batched-copy micro-benchmark and the
# compute-overlap benchmark (bench/cuda_overlap.py).
#
#   bash scripts/gpu_check.sh            # from anywhere; runs in the repository root
#
# Needs one CUDA GPU and a Python with torch (CUDA build), numpy, pytest, tqdm,
# pyyaml, pydantic and pydantic-settings. Nothing is fetched: where pydantic &
# co. are missing, wheels in .whl/ (if any) are installed into a scratch
# folder (pip --no-index). The repository need not be installed: its
# package-dir mapping (pyproject.toml: tiercache.backends = backends/,
# tiercache.connector = connector/) is provided by a small import hook, so the
# tree is tested as it is. Logs, the summary (cuda_summary.json, bench/cuda_summary.py) and
# the raw JSON (raw_results.tgz) go to $OUT (default /tmp/gpu_check_out). Each step has its own time limit; the whole ends within ~8 min (~4 min on an H100).
#
# Environment: PYTHON (default python3), OUT, TC_BENCH_DEVICE (default cuda;
# cpu only to try the script on a machine without a GPU).
set -u -o pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_check_out}
BENCH_DEVICE=${TC_BENCH_DEVICE:-cuda}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
exec > >(tee "$OUT/gpu_check.log") 2>&1

step() { echo; echo "=== $* [$(date -u +%H:%M:%S)]"; }
declare -A RC

step "machine"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi -L
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
else
  echo "nvidia-smi: not found"
fi
nproc; uname -r
timeout 60 "$PY" - <<'EOF'
import sys, torch
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "| built for CUDA", torch.version.cuda,
      "| cuda available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device 0:", p.name, f"{p.total_memory / 2**30:.1f} GiB", f"sm_{p.major}{p.minor}",
          p.multi_processor_count, "SMs")
EOF

step "dependencies"
missing() {  # the packages this Python cannot import (pip names)
  for pair in numpy:numpy pytest:pytest tqdm:tqdm yaml:pyyaml pydantic:pydantic pydantic_settings:pydantic-settings; do
    "$PY" -c "import ${pair%%:*}" 2>/dev/null || echo "${pair##*:}"
  done
}
if ! timeout 60 "$PY" -c "import numpy, pytest, tqdm, yaml, pydantic, pydantic_settings" 2>/dev/null; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    echo "installing carried wheels into /tmp/tc_site: $(ls .whl)"
    # by name from the folder: pip takes each package's wheel for this Python (the folder may
    # carry binary wheels for several Python versions)
    timeout 180 "$PY" -m pip install -q --no-index --find-links .whl --no-compile --no-cache-dir --upgrade \
      --target /tmp/tc_site $(missing) || echo "pip install of .whl failed"
    export PYTHONPATH=/tmp/tc_site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "missing packages and no .whl/ folder to install from"
  fi
fi
timeout 60 "$PY" -c "
import importlib.metadata as m
for n in ('numpy', 'pytest', 'pytest-timeout', 'tqdm', 'pyyaml', 'pydantic', 'pydantic-settings', 'typing-extensions'):
    try: print(n, m.version(n))
    except m.PackageNotFoundError: print(n, 'MISSING')
"

# Run a module with the repository's package-dir mapping, without installing it.
SHIM=$(mktemp -d)/tc_run.py
cat >"$SHIM" <<'EOF'
import importlib.util, os, runpy, sys
ROOT = os.getcwd()
MAP = {"tiercache.backends": "backends", "tiercache.connector": "connector"}  # pyproject.toml

class _PackageDirs:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name not in MAP:
            return None
        d = os.path.join(ROOT, MAP[name])
        return importlib.util.spec_from_file_location(
            name, os.path.join(d, "__init__.py"), submodule_search_locations=[d])

sys.meta_path.insert(0, _PackageDirs)
sys.path.insert(0, ROOT)
module, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
EOF

timeout 60 "$PY" "$SHIM" tiercache.transfer.cuda_copier && echo "import check: tiercache.transfer.cuda_copier ok"
"$PY" -c "import pytest_timeout" 2>/dev/null && PER_TEST=(--timeout=60) || PER_TEST=()

step "tests/gpu"
timeout 240 "$PY" "$SHIM" pytest -q -rA tests/gpu -p no:cacheprovider "${PER_TEST[@]}" 2>&1 \
  | tee "$OUT/gpu_tests.log"
RC[tests]=$?

METHODS=${TC_CUDA_COPY:-auto,gather,driver_batch,per_run}
bench() {  # name, time limit, args...
  local name=$1 limit=$2; shift 2
  step "bench: $name"
  timeout "$limit" "$PY" "$SHIM" bench.host_tier --device "$BENCH_DEVICE" --shared-buffer --cuda-copy "$METHODS" \
    --ids scattered --repeat 3 --no-progress --out "host_tier_gpu_$name" "$@" 2>&1 | tee -a "$OUT/bench_cuda.log"
  RC[$name]=$?
}
rm -f bench/results/host_tier_gpu_*.json
# page sizes of the targets: scattered 64 KiB pages (>= 80% of one memcpy), >= 256 KiB (>= 90%)
bench page64k 120 --kv-heads 8 --head-dim 128 --kv-split --block-size 32 --sizes 4MiB,16MiB --total 1GiB
bench page256k 120 --kv-heads 8 --head-dim 128 --kv-split --block-size 128 --sizes 16MiB --total 1GiB
bench page2k 120 --sizes 256KiB,1MiB --total 256MiB   # a small model: 2 KiB pages, the hardest case
bench llama8b 120 --kv-heads 8 --head-dim 128 --kv-split --sizes 2MiB,16MiB --total 1GiB  # 32 KiB pages

step "bench: cuda_batched_copy (raw per-page vs gather, no tiercache)"
timeout 90 "$PY" "$SHIM" bench.cuda_batched_copy --out cuda_batched_copy_gpu 2>&1 | tee -a "$OUT/bench_cuda.log"
RC[raw]=$?

step "bench: cuda_overlap (compute idle with stores running)"
timeout 120 "$PY" "$SHIM" bench.cuda_overlap --cuda-copy "$METHODS" --no-progress --out cuda_overlap_gpu 2>&1 \
  | tee -a "$OUT/bench_cuda.log"
RC[overlap]=$?
cp bench/results/host_tier_gpu_*.json bench/results/cuda_*_gpu.json "$OUT/" 2>/dev/null
step "summary JSON (docs/data/cuda_*.json; draw it: python -m bench cuda_figures FILE --svg ...)"
timeout 60 "$PY" "$SHIM" bench.cuda_summary "$OUT" "$OUT/cuda_summary.json"
# the raw results in one archive (a device call brings back at most 8 files)
(cd "$OUT" && tar czf raw_results.tgz host_tier_gpu_*.json cuda_*_gpu.json 2>/dev/null && rm -f host_tier_gpu_*.json cuda_*_gpu.json)

step "summary"
ok=0
for k in tests page64k page256k page2k llama8b raw overlap; do echo "$k: exit ${RC[$k]}"; (( RC[$k] == 0 )) || ok=1; done
exit $ok
