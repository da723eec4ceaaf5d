#!/usr/bin/env bash
# The test command (`make test`, which .ci/run calls): set-up, lint, the unit tests and the end-to-end
# tests, each phase timed; each test phase prints pytest's 30 slowest. Every phase runs whatever an
# earlier one gave (one failure must not hide the rest, as pytest has no -x here); the exit status is 1
# when any failed. The phase times close the output, with the CPU they ran on.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
# One pytest-xdist worker per core (at most 4: each end-to-end worker peaks near 4 GB), each pinned to
# its core (tests/conftest.py): the suite alone kept ~1 of 2 cores busy (imports, start-ups, Snakemake).
WORKERS=${TEST_WORKERS:-$(n=$(nproc); echo $((n > 4 ? 4 : n)))}
PYTEST=("$VENV/bin/pytest" -q -ra --durations=30 -n "$WORKERS" --dist loadgroup --no-loadscope-reorder)
summary=()
status=0

phase() {
    local name=$1 start=$SECONDS rc
    shift
    echo "==> $name: $*"
    "$@"
    rc=$?
    summary+=("$(printf '%-8s %5d s  exit %d' "$name" $((SECONDS - start)) "$rc")")
    [ "$rc" -eq 0 ] || status=1
    return "$rc"
}

phase set-up make --no-print-directory setup || { printf '%s\n' "${summary[@]}"; exit 1; }
phase lint make --no-print-directory lint
phase unit "${PYTEST[@]}" tests/unit
phase e2e "${PYTEST[@]}" tests/e2e

echo "==> phases on $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ //') ($(nproc) cores, $WORKERS test workers)"
printf '%s\n' "${summary[@]}"
exit "$status"
