#!/usr/bin/env bash
# GPU check, meant for a machine with one CUDA GPU and ~10 minutes: installs piecewise (torch from
# the machine if present, else the pinned requirements), runs the GPU test tier, then a decode-step
# benchmark (eager, torch.compile default and reduce-overhead, piecewise graphs, full graphs and Inductor
# partitions), run twice in new processes: cold caches, then warm, then the per-piece host-cost table
# (piecewise.bench.overhead). Output under $OUT if set.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/piecewise-gpu-check}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PIECEWISE_CACHE_DIR="${PIECEWISE_CACHE_DIR:-/tmp/piecewise-gpu-cache}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/piecewise-gpu-inductor}"
PY=python3
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "no CUDA-enabled torch on this machine's python3; installing requirements into .venv-gpu"
  $PY -m venv .venv-gpu && PY=.venv-gpu/bin/python
  $PY -m pip install -q -r requirements.txt
fi
$PY -m pip install -q --no-deps --no-build-isolation -e . 2>/dev/null || $PY -m pip install -q --no-deps -e .
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tee -a "$OUT/env.txt" || true
set +e
timeout ${TESTS_S:-240} $PY -m pytest -q -m gpu tests/graphs/test_gpu.py -p no:cacheprovider --durations=5 2>&1 | tee "$OUT/gpu_tests.log"
rc=${PIPESTATUS[0]}
# Wall limits per phase keep the whole check inside a 10-minute lease (16-core H200 machine).
timeout ${BENCH_COLD_S:-210} $PY -m piecewise.bench.gpu_decode --json "$OUT/gpu_bench_cold.json" 2>&1 | tee "$OUT/gpu_bench_cold.md"
timeout ${BENCH_WARM_S:-90} $PY -m piecewise.bench.gpu_decode --json "$OUT/gpu_bench_warm.json" 2>&1 | tee "$OUT/gpu_bench_warm.md"
# Host cost per piece against its floor (16 layers whose splitting op only clones; #15 item 1).
timeout ${BENCH_OVERHEAD_S:-60} $PY -m piecewise.bench.overhead --json "$OUT/gpu_overhead.json" 2>&1 | tee "$OUT/gpu_overhead.md"
exit $rc
