#!/usr/bin/env bash
# Run the CUDA tests under compute-sanitizer and print a summary per tool and test group.
#
#   bash scripts/cuda_sanitizer.sh [-j JOBS] [TOOL ...] [-- TEST FILE ...]
#
# TOOL: memcheck, racecheck, synccheck or initcheck (default: memcheck racecheck). TEST FILEs default
# to every test file with CUDA tests (their `-m "cuda and not slow"` tests). Under a sanitizer the suite
# runs about ten times slower, so -j JOBS splits the files into JOBS groups run side by side (every
# tool and group at once; the GPU is shared). Logs: $LOGDIR/sanitizer-TOOL-gK.log (LOGDIR defaults to
# the current directory). SANITIZER_OPTIONS adds options to every compute-sanitizer call. Exit status 1
# when a tool reported an error or a test failed.
set -u
jobs=1
tools=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    case "$1" in
        -j) jobs="$2"; shift 2 ;;
        *) tools+=("$1"); shift ;;
    esac
done
[ "${1:-}" = "--" ] && shift
[ ${#tools[@]} -eq 0 ] && tools=(memcheck racecheck)
files=("$@")
[ ${#files[@]} -eq 0 ] && mapfile -t files < <(grep -l "mark.cuda" tests/test_*.py tests/cuda/test_*.py)

sanitizer="${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}"
logdir="${LOGDIR:-.}"
mkdir -p "$logdir"

# Deal the files into groups, largest first, each to the group with the fewest tests so far.
declare -a group_files group_load
for ((g = 0; g < jobs; g++)); do group_files[g]=""; group_load[g]=0; done
while read -r count file; do
    best=0
    for ((g = 1; g < jobs; g++)); do [ "${group_load[g]}" -lt "${group_load[best]}" ] && best=$g; done
    group_files[best]+=" $file"
    group_load[best]=$(( group_load[best] + count ))
done < <(python3 -m pytest --collect-only -q -p no:cacheprovider -m "cuda and not slow" "${files[@]}" 2>/dev/null \
          | grep "::" | cut -d: -f1 | sort | uniq -c | sort -rn)

run_one() {  # tool group files...
    local tool=$1 group=$2; shift 2
    local log="$logdir/sanitizer-$tool-g$group.log" start rc
    start=$(date +%s)
    # API errors are left out: cuda-python probes driver entry points this driver lacks (cuGetProcAddress
    # answers CUDA_ERROR_INVALID_VALUE by design); gradgen checks the result of every call it makes.
    # Host backtraces are off (--show-backtrace device): the sanitizer captures the Python frames of every
    # launch for them and keeps them, so the arrays they hold outlive each run and the executor never
    # sees a lifetime to plan its memory from (the planned path would go unchecked).
    # shellcheck disable=SC2086  # SANITIZER_OPTIONS: extra options, split on blanks
    "$sanitizer" --tool "$tool" --report-api-errors no --target-processes all --error-exitcode 99 --print-limit 50 \
        --show-backtrace device \
        ${SANITIZER_OPTIONS:-} \
        python3 -m pytest -q -rfE -p no:cacheprovider -m "cuda and not slow" "$@" >"$log" 2>&1
    rc=$?
    echo "$tool g$group: exit $rc in $(( $(date +%s) - start )) s; $(grep -E "[0-9]+ (passed|failed|skipped|error)" "$log" | grep -v "=========" | tail -1)"
    grep -E "^(FAILED|ERROR) " "$log" | sed 's/^/    /'
    grep -E "(ERROR|RACECHECK|SYNCCHECK|INITCHECK) SUMMARY" "$log" | sort | uniq -c | sed 's/^/    /'
    return $rc
}

pids=()
for tool in "${tools[@]}"; do
    for ((g = 0; g < jobs; g++)); do
        [ -z "${group_files[g]}" ] && continue
        # shellcheck disable=SC2086
        run_one "$tool" "$g" ${group_files[g]} &
        pids+=($!)
    done
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
exit $status
