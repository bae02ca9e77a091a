#!/usr/bin/env bash
# Runs every reliability figure and ends with one table. The fault points are compiled in for
# the workspace's tests (the `fault-injection` feature, through the root's dev-dependency).
set -uo pipefail
cd "$(dirname "$0")/.."
log=$(mktemp)
echo "== tests with figures (fault points, actor death, stress) =="
cargo test --workspace -- --test-threads=2 2>&1 | tee "$log" | grep -E "^FIGURE|test result: FAILED" || true
echo "== seeded interleavings (ledger model, accounting model) =="
grep -E "ledger_matches_the_reference_model|believed_committed_bytes_equal_the_kernels" "$log" | head -2
echo "== sanitizers =="
scripts/sanitize.sh | tee -a "$log" | tail -1
echo
printf '%-34s %s\n' "figure" "passed/total"
grep -E "^FIGURE" "$log" | awk '{printf "%-34s %s\n", $2, $3}'
grep -E "^FIGURE bad_input" "$log" | awk '{split($3, a, "/"); p += a[1]; t += a[2]} END {printf "%-34s %d/%d\n", "bad-input classes (all APIs + CLI)", p, t}'
grep -E "^sanitize: [0-9]+ passed" "$log" | awk '{printf "%-34s %s/%s\n", "sanitizer (valgrind) binaries", $2, $2+$4}'
if grep -q "test result: FAILED" "$log"; then echo "some tests FAILED"; exit 1; fi
