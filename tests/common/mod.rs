//! Helpers shared by the root crate's integration tests.

use std::process::{Command, Output};

/// Runs test `name` of this test binary again in a child process, alone, with `env=value`
/// set (so the test knows it is the child), and returns what it did. For properties whose
/// violation kills the process or poisons process-wide state: a fault, a CUDA context.
pub fn rerun_in_child(name: &str, env: &str, value: &str) -> Output {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(env, value)
        .output()
        .unwrap()
}
