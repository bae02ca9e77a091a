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

/// A child process that prints `listening on http://ADDR`: where, and everything it printed.
#[allow(dead_code)]
pub struct Listening {
    /// The process.
    pub child: std::process::Child,
    /// The address it printed.
    pub addr: String,
    /// Its standard output so far.
    pub out: std::sync::Arc<std::sync::Mutex<String>>,
}

/// Starts `cmd` with its standard output read on a thread, and waits up to `within` for its
/// `listening on` line (killed, with what it printed in the panic, where none came).
#[allow(dead_code)]
pub fn spawn_listening(mut cmd: Command, within: std::time::Duration) -> Listening {
    use std::io::BufRead;
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let out = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let (tx, rx) = std::sync::mpsc::channel();
    let keep = std::sync::Arc::clone(&out);
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            if let Some(rest) = line.strip_prefix("listening on http://") {
                let _ = tx.send(rest.split_whitespace().next().unwrap_or("").to_string());
            }
            let mut o = keep.lock().unwrap();
            o.push_str(&line);
            o.push('\n');
        }
    });
    match rx.recv_timeout(within) {
        Ok(addr) => Listening { child, addr, out },
        Err(_) => {
            let _ = child.kill();
            panic!("the server did not listen: {}", out.lock().unwrap());
        }
    }
}
