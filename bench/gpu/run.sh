#!/usr/bin/env bash
# One GPU lease's proof of the GPU path (issue 22), at most about 8 minutes on one H100/H200:
#   env, CUDA kernel tests, PEFT parity in fp32 and bf16, the kernel sweep, the engine benchmark, then a verdict
#   in $OUT/summary.json and $OUT/summary.md. Each stage has its own time limit, and a failing stage does not stop
#   the others; the exit code is 0 only when every stage passed and every target was met.
#
#   bash bench/gpu/run.sh            # on the GPU machine (device run with carry: [".whl"])
#   bash bench/gpu/run.sh --dry-run  # here, on CPU: the same stages at tiny sizes, Triton interpreted
#
# $OUT (default: a new temp dir) receives at most 7 files: summary.json, summary.md, run.log (every stage's
# output), kernel_tests.xml, parity_fp32.json, parity_bf16.json, engine.json (the device tool returns 8 at most).
set -uo pipefail
cd "$(dirname "$0")/../.."

DRY_RUN=0
[[ ${1:-} == --dry-run ]] && DRY_RUN=1
OUT=${OUT:-$(mktemp -d -t loraplex-gpu-out-XXXX)}
mkdir -p "$OUT"
WORK=$(mktemp -d -t loraplex-gpu-work-XXXX)  # stage logs and bookkeeping that need not come back
trap 'rm -rf "$WORK"' EXIT
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# What tests/conftest.py would set; the kernel tests run without it (--noconftest, below).
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
: >"$OUT/run.log"

say() { echo "$*" | tee -a "$OUT/run.log"; }

# run_stage NAME SECONDS COMMAND...: run with a time limit, output to the terminal, run.log and WORK/NAME.log;
# record "name rc seconds" (rc 124: out of time) for the summary.
run_stage() {
    local name=$1 limit=$2 start rc
    shift 2
    say "=== [$name] (limit ${limit}s) $*"
    start=$(date +%s%N)
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$WORK/$name.log" | tee -a "$OUT/run.log"
    rc=${PIPESTATUS[0]}
    local ms=$((($(date +%s%N) - start) / 1000000))
    printf '%s\t%s\t%d.%03d\n' "$name" "$rc" $((ms / 1000)) $((ms % 1000)) >>"$WORK/stages.tsv"
    say "=== [$name] exit $rc after $((ms / 1000))s"
}

if ((DRY_RUN)); then
    # The interpreter must be chosen before triton is first imported, in every process.
    export TRITON_INTERPRET=1
    TINY=(--tiny)
    KERNEL_TESTS=(tests/unit/kernels -k "expand_alone or small_batch or test_dispatch or test_configs or prefill")
    KERNEL_BENCH=(--interpret-smoke)
    SUMMARY_FLAGS=(--dry-run)
else
    TINY=()
    KERNEL_TESTS=(tests/unit/kernels)
    # Triton compiles each kernel variant on the CPU: spread the tests over 8 workers when pytest-xdist is there.
    if "$PYTHON" -c "import xdist" 2>/dev/null; then KERNEL_TESTS+=(-n 8); fi
    KERNEL_BENCH=(--quick)
    SUMMARY_FLAGS=()
fi

# (a) Wheels the image lacks (bench/gpu/wheels.sh), carried in .whl/. Not in a dry run: the venv has them all.
if ((!DRY_RUN)) && compgen -G ".whl/*.whl" >/dev/null; then
    say "=== installing carried wheels: $(ls .whl)"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl 2>&1 | tee -a "$OUT/run.log"
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi

# (b) The machine and the versions that matter, also kept for the summary.
run_stage env 30 "$PYTHON" bench/gpu/env_report.py "$WORK/env.json"

# (c) Kernel tests. tests/conftest.py imports the API's test services (sqlalchemy, redis, ...), which the image
# lacks, and nothing in tests/unit/kernels needs its fixtures: --noconftest.
run_stage kernel_tests 100 "$PYTHON" -m pytest --noconftest -p no:cacheprovider -q "${KERNEL_TESTS[@]}" \
    --junitxml="$OUT/kernel_tests.xml"

# (d) Our greedy tokens against PEFT's: fp32 must match exactly; bf16 is reported.
run_stage parity_fp32 60 "$PYTHON" bench/gpu/parity.py --dtype fp32 "${TINY[@]}" --json "$OUT/parity_fp32.json"
run_stage parity_bf16 60 "$PYTHON" bench/gpu/parity.py --dtype bf16 "${TINY[@]}" --json "$OUT/parity_bf16.json"

# (e) The kernel sweep against torch peers (its SUMMARY line carries the verdict the summary reads).
run_stage kernel_bench 60 "$PYTHON" bench/kernels_gpu.py "${KERNEL_BENCH[@]}"

# (f) The engine against PEFT, with and without graphs and adapters.
run_stage engine 180 "$PYTHON" bench/engine_gpu.py "${TINY[@]}" --json "$OUT/engine.json"

# (g) The verdict.
touch "$WORK/kernel_bench.log" "$WORK/env.json"
"$PYTHON" bench/gpu/summary.py --out "$OUT" --stages "$WORK/stages.tsv" --env "$WORK/env.json" \
    --kernels-log "$WORK/kernel_bench.log" "${SUMMARY_FLAGS[@]}" 2>&1 | tee -a "$OUT/run.log"
rc=${PIPESTATUS[0]}
say "results in $OUT"
exit "$rc"
