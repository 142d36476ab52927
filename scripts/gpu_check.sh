#!/usr/bin/env bash
# GPU check, meant for a machine with one CUDA GPU and a 10-minute call: installs piecewise (torch
# from the machine if present, else the pinned requirements), then runs each phase under its own
# wall limit so a slow one leaves the rest their time (seconds, overridable by the variables named;
# the defaults sum to 9 minutes, sized from the 2026-12-04 H200 run, where 4 minutes for the whole
# generation benchmark was not enough):
#   1. the GPU test tier (TESTS_S, 2026-12-04: 98 s): generation on CUDA first (both paths, Inductor +
#      CUDA graphs), then graph capture;
#   2. the generation benchmark on CUDA (BENCH_GEN_S): SmolLM2-shaped, bf16, batch 1 and 8, in this
#      order: transformers' static-cache auto-compile, piecewise generate(), piecewise engine, HF
#      eager (a cold process each; warm ones for the compiled three while time is left);
#   3. the decode-step benchmark, one process on cold caches (BENCH_DECODE_S): eager, torch.compile
#      default and reduce-overhead, piecewise graphs, full graphs and Inductor partitions (the first
#      call of each is its cold start; the step figures are steady state);
#   4. the per-piece host-cost table (BENCH_OVERHEAD_S).
# PHASES (default "tests generation decode overhead") names the phases to run, in that order, and
# GEN_SYSTEMS the generation systems (comma-separated), for a
# lease too short for all four. Output under $OUT if set, at most 8 files: gpu_check.log (everything), gpu_tests.log,
# generation.{md,json}, gpu_bench.json, gpu_overhead.json.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/piecewise-gpu-check}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
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
$PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), 'transformers', transformers.__version__)"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 || true
set +e
phase() { echo "== $1 ($(date -u +%T))"; }
PHASES="${PHASES:-tests generation decode overhead}"
want() { [[ " $PHASES " == *" $1 "* ]]; }
rc=0
if want tests; then
phase "GPU tests"
timeout ${TESTS_S:-130} $PY -m pytest -q -m gpu tests/models/test_gpu_generate.py tests/graphs/test_gpu.py \
  -p no:cacheprovider --show-capture=no --durations=8 2>&1 | tee "$OUT/gpu_tests.log"
rc=${PIPESTATUS[0]}
fi
if want generation; then
phase "generation benchmark"
timeout ${BENCH_GEN_S:-270} $PY -m piecewise.bench.generation --device cuda --rounds 1 --paired-rounds 0 --timeout ${BENCH_GEN_WORKER_S:-150} \
  --systems ${GEN_SYSTEMS:-hf_compile_static,pw_generate,pw_engine,hf_eager} --out "$OUT"
fi
if want decode; then
phase "decode-step benchmark"
timeout ${BENCH_DECODE_S:-100} $PY -m piecewise.bench.gpu_decode --steps 50 --json "$OUT/gpu_bench.json"
fi
# Host cost per piece against its floor (16 layers whose splitting op only clones; #15 item 1).
if want overhead; then
phase "host cost per piece"
timeout ${BENCH_OVERHEAD_S:-25} $PY -m piecewise.bench.overhead --json "$OUT/gpu_overhead.json"
fi
if want tests; then phase "done, tests exit $rc"; else phase "done (tests not run)"; fi
exec >&- 2>&-; wait  # let tee write the log's last lines before the script ends
exit $rc
