#!/usr/bin/env bash
# The checks that need a GPU, in one run, most important first: tests/gpu (and the CUDA test of
# tests/client/test_rng.py); the side-by-side comparison with CUDA state (issue 31: durable and
# restore against torch.save, DCP and dd, the restore's floor with a pinned host-to-device copy);
# where a cold restore's time goes (bench_restore_phases.py); then the CUDA rows of the emergency and
# periodic-save benchmarks. Run from the repository root on a machine with a CUDA device and torch;
# results and logs go to $OUT (default /tmp/gpu-checks): a dozen files, so through a tool that brings
# back a few, point OUT elsewhere and tar it.
#
#   BUDGET=540 COMPARE_SIZES=1,8 COMPARE_ROUNDS=3 EMERGENCY_SIZES=1,8 CHECKPOINT_SIZES=1,8 REPEATS=2 \
#       bash scripts/gpu-checks.sh
#
# BUDGET (seconds) bounds the whole run: each step gets what is left of it, and a step cut short
# keeps what it wrote (the comparison writes its results after every round). At 8 GiB and above the
# comparison runs COMPARE_BIG_VARIANTS only. Wheels in .whl/ (pyzmq, pydantic, ... for a machine
# without a package index) are installed first.
set -u
out=${OUT:-/tmp/gpu-checks}
mkdir -p "$out"
began=$SECONDS
left() { echo $(( ${BUDGET:-1800} - (SECONDS - began) )); }
step() {  # step NAME MAX_SECONDS COMMAND...: runs COMMAND for at most MAX_SECONDS and what is left
    local name=$1 max=$2 limit
    shift 2
    limit=$(left)
    (( limit > max )) && limit=$max
    if (( limit < 20 )); then
        echo "== $name: skipped, $(left) s of the budget left" | tee -a "$out/steps.txt"
        return
    fi
    echo "== $name (at most $limit s)" | tee -a "$out/steps.txt"
    local t0=$SECONDS
    timeout "$limit" "$@"
    echo "== $name: exit $? after $((SECONDS - t0)) s" | tee -a "$out/steps.txt"
}
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
step tests "${TESTS_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider tests/gpu tests/client/test_rng.py \
    > "$out/tests.txt" 2>&1
tail -5 "$out/tests.txt"
cd benchmarks || exit 1
IFS=, read -ra compare_sizes <<< "${COMPARE_SIZES-1,8}"
for gib in "${compare_sizes[@]}"; do
    variants=torch_save,dcp,dcp_async,spotguard,spotguard_uncapped,no_save,dd
    [[ ${gib%%.*} -ge 8 ]] && variants=${COMPARE_BIG_VARIANTS:-torch_save,spotguard,spotguard_uncapped,dd}
    step "compare ${gib} GiB" "${COMPARE_TIMEOUT:-600}" python3 bench_checkpoint_compare.py --device cuda \
        --gib "$gib" --rounds "${COMPARE_ROUNDS:-3}" --variants "$variants" \
        --out "$out/compare_cuda_${gib}.json" > "$out/compare_${gib}.txt" 2>&1
    tail -14 "$out/compare_${gib}.txt"
done
step "restore phases" "${PHASES_TIMEOUT:-180}" python3 bench_restore_phases.py --device cuda --gib "${PHASES_GIB:-8}" \
    --out "$out/restore_phases_cuda.json" > "$out/restore_phases.txt" 2>&1
cat "$out/restore_phases.txt"
step emergency "${BENCH_TIMEOUT:-270}" python3 bench_emergency.py --device cuda --sizes "${EMERGENCY_SIZES:-1,8}" \
    --repeats "${REPEATS:-2}" --out "$out/emergency_cuda.json" > "$out/emergency.txt" 2>&1
tail -8 "$out/emergency.txt"
step checkpoint "${BENCH_TIMEOUT:-270}" python3 bench_checkpoint.py --device cuda --sizes "${CHECKPOINT_SIZES:-1,8}" \
    --repeats "${REPEATS:-2}" --out "$out/checkpoint_cuda.json" > "$out/checkpoint.txt" 2>&1
tail -8 "$out/checkpoint.txt"
cat "$out/steps.txt"
