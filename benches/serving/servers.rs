//! The two servers the load generator drives, each its own process so its peak RSS is its
//! own: procmem's main job (this bench binary again, as `--model smollm2 --listen`; see
//! `child` in serving.rs) and llama.cpp's `llama-server` (built by `scripts/llama-server.sh`).
//! While a row runs a watcher reads each server's `/metrics` every 100 ms for the peaks.
// Shared by the serving and sharing benches, which each use a part.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use super::client::{get, metric};

/// Which server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Procmem,
    Llama,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Procmem => "procmem",
            Kind::Llama => "llama.cpp",
        }
    }
}

/// How llama.cpp's server keeps its KV and its prompt cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LlamaKv {
    /// Each slot its own context (`--no-kv-unified`), no host prompt cache (`--cache-ram 0`).
    PerSlot,
    /// One KV shared by the slots (`-kvu`), no host prompt cache.
    Unified,
    /// One KV shared by the slots (`-kvu`), the host prompt cache at its default size.
    UnifiedCache,
}

impl LlamaKv {
    /// Its command-line options.
    pub fn args(self) -> &'static [&'static str] {
        match self {
            LlamaKv::PerSlot => &["--no-kv-unified", "--cache-ram", "0"],
            LlamaKv::Unified => &["-kvu", "--cache-ram", "0"],
            LlamaKv::UnifiedCache => &["-kvu"],
        }
    }

    /// Its name in the report.
    pub fn name(self) -> &'static str {
        match self {
            LlamaKv::PerSlot => "per_slot",
            LlamaKv::Unified => "unified",
            LlamaKv::UnifiedCache => "unified_cache_ram_default",
        }
    }
}

/// A `kB` line of `/proc/<pid>/status` (`VmRSS:`, `VmHWM:`), in bytes.
pub fn status_kb(pid: u32, key: &str) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
}

/// A server process, listening.
pub struct Server {
    pub kind: Kind,
    pub addr: SocketAddr,
    child: Child,
    log: Arc<Mutex<String>>,
}

/// What the watcher saw at most.
#[derive(Clone, Copy, Debug, Default)]
pub struct Peaks {
    /// procmem: `procmem_kv_leased_bytes`.
    pub kv_bytes: f64,
    /// Requests held at once: procmem's `procmem_kv_sequences`, llama.cpp's
    /// `llamacpp:requests_processing`.
    pub held: f64,
    /// Requests whose KV is in memory at once: procmem's sequences less those preempted
    /// (`procmem_kv_preempted_sequences`); llama.cpp's requests processing. The peak, and
    /// the mean of the samples while any request was held.
    pub resident: f64,
    pub resident_mean: f64,
    /// procmem: `procmem_process_outside_books_bytes`, what the server holds that no lease pays
    /// for (its heap beyond the step's reserve, its code).
    pub outside_books: f64,
    resident_sum: f64,
    samples: u64,
}

/// Lines of `r`, into `log`; the first address after "listening on http://" to `addr`.
fn collect<R: tokio::io::AsyncRead + Unpin + Send + 'static>(
    r: R,
    log: Arc<Mutex<String>>,
    addr: Option<tokio::sync::oneshot::Sender<SocketAddr>>,
) {
    tokio::spawn(async move {
        let mut lines = BufReader::new(r).lines();
        let mut addr = addr;
        while let Ok(Some(line)) = lines.next_line().await {
            if let Some(rest) = line.strip_prefix("listening on http://") {
                if let (Some(tx), Some(a)) = (addr.take(), rest.split(' ').next()) {
                    if let Ok(a) = a.parse() {
                        let _ = tx.send(a);
                    }
                }
            }
            let mut log = log.lock().unwrap();
            log.push_str(&line);
            log.push('\n');
        }
    });
}

/// A child that dies with this bench: a bench killed mid-row leaves no server behind.
fn dies_with_parent(cmd: &mut Command) -> &mut Command {
    // SAFETY: between fork and exec the closure only calls `prctl`, which is
    // async-signal-safe, and allocates nothing.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })
    }
}

impl Server {
    /// procmem's main job serving SmolLM2 with f16 KV: a host budget of the weights plus
    /// `fraction` of the peak KV demand of `concurrency` sequences of `context` tokens; or,
    /// with `q8_0` budget bytes, KV in q8_0 under that budget.
    pub async fn procmem(
        fraction: f64,
        (concurrency, context): (usize, usize),
        prefix_disk: Option<&std::path::Path>,
        q8_0: Option<u64>,
    ) -> Result<Self, String> {
        let mut spec = format!("{fraction},{concurrency},{context}");
        if let Some(budget) = q8_0 {
            spec += &format!(",q8_0,{budget}");
        }
        let mut vars = vec![("PROCMEM_SERVING_CHILD", spec)];
        if let Some(dir) = prefix_disk {
            vars.push(("PROCMEM_SERVING_PREFIX_DISK", dir.display().to_string()));
        }
        Self::this_bench(&vars).await
    }

    /// This bench binary again, with `vars` set (its `main` takes the child's part from them):
    /// a procmem server, once it prints the address it listens on.
    pub async fn this_bench(vars: &[(&str, String)]) -> Result<Self, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut command = Command::new(exe);
        for (k, v) in vars {
            command.env(k, v);
        }
        let mut child = dies_with_parent(&mut command)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start the procmem server: {e}"))?;
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = tokio::sync::oneshot::channel();
        collect(child.stdout.take().unwrap(), Arc::clone(&log), Some(tx));
        collect(child.stderr.take().unwrap(), Arc::clone(&log), None);
        let addr = tokio::time::timeout(Duration::from_secs(120), rx)
            .await
            .map_err(|_| format!("procmem did not listen in 120 s:\n{}", log.lock().unwrap()))?
            .map_err(|_| format!("procmem exited:\n{}", log.lock().unwrap()))?;
        Ok(Server {
            kind: Kind::Procmem,
            addr,
            child,
            log,
        })
    }

    /// llama.cpp's server on the same GGUF, `tokens` tokens of KV in all (f16, preallocated)
    /// for `slots` slots, as `kv` says, 2 threads as this machine has.
    pub async fn llama(
        bin: &Path,
        gguf: &Path,
        slots: usize,
        tokens: usize,
        kv: LlamaKv,
    ) -> Result<Self, String> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| e.to_string())?
            .port();
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
        let mut cmd = Command::new(bin);
        cmd.arg("-m")
            .arg(gguf)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["-c", &tokens.to_string()])
            .args(["--parallel", &slots.to_string()])
            .args(["-t", &threads.to_string(), "-tb", &threads.to_string()])
            .args(["--cache-type-k", "f16", "--cache-type-v", "f16"])
            .args(kv.args())
            .args(["--metrics", "--no-webui"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = dies_with_parent(&mut cmd)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", bin.display()))?;
        let log = Arc::new(Mutex::new(String::new()));
        collect(child.stdout.take().unwrap(), Arc::clone(&log), None);
        collect(child.stderr.take().unwrap(), Arc::clone(&log), None);
        let start = Instant::now();
        loop {
            if get(addr, "/health").await.is_ok() {
                break;
            }
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!(
                    "llama-server exited ({status}):\n{}",
                    log.lock().unwrap()
                ));
            }
            if start.elapsed() > Duration::from_secs(120) {
                return Err(format!(
                    "llama-server not ready in 120 s:\n{}",
                    log.lock().unwrap()
                ));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(Server {
            kind: Kind::Llama,
            addr,
            child,
            log,
        })
    }

    /// What the server printed so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// Its peak resident set so far (`VmHWM`), in bytes; `None` once it has exited.
    fn peak_rss(&self) -> Option<u64> {
        self.status_kb("VmHWM:")
    }

    /// Its pid, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// A `kB` line of `/proc/<pid>/status`, in bytes.
    fn status_kb(&self, key: &str) -> Option<u64> {
        status_kb(self.child.id()?, key)
    }

    /// Reads `/metrics` every 100 ms until `stop` is dropped; the peaks.
    pub fn watch(
        &self,
    ) -> (
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<Peaks>,
    ) {
        let (tx, mut rx) = tokio::sync::oneshot::channel::<()>();
        let (addr, kind) = (self.addr, self.kind);
        let task = tokio::spawn(async move {
            let mut peaks = Peaks::default();
            loop {
                if let Ok(text) = get(addr, "/metrics").await {
                    let (kv, held, preempted) = match kind {
                        Kind::Procmem => (
                            metric(&text, "procmem_kv_leased_bytes"),
                            metric(&text, "procmem_kv_sequences"),
                            metric(&text, "procmem_kv_preempted_sequences"),
                        ),
                        Kind::Llama => (None, metric(&text, "llamacpp:requests_processing"), None),
                    };
                    let held = held.unwrap_or(0.0);
                    let resident = (held - preempted.unwrap_or(0.0)).max(0.0);
                    peaks.kv_bytes = peaks.kv_bytes.max(kv.unwrap_or(0.0));
                    let outside = metric(&text, "procmem_process_outside_books_bytes");
                    peaks.outside_books = peaks.outside_books.max(outside.unwrap_or(0.0));
                    peaks.held = peaks.held.max(held);
                    peaks.resident = peaks.resident.max(resident);
                    if held > 0.0 {
                        peaks.resident_sum += resident;
                        peaks.samples += 1;
                    }
                }
                tokio::select! {
                    _ = &mut rx => {
                        peaks.resident_mean = peaks.resident_sum / peaks.samples.max(1) as f64;
                        return peaks;
                    }
                    _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                }
            }
        });
        (tx, task)
    }

    /// A metric's value now.
    pub async fn metric(&self, name: &str) -> Option<f64> {
        metric(&get(self.addr, "/metrics").await.ok()?, name)
    }

    /// SIGTERM, then waits (30 s at most) for it to exit; its log and peak resident set, read
    /// every 10 ms while it shuts down (the last reading is within 10 ms of its exit).
    pub async fn stop(mut self) -> Result<Stopped, String> {
        let mut rss = self.peak_rss().unwrap_or(0);
        if let Some(pid) = self.child.id() {
            // SAFETY: `kill` on our own child's pid, which has not been waited for yet.
            unsafe { libc::kill(pid as i32, libc::SIGTERM) };
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(status) = self.child.try_wait().map_err(|e| e.to_string())? {
                break status;
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "{} did not exit in 30 s after SIGTERM",
                    self.kind.name()
                ));
            }
            rss = rss.max(self.peak_rss().unwrap_or(0));
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        // Let the readers take the last lines.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let log = self.log();
        if !status.success() {
            return Err(format!("{} exited with {status}:\n{log}", self.kind.name()));
        }
        Ok(Stopped { log, rss })
    }
}

/// A server that exited.
pub struct Stopped {
    /// What it printed.
    pub log: String,
    /// Its peak resident set, in bytes.
    pub rss: u64,
}
