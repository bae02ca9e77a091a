#!/usr/bin/env python3
"""Compiles kernels/decode.cu to kernels/decode.ptx with NVRTC (through ctypes).

    scripts/gen-ptx.py --install   # pip-installs the pinned NVRTC into target/nvrtc
    scripts/gen-ptx.py             # regenerates kernels/decode.ptx
    scripts/gen-ptx.py --check     # exit 1 if the checked-in PTX differs from a fresh build

NVRTC is found in $PROCMEM_NVRTC_DIR or target/nvrtc (a `pip install --target` folder).
Exit status 3 means NVRTC is not installed (the caller may skip).
"""
import ctypes
import glob
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, "kernels", "decode.cu")
PTX = os.path.join(ROOT, "kernels", "decode.ptx")
# PTX for compute capability 8.0 runs on every later GPU (the driver compiles it for the one
# it finds): A100, H100/H200, L4, and newer.
OPTIONS = [b"--gpu-architecture=compute_80", b"--use_fast_math", b"-lineinfo"]


def nvrtc_dir():
    return os.environ.get("PROCMEM_NVRTC_DIR", os.path.join(ROOT, "target", "nvrtc"))


def install():
    subprocess.check_call([
        sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--require-hashes",
        "--target", nvrtc_dir(), "-r", os.path.join(ROOT, "scripts", "nvrtc-requirements.txt"),
    ])


def load_nvrtc():
    found = sorted(glob.glob(os.path.join(nvrtc_dir(), "nvidia", "cuda_nvrtc", "lib",
                                          "libnvrtc.so*")))
    found = [f for f in found if "builtins" not in f and "alt" not in os.path.basename(f)]
    if not found:
        return None
    return ctypes.CDLL(found[0])


def compile_ptx(lib):
    source = open(SOURCE, "rb").read()
    prog = ctypes.c_void_p()
    check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source, b"decode.cu", 0, None, None))
    opts = (ctypes.c_char_p * len(OPTIONS))(*OPTIONS)
    status = lib.nvrtcCompileProgram(prog, len(OPTIONS), opts)
    if status != 0:
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        sys.exit("NVRTC failed:\n" + log.value.decode())
    size = ctypes.c_size_t()
    check(lib, lib.nvrtcGetPTXSize(prog, ctypes.byref(size)))
    ptx = ctypes.create_string_buffer(size.value)
    check(lib, lib.nvrtcGetPTX(prog, ptx))
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return ptx.value.decode()


def check(lib, status):
    if status != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        sys.exit("NVRTC error: " + lib.nvrtcGetErrorString(status).decode())


def main():
    args = sys.argv[1:]
    if "--install" in args:
        install()
    lib = load_nvrtc()
    if lib is None:
        print(f"NVRTC not installed in {nvrtc_dir()} (run scripts/gen-ptx.py --install)")
        sys.exit(3)
    ptx = compile_ptx(lib)
    if "--check" in args:
        current = open(PTX).read() if os.path.exists(PTX) else ""
        if current != ptx:
            print("kernels/decode.ptx is stale: run scripts/gen-ptx.py and commit it")
            sys.exit(1)
        print("kernels/decode.ptx matches kernels/decode.cu")
        return
    with open(PTX, "w") as f:
        f.write(ptx)
    print(f"wrote {PTX} ({len(ptx)} bytes)")


if __name__ == "__main__":
    main()
