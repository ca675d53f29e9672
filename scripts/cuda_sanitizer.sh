#!/usr/bin/env bash
# Run the CUDA test suite under compute-sanitizer, one tool at a time, and print a summary per tool.
#
#   bash scripts/cuda_sanitizer.sh [TOOL ...] [-- PYTEST ARGS]
#
# TOOL is memcheck, racecheck, synccheck or initcheck (default: memcheck racecheck). The pytest
# arguments default to the whole CUDA suite (`-m cuda tests/cuda tests/test_fuzz.py`). Each tool's
# full log goes to $LOGDIR/sanitizer-TOOL.log (LOGDIR defaults to the current directory). Exit status
# 1 when a tool reported an error or a test failed.
set -u
tools=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do tools+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#tools[@]} -eq 0 ] && tools=(memcheck racecheck)
pytest_args=("$@")
[ ${#pytest_args[@]} -eq 0 ] && pytest_args=(-m cuda tests/cuda tests/test_fuzz.py)

sanitizer="${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}"
logdir="${LOGDIR:-.}"
status=0
for tool in "${tools[@]}"; do
    log="$logdir/sanitizer-$tool.log"
    start=$(date +%s)
    "$sanitizer" --tool "$tool" --target-processes all --error-exitcode 99 --print-limit 50 \
        python3 -m pytest -q -p no:cacheprovider "${pytest_args[@]}" >"$log" 2>&1
    rc=$?
    summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|SYNCCHECK SUMMARY|INITCHECK SUMMARY" "$log" | sort | uniq -c)
    tests=$(grep -E "^[0-9]+ (passed|failed)|passed|failed" "$log" | tail -1)
    echo "$tool: exit $rc in $(( $(date +%s) - start )) s; tests: ${tests:-?}"
    echo "${summary:-  (no summary line: see $log)}"
    [ $rc -ne 0 ] && status=1
done
exit $status
