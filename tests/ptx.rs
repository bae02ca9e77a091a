//! The checked-in PTX (`kernels/decode.ptx`) is what NVRTC makes of `kernels/decode.cu`
//! today, and declares every kernel the loader looks up.

use std::process::Command;

use procmem::cuda::DECODE_PTX;

#[test]
fn the_checked_in_ptx_is_current() {
    let root = env!("CARGO_MANIFEST_DIR");
    let status = Command::new("python3")
        .arg(format!("{root}/scripts/gen-ptx.py"))
        .arg("--check")
        .status();
    match status.map(|s| s.code()) {
        Ok(Some(0)) => {}
        Ok(Some(3)) => eprintln!(
            "SKIPPED the_checked_in_ptx_is_current: NVRTC is not installed \
             (scripts/gen-ptx.py --install puts it in target/nvrtc)"
        ),
        Err(e) => eprintln!("SKIPPED the_checked_in_ptx_is_current: no python3 ({e})"),
        Ok(code) => panic!("kernels/decode.ptx is stale or NVRTC failed (exit {code:?})"),
    }
}

#[test]
fn the_ptx_declares_every_kernel_the_loader_uses() {
    use procmem::kv::KvDtype;
    let splits = KvDtype::ALL
        .iter()
        .flat_map(|k| KvDtype::ALL.map(|v| format!("gqa_split_{k}_{v}")));
    let others = ["gqa_merge", "kv_write_f32", "kv_write_f16", "kv_write_q8_0"];
    for kernel in splits.chain(others.map(String::from)) {
        assert!(
            DECODE_PTX.contains(&format!(".visible .entry {kernel}(")),
            "{kernel} is missing from kernels/decode.ptx"
        );
    }
    // PTX for compute capability 8.0: every GPU since the A100 runs it.
    assert!(DECODE_PTX.contains(".target sm_80"));
}
