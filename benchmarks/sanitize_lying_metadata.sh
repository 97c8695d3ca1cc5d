#!/usr/bin/env bash
# compute-sanitizer memcheck over tests/test_lying_metadata_gpu.py (lying cu_seqlens/seqused/max_seqlen must never
# access memory outside the tensors given).  GPU only; run from anywhere:
#
#     bash benchmarks/sanitize_lying_metadata.sh            # SANITIZE_TIMEOUT=540 by default (seconds)
#
# Every tensor is its own allocation (PYTORCH_NO_CUDA_MEMORY_CACHING=1, no guard rows around q/k/v), so memcheck
# sees any out-of-bounds read or write instead of a hit inside a pooled segment.  The debug-check tests are left
# out (-k "not debug": they raise before any launch).  API-call errors are not reported (--report-api-errors no):
# session 38's run (H100, cutlass-dsl 4.8.1) counted 34, every one CUDA_ERROR_INVALID_VALUE from cuGetProcAddress_v2
# inside cuda-python's driver bindings (a symbol lookup they handle), no memory error, 78 passed
# (benchmarks/results/sanitize_lying_metadata_h100_s38.txt); the flag was added after that run, and session 39's run
# with it (H200) reported 0 errors, 78 passed (benchmarks/results/sanitize_lying_metadata_h200_s39.txt).  Exit status: non-zero on any sanitizer error, any test
# failure, or the timeout (124).  The log is written to $SANITIZE_LOG (default: a temporary file).
set -u -o pipefail

cd "$(dirname "$0")/.."
TIMEOUT="${SANITIZE_TIMEOUT:-540}"
LOG="${SANITIZE_LOG:-$(mktemp -t sanitize_lying_metadata.XXXXXX.log)}"
PY="${PYTHON:-python}"

if ! command -v compute-sanitizer >/dev/null 2>&1; then
    echo "sanitize_lying_metadata: compute-sanitizer not found on PATH" >&2
    exit 2
fi

export PYTORCH_NO_CUDA_MEMORY_CACHING=1
export FA4_SM120_TEST_GUARD_ROWS=0
unset FA4_SM120_DEBUG_CHECKS

timeout --signal=TERM --kill-after=30 "$TIMEOUT" \
    compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 --print-limit 50 \
    "$PY" -m pytest -q -p no:cacheprovider tests/test_lying_metadata_gpu.py -m gpu -k "not debug" 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}

echo "----- summary (log: $LOG)"
summary=$(grep -E "ERROR SUMMARY" "$LOG" | tail -n 1)
pytest_line=$(grep -E "^[0-9]+ (passed|failed)|^(=+ )?[0-9]+ (passed|failed|error)|no tests ran" "$LOG" | tail -n 1)
echo "sanitizer: ${summary:-no ERROR SUMMARY line (the sanitizer did not finish)}"
echo "pytest:    ${pytest_line:-no pytest summary line}"

if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "sanitize_lying_metadata: timed out after ${TIMEOUT}s" >&2
    exit 124
fi
if [ -z "$summary" ]; then
    echo "sanitize_lying_metadata: no sanitizer summary (exit status $rc)" >&2
    [ "$rc" -ne 0 ] && exit "$rc" || exit 1
fi
if ! echo "$summary" | grep -qE "ERROR SUMMARY: 0 errors"; then
    echo "sanitize_lying_metadata: memcheck reported errors" >&2
    [ "$rc" -ne 0 ] && exit "$rc" || exit 1
fi
if [ "$rc" -ne 0 ]; then
    echo "sanitize_lying_metadata: pytest failed (exit status $rc)" >&2
fi
exit "$rc"
