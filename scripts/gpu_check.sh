#!/usr/bin/env bash
# GPU check, meant for a machine with one CUDA GPU and ~10 minutes: installs piecewise (torch from
# the machine if present, else the pinned requirements), runs the GPU test tier, then a decode-step
# benchmark: eager vs piecewise graphs vs full graphs, with speedup ratios. Output under $OUT if set.
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
# piecewise is developed against torch 2.13 (requirements.txt); an older torch on the machine may
# lack standalone_compile(aot=True) used by the inductor adaptor: the eager-adaptor tests still run.
$PY -c "import torch, sys; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); print('note: torch older than 2.13; inductor-adaptor results may fail for that reason') if v < (2, 13) else None"
set +e
timeout 420 $PY -m pytest -q -m gpu tests/graphs/test_gpu.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
rc=${PIPESTATUS[0]}
set -e
timeout 240 $PY -m piecewise.bench.gpu_decode 2>&1 | tee "$OUT/gpu_bench.md"
exit $rc
