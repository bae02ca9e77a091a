#!/usr/bin/env bash
# Builds the CUDA test and bench binaries (release) and copies them, stripped, into DIR
# (default .gpu/bin) under stable names, for scripts/gpu-check.sh --prebuilt DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.gpu/bin}"
mkdir -p "$out"
export CARGO_TERM_COLOR=never
pick() { # cargo args... -> prints "name path" for each executable built
    local only_build=()
    if [[ "$1" == test || "$1" == bench ]]; then only_build=(--no-run); fi
    cargo "$@" "${only_build[@]}" --message-format=json |
        python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["name"], m["executable"])'
}
{
    pick test --release -p procmem --test cuda
    pick test --release -p procmem-actors --test cuda_provider
    pick test --release -p procmem-actors --test kv_cuda
    pick bench -p procmem --bench virtual_memory
    pick bench -p procmem --bench deferred_free
    pick bench -p procmem --bench kv_decode
    pick build --release -p procmem --example inference_server
} | while read -r name path; do
    cp "$path" "$out/$name"
    strip "$out/$name" 2>/dev/null || true
    echo "packed $out/$name ($(du -h "$out/$name" | cut -f1))"
done
