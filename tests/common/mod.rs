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

/// Runs `cmd` to its end with both pipes drained on another thread (a chatty child never
/// blocks on a full pipe) and gives its output; past `limit` it is killed and the test fails
/// naming `what` as hung.
#[allow(dead_code)]
pub fn output_within(cmd: &mut Command, limit: std::time::Duration, what: &str) -> Output {
    let child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            panic!("{what} hung");
        }
    }
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

/// Waits (up to a minute) for `child` to exit: its status and everything it printed to `out`.
#[allow(dead_code)]
pub fn wait_exit(
    child: &mut std::process::Child,
    out: &std::sync::Mutex<String>,
) -> (std::process::ExitStatus, String) {
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            start.elapsed() < std::time::Duration::from_secs(60),
            "no exit within a minute"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    // The reader thread may still hold the last lines.
    std::thread::sleep(std::time::Duration::from_millis(200));
    let text = out.lock().unwrap().clone();
    (status, text)
}

/// The `data:` payloads of a server-sent events body.
#[allow(dead_code)]
pub fn sse_data(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
        .map(|d| d.trim().to_string())
        .collect()
}

/// The library's own greedy completion of `prompt` by the GGUF at `path`, in this process:
/// f32 KV of `context` tokens chunked as the main job chunks it, stopping at `eos`, with
/// each token's logits where `keep_logits`.
#[allow(dead_code)]
pub fn library_completion(
    path: &std::path::Path,
    context: usize,
    prompt: Vec<u32>,
    max_new: usize,
    eos: Option<u32>,
    keep_logits: bool,
) -> procmem_model::Completion {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let loaded = procmem_model::Smol::load(path).unwrap();
        let memory = procmem_actors::MemoryManager::builder()
            .build()
            .await
            .unwrap();
        let shape = loaded.model.kv_shape(
            procmem::kv::KvDtype::F32,
            procmem::kv::KvDtype::F32,
            context,
        );
        let config = procmem_actors::kv::KvStoreConfig::new("kv", shape)
            .chunk_granules(3)
            .wait(std::time::Duration::from_secs(5));
        let engine = procmem_model::Engine::start(&memory, loaded, config, eos)
            .await
            .unwrap();
        let request = procmem_model::Request {
            id: 1,
            prompt,
            max_new,
        };
        let (done, _) = engine
            .generate(vec![request], 1, keep_logits)
            .await
            .unwrap();
        drop(engine);
        memory.shutdown().await.unwrap();
        done.into_iter().next().unwrap()
    })
}

/// An HTTP response's text split into its status, head and body (status 0 where it has none).
#[allow(dead_code)]
pub fn split_response(text: &str) -> (u16, &str, &str) {
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, head, body)
}

/// Prints a figure line that `scripts/reliability.sh` collects into its table, to stderr
/// directly: the harness keeps a passing test's `eprintln!` to itself.
#[allow(dead_code)]
pub fn figure(name: &str, passed: usize, total: usize) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "FIGURE {name} {passed}/{total}");
}
