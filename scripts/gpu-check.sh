#!/usr/bin/env bash
# Builds and runs every CUDA test and the CUDA part of the benchmarks, in one go, on a machine
# with an NVIDIA driver. Prints the driver's view first so the log says what it ran on.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || echo "nvidia-smi unavailable"
export CARGO_TERM_COLOR=never
cargo build --release --workspace --all-targets
echo "== CUDA tests (mechanisms) =="
cargo test --release --test cuda -- --nocapture --test-threads=1
echo "== CUDA tests (execution provider) =="
cargo test --release -p procmem-actors --test cuda_provider -- --nocapture --test-threads=1
echo "== virtual_memory bench (its \"cuda\" section is the CUDA part) =="
cargo bench --bench virtual_memory
echo "== gpu-check done =="
