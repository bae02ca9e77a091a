#!/usr/bin/env bash
# Runs the host backend and deferred-free tests under valgrind memcheck (AddressSanitizer needs
# a nightly compiler, which this toolchain does not have). Prints one line per binary and ends
# with "sanitize: N passed, M failed"; exits non-zero on any error valgrind reports.
set -uo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { apt-get update -qq && apt-get install -y -qq valgrind >/dev/null; }
cargo test --no-run --workspace >/dev/null 2>&1 || { echo "build failed"; exit 1; }
passed=0; failed=0
run() {
    local name=$1; shift
    local bin
    bin=$(ls -t target/debug/deps/"$name"-* 2>/dev/null | grep -v '\.d$' | head -1)
    [ -n "$bin" ] || { echo "sanitize: $name: binary not found"; failed=$((failed+1)); return; }
    local log=target/sanitize-$name.log
    if valgrind --tool=memcheck --error-exitcode=99 --leak-check=no \
        --suppressions=/dev/null -q "$bin" --test-threads=1 "$@" >"$log" 2>&1; then
        echo "sanitize: $name: 0 errors"
        passed=$((passed+1))
    else
        echo "sanitize: $name: errors (see $log)"
        grep -m5 -E "Invalid|uninitialised|ERROR SUMMARY" "$log"
        failed=$((failed+1))
    fi
}
mkdir -p target
run host_virtual_memory --skip read_only_view_faults_on_write
run accounting_model
run kv_sequence
run no_leaks
run deferred_free
run actor_death
run cross_provider_fence
echo "sanitize: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
