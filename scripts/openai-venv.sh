#!/usr/bin/env bash
# A virtual environment under target/ with the official `openai` Python client, pinned by
# scripts/openai-requirements.txt: the real client tests/http_api.rs runs against the main
# job's --listen server. Prints the environment's python. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=target/openai-venv
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import openai" 2>/dev/null; then
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
        -r scripts/openai-requirements.txt
fi
echo "$venv/bin/python"
