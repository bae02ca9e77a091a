#!/usr/bin/env bash
# Runs every reliability figure and ends with one table. The fault points are compiled in for
# the workspace's tests (the `fault-injection` feature, through the root's dev-dependency).
#   PROCMEM_SEEDS  seeds of the interleaving test (default here 200; `cargo test` runs 12)
set -uo pipefail
cd "$(dirname "$0")/.."
log=$(mktemp)
export PROCMEM_SEEDS="${PROCMEM_SEEDS:-200}"
# The HTTP front door's rows (http_idle_flood, http_slowloris, http_stalled_bodies,
# chat_injection) come from tests/http_front.rs, and hostile_disk_tier (a FIFO, a 2 GB file, the
# index linked to /dev/zero, a flipped byte, a FIFO named LOCK, blocks/ linked elsewhere, a full
# tmpfs under the real server) from
# tests/hostile_disk_tier.rs, like every other FIGURE line.
echo "== tests with figures (fault points, actor death, interleavings, stress, bad input, HTTP) =="
cargo test --workspace --no-fail-fast -- --test-threads=2 2>&1 | tee "$log" |
    grep -oE "FIGURE [a-z0-9_]+ [0-9]+/[0-9]+|^interleavings:.*|^stress:.*|^governor_restart:.*|^model_check:.*|^model_check_credit:.*|^kv_progress:.*|^node_[a-z0-9]+:.*|^hostile_frames:.*|^cluster_view:.*|test result: FAILED.*"
tests_rc=${PIPESTATUS[0]}
# A test's stderr can land in the middle of the harness's own line: take the figures from
# anywhere on a line.
figures=$(grep -oE "FIGURE [a-z0-9_]+ [0-9]+/[0-9]+" "$log")
echo "== loom (fence timeline) =="
scripts/loom.sh >"$log.loom" 2>&1
loom_rc=$?
cat "$log.loom" >>"$log"
loom=$(grep -E "^test result" "$log.loom")
echo "${loom:-loom: build or run FAILED (exit $loom_rc)}"
echo "== sanitizers =="
scripts/sanitize.sh | tee -a "$log" | tail -1
sanitize_rc=${PIPESTATUS[0]}

# Security: each property has its own test; the figure counts those that passed.
security=(
    grants_and_leases_cannot_be_forged_shared_or_replayed # another holder's, replayed, forged
    read_only_view_faults_on_write                        # host: a read-only sharer's write faults
    shared_prefixes_cost_only_the_unshared_part_and_copy_on_write_isolates # KV: no write into a shared block
    the_wrong_context_can_never_free_a_buffer             # a provider cannot free another's buffer
    the_metrics_endpoint_listens_nowhere_unless_told_and_only_where_told
)
sec_pass=0
for t in "${security[@]}"; do
    # Ran ("test NAME ... ", its own output may follow on the line), was not ignored, and is
    # not listed as failed.
    if grep -qE "^test (.*::)?$t \.\.\. " "$log" &&
        ! grep -qE "^test (.*::)?$t \.\.\. (FAILED|ignored)|^    (.*::)?$t\$" "$log"; then
        sec_pass=$((sec_pass + 1))
    fi
done
# Every row the table must have: one missing (a test that did not run, or printed where the
# harness kept it) or short (fewer passed than tried) fails the run, named. A case a machine
# cannot run leaves its row short too (hostile_disk_tier's full disk needs `unshare -rm`: 6/7
# where it is refused), and the run fails: the table then does not say that all of it held.
expected=(
    actor_death_governor actor_death_kv_store actor_death_residency actor_death_cpu_provider
    actor_death_deferred_free_0 actor_death_deferred_free_1 cross_provider_fence
    fault_points_grow fault_points_evict_and_free governor_restart seeded_interleavings
    stress_64_holders kv_progress_requests_finished node_budget node_guarantee node_sigstop
    node_hot_prefix node_kill9 node_restart hostile_frames node_spoof cluster_view
    node_pid_namespace node_session_watch node_moving_bursts node_busy_neighbour
    node_follows_machine node_alone http_idle_flood http_slowloris http_stalled_bodies slow_readers
    chat_injection idle_sleep hostile_disk_tier hostile_gguf hostile_gguf_loader
    bad_input_cli bad_input_manager bad_input_memory_api model_check_credit model_check_scopes
)
rows_bad=()
for row in "${expected[@]}"; do
    line=$(echo "$figures" | grep -E "^FIGURE $row [0-9]+/[0-9]+$" | tail -1)
    if [ -z "$line" ]; then
        rows_bad+=("$row (missing)")
    else
        read -r _ _ ratio <<<"$line"
        if [ "${ratio%/*}" != "${ratio#*/}" ]; then
            rows_bad+=("$row ($ratio)")
        fi
    fi
done
echo
printf '%-34s %s\n' "figure" "passed/total"
echo "$figures" | grep -v "^FIGURE bad_input\|^FIGURE model_check" | awk '{printf "%-34s %s\n", $2, $3}'
# The model checker's row carries the states it explored and the properties that held.
grep -oE "^model_check: .*every fix in.*" "$log" | sed -E 's/^model_check: /model_check                        /'
grep -oE "^model_check_credit: .*every fix in.*" "$log" | sed -E 's/^model_check_credit: /model_check_credit                 /'
echo "$figures" | grep -E "^FIGURE bad_input" | awk '{split($3, a, "/"); p += a[1]; t += a[2]} END {printf "%-34s %d/%d\n", "bad-input classes (all APIs + CLI)", p, t}'
printf '%-34s %d/%d\n' "security properties" "$sec_pass" "${#security[@]}"
if [ -n "$loom" ]; then
    echo "$loom" | awk '{printf "%-34s %s/%s\n", "loom models (fence timeline)", $4, $4 + $6}'
else
    printf '%-34s %s\n' "loom models (fence timeline)" "FAILED to build or run"
fi
grep -E "^sanitize: [0-9]+ passed" "$log" | awk '{printf "%-34s %s/%s\n", "sanitizer (valgrind) binaries", $2, $2+$4}'
for bad in "${rows_bad[@]}"; do
    echo "row FAILED: $bad"
done
if [ "$tests_rc" -ne 0 ] || grep -q "test result: FAILED" "$log" || [ "$sec_pass" -ne "${#security[@]}" ] ||
    [ "$loom_rc" -ne 0 ] || [ "$sanitize_rc" -ne 0 ] || [ ${#rows_bad[@]} -ne 0 ]; then
    echo "some tests FAILED"; exit 1
fi
