#!/usr/bin/env bash
# Runs every CUDA test and the CUDA parts of the benchmarks, in one go, on a machine with an
# NVIDIA driver. Prints the driver's view first so the log says what it ran on.
#
#   scripts/gpu-check.sh                 build here with cargo, then run
#   scripts/gpu-check.sh --prebuilt DIR  run binaries packed by scripts/gpu-pack.sh (for a
#                                        GPU machine without a Rust toolchain)
#
# The benches' JSON reports go to $REPORTS_TARGET/reports (default target/reports).
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
run() {
    local name="$1"; shift
    echo "== $name =="
    local start=$SECONDS
    if "$@"; then echo "== $name: ok ($((SECONDS - start)) s) =="
    else echo "== $name: FAILED ($((SECONDS - start)) s) =="; status=1; fi
}
run "CUDA tests (mechanisms)" "$bin/cuda" --nocapture --test-threads=1
run "CUDA tests (execution provider)" "$bin/cuda_provider" --nocapture --test-threads=1
run "CUDA tests (KV store on VMM)" "$bin/kv_cuda" --nocapture --test-threads=1
run "virtual_memory bench (host part, then the cuda section)" "$bin/virtual_memory" --bench
run "deferred_free bench (CPU provider, then the cuda section)" "$bin/deferred_free" --bench
# The CUDA decode kernels over VMM / preallocated / staging-copied KV (host part skipped).
run "kv_decode bench (cuda section only)" env KV_DECODE_CUDA_ONLY=1 "$bin/kv_decode" --bench
# The main job on the GPU: KV on CUDA VMM under a device budget, attention by the CUDA
# kernels, swaps to the host tier (its projections run on the host: a short run).
run "main job --device cuda (small)" "$bin/inference_server" --device cuda --budget 0.25x
run "main job --device cuda --model-size large" "$bin/inference_server" --device cuda \
    --model-size large --requests 12 --concurrency 6 --max-new-tokens 16 --budget 0.5x
grep -h -A8 '"cuda"' "$reports"/virtual_memory.json "$reports"/deferred_free.json || true
grep -h -A60 '"cuda"' "$reports"/kv_decode.json || true
echo "== gpu-check done: $([[ $status == 0 ]] && echo all passed || echo FAILURES) =="
exit $status
