#!/usr/bin/env bash
# The checks that need a GPU, in one run: tests/gpu (and the CUDA test of tests/client/test_rng.py),
# then the CUDA rows of the emergency and checkpoint benchmarks. Run from the repository root on a
# machine with a CUDA device and torch; results and logs go to $OUT (default /tmp/gpu-checks).
#
#   EMERGENCY_SIZES=1,8 CHECKPOINT_SIZES=1,8 REPEATS=2 bash scripts/gpu-checks.sh
#
# Wheels in .whl/ (pyzmq, pydantic, xxhash, ... for a machine without an index) are installed first.
set -u
out=${OUT:-/tmp/gpu-checks}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/client:$PWD/daemon${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())'
    nproc; free -g | head -2; df -h /tmp
} > "$out/machine.txt" 2>&1
cat "$out/machine.txt"
python3 -m pytest -q -p no:cacheprovider tests/gpu tests/client/test_rng.py 2>&1 | tee "$out/tests.txt"
cd benchmarks || exit 1
timeout "${BENCH_TIMEOUT:-270}" python3 bench_emergency.py --device cuda --sizes "${EMERGENCY_SIZES:-1,8}" \
    --repeats "${REPEATS:-2}" --out "$out/emergency_cuda.json" 2>&1 | tee "$out/emergency.txt"
timeout "${BENCH_TIMEOUT:-270}" python3 bench_checkpoint.py --device cuda --sizes "${CHECKPOINT_SIZES:-1,8}" \
    --repeats "${REPEATS:-2}" --out "$out/checkpoint_cuda.json" 2>&1 | tee "$out/checkpoint.txt"
