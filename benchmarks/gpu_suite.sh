#!/usr/bin/env bash
# The GPU suite in one command, for whoever gets an H100/H200 for a few minutes: the GPU tests, then every table of
# the GPU fast-path issue (benchmarks/gpu_suite.py; random weights at real shapes built on the machine, nothing
# downloaded). Tables go to the terminal; logs, JSON and two PNGs to $OUT (default /tmp/gpu_suite).
#   bash benchmarks/gpu_suite.sh                      # tests + all sections
#   bash benchmarks/gpu_suite.sh --sections batch1    # extra arguments go to gpu_suite.py
#   GPU_TESTS="windowed or quantized" GPU_TEST_TIMEOUT=150 bash benchmarks/gpu_suite.sh --sections kvquant
#                                                     # a subset of the GPU tests (pytest -k), then one section
# Without CUDA it says so in one line and exits 0.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_suite: no CUDA GPU here (torch.cuda.is_available() is False): nothing to measure"
  exit 0
fi
OUT=${OUT:-/tmp/gpu_suite}
mkdir -p "$OUT"
export OUT PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee "$OUT/gpu.txt"
start=$(date +%s)
echo "== GPU tests (tests/test_triton_kernels.py on CUDA: kernels vs float64, CUDA graphs, engine vs CPU reference)"
timeout "${GPU_TEST_TIMEOUT:-240}" "$PY" -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py \
  ${GPU_TESTS:+-k "$GPU_TESTS"} > "$OUT/gpu_tests.log" 2>&1
echo "tests: exit $? in $(( $(date +%s) - start )) s"; tail -n 25 "$OUT/gpu_tests.log"
echo "== suite"
"$PY" benchmarks/gpu_suite.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_suite.log"
echo "gpu_suite.sh: done in $(( $(date +%s) - start )) s"
