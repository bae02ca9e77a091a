#!/usr/bin/env bash
# Builds llama.cpp's own server (`llama-server`) into target/llama.cpp/, the peer the `serving`
# bench runs beside procmem. Its source is the `vendor/llama.cpp` tree of the pinned,
# hash-checked llama-cpp-python sdist from PyPI (`pip download --require-hashes`); cmake and ninja come from PyPI too, into a virtual
# environment under target/. Built for the project's baseline: GGML_NATIVE=OFF, AVX2 + FMA +
# F16C on, AVX-512 and AMX off (a native build on a VM that advertises AVX-512/AMX crashed in its
# first decode). Prints the binary's path. Idempotent: a second run only prints the path.
set -euo pipefail
cd "$(dirname "$0")/.."
version=0.3.36 # as pinned, with its hash, in scripts/llama-requirements.txt
root=target/llama.cpp
bin="$root/build/bin/llama-server"
if [ -x "$bin" ]; then
    echo "$bin"
    exit 0
fi
mkdir -p "$root"
venv="$root/venv"
if [ ! -x "$venv/bin/cmake" ] || [ ! -x "$venv/bin/ninja" ]; then
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
        "cmake==3.31.6" "ninja==1.11.1.4"
fi
if [ ! -f "$root/src/CMakeLists.txt" ]; then
    rm -rf "$root/sdist" "$root/src"
    mkdir -p "$root/sdist"
    # The registry's own client, the hash checked by it (the sdist only: its build backend's
    # wheels are what pip reads its metadata with).
    "$venv/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps \
        --no-binary llama-cpp-python --require-hashes -r scripts/llama-requirements.txt \
        -d "$root/sdist"
    tarball="$root/sdist/llama_cpp_python-$version.tar.gz"
    tar -xzf "$tarball" -C "$root/sdist"
    mv "$root/sdist/llama_cpp_python-$version/vendor/llama.cpp" "$root/src"
fi
PATH="$PWD/$venv/bin:$PATH"
cmake -S "$root/src" -B "$root/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$root/build" --target llama-server -j "${JOBS:-2}" >&2
echo "$bin"
