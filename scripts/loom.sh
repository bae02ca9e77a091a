#!/usr/bin/env bash
# Model-checks the fence timeline (the atomics and condition variable that every host wait
# and deferred free relies on) with loom, exploring every interleaving of its model tests.
# Builds in its own target directory: the cfg changes every crate's flags.
set -euo pipefail
cd "$(dirname "$0")/.."
RUSTFLAGS="${RUSTFLAGS:-} --cfg procmem_loom" CARGO_TARGET_DIR=target/loom \
    cargo test --release --lib loom_ -- --test-threads=1 "$@"
