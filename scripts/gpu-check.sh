#!/usr/bin/env bash
# Runs every CUDA test and the CUDA parts of the benchmarks, in one go, on a machine with an
# NVIDIA driver. Prints the driver's view first so the log says what it ran on.
#
#   scripts/gpu-check.sh                 build here with cargo, then run
#   scripts/gpu-check.sh --prebuilt DIR  run binaries packed by scripts/gpu-pack.sh (for a
#                                        GPU machine without a Rust toolchain)
#
# The benches' JSON reports go to $REPORTS_TARGET/reports (default target/reports).
# GPU_CHECK_DEADLINE=S bounds the whole run to S seconds (device time is lent by the minute):
# each step gets what is left, at most GPU_STEP_LIMIT seconds (default 150), and a step that
# would start with under 10 s left is reported as not run rather than cut short.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || echo "nvidia-smi unavailable"
export CARGO_TERM_COLOR=never
if [[ "${1:-}" == "--prebuilt" ]]; then
    bin="$(cd "${2:?usage: scripts/gpu-check.sh [--prebuilt DIR]}" && pwd)"
else
    scripts/gpu-pack.sh target/gpu-bin
    bin="$(pwd)/target/gpu-bin"
fi
# The benches write $CARGO_TARGET_DIR/reports/NAME.json.
export CARGO_TARGET_DIR="${REPORTS_TARGET:-$(pwd)/target}"
reports="$CARGO_TARGET_DIR/reports"
mkdir -p "$reports"
status=0
deadline="${GPU_CHECK_DEADLINE:-0}"
step_limit="${GPU_STEP_LIMIT:-150}"
run() {
    local name="$1"; shift
    local limit="$step_limit"
    if ((deadline > 0)); then
        local left=$((deadline - SECONDS))
        if ((left < 10)); then echo "== $name: NOT RUN (deadline) =="; status=1; return; fi
        ((left < limit)) && limit=$left
    fi
    echo "== $name (at most $limit s) =="
    local start=$SECONDS rc=0
    timeout --kill-after=5 "$limit" "$@" || rc=$?
    if ((rc == 0)); then echo "== $name: ok ($((SECONDS - start)) s) =="
    elif ((rc == 124 || rc == 137)); then
        echo "== $name: TIMED OUT after $((SECONDS - start)) s =="; status=1
    else echo "== $name: FAILED, exit $rc ($((SECONDS - start)) s) =="; status=1; fi
}
run "CUDA tests (mechanisms)" "$bin/cuda" --nocapture --test-threads=1
run "CUDA tests (execution provider)" "$bin/cuda_provider" --nocapture --test-threads=1
run "CUDA tests (KV store on VMM)" "$bin/kv_cuda" --nocapture --test-threads=1
# The CUDA decode kernels over VMM / preallocated / staging-copied KV (host part skipped).
run "kv_decode bench (cuda section only)" env KV_DECODE_CUDA_ONLY=1 "$bin/kv_decode" --bench
# The main job on the GPU: KV on CUDA VMM under a device budget, attention by the CUDA
# kernels, swaps to the host tier (its projections run on the host: a short run).
run "main job --device cuda (small)" "$bin/inference_server" --device cuda --budget 0.25x
run "main job --device cuda --model-size large" "$bin/inference_server" --device cuda \
    --model-size large --requests 12 --concurrency 6 --max-new-tokens 16 --budget 0.5x
# Prompts that share a whole 2 MiB block of the large shape (even requests share their first
# 517 tokens; a block holds 512): evicted from the device, it goes to the host tier.
run "main job --device cuda --model-size large --prefix-host-bytes 512MiB" \
    "$bin/inference_server" --device cuda --model-size large --prompt-len 690 --requests 6 \
    --concurrency 3 --max-new-tokens 8 --budget 0.5x --prefix-host-bytes 512MiB
# These two have run on an H200 before: last, so a short deadline spends itself on what has not.
run "virtual_memory bench (host part, then the cuda section)" "$bin/virtual_memory" --bench
run "deferred_free bench (CPU provider, then the cuda section)" "$bin/deferred_free" --bench
grep -h -A8 '"cuda"' "$reports"/virtual_memory.json "$reports"/deferred_free.json || true
grep -h -A60 '"cuda"' "$reports"/kv_decode.json || true
echo "== gpu-check done: $([[ $status == 0 ]] && echo all passed || echo FAILURES) =="
exit $status
