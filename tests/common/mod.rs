//! Helpers shared by the root crate's integration tests.

use std::path::PathBuf;
use std::process::{Command, Output};

/// Runs test `name` of this test binary again in a child process, alone, with `env=value`
/// set (so the test knows it is the child), and returns what it did. For properties whose
/// violation kills the process or poisons process-wide state: a fault, a CUDA context.
#[allow(dead_code)]
pub fn rerun_in_child(name: &str, env: &str, value: &str) -> Output {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(env, value)
        .output()
        .unwrap()
}

/// The path of example `name` as `cargo test` built it (examples are built for tests).
#[allow(dead_code)]
pub fn example(name: &str) -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"));
    let profile = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    let bin = target.join(profile).join("examples").join(name);
    assert!(
        bin.exists(),
        "{} not built (cargo test builds examples)",
        bin.display()
    );
    bin
}
