//! memtop as a person uses it: the main job runs in one tmux session and lingers serving
//! metrics, memtop runs in another, and the screen (read with `tmux capture-pane`) shows the
//! numbers the endpoint serves, which are the main job's own summary. `q` quits cleanly, a
//! closed endpoint ends memtop with a line saying so, and an unreachable one is reported.
#![cfg(target_os = "linux")]

mod common;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

fn free_port() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// The endpoint's samples: series text (name and labels) to value.
fn scrape(addr: SocketAddr) -> BTreeMap<String, f64> {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(s, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    text.lines()
        .filter(|l| l.starts_with("procmem_"))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series.to_string(), value.parse().ok()?))
        })
        .collect()
}

/// A tmux server of this test's own, so nothing else on the machine is touched.
struct Tmux {
    socket: String,
}

impl Tmux {
    fn new() -> Option<Tmux> {
        let found = Command::new("sh")
            .args(["-c", "command -v tmux"])
            .output()
            .is_ok_and(|o| o.status.success());
        if !found {
            assert!(
                std::env::var_os("CI").is_none(),
                "tmux must be installed in CI (see .ci/run)"
            );
            eprintln!("SKIPPED memtop test: tmux is not installed");
            return None;
        }
        Some(Tmux {
            socket: format!("procmem-memtop-{}", std::process::id()),
        })
    }

    fn tmux(&self, args: &[&str]) -> String {
        let out = Command::new("tmux")
            .arg("-L")
            .arg(&self.socket)
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Runs `command` (through `sh -c`) in a new detached session of `cols` x `rows`.
    fn run(&self, session: &str, command: &str) {
        let out = Command::new("tmux")
            .arg("-L")
            .arg(&self.socket)
            .args(["new-session", "-d", "-s", session, "-x", "160", "-y", "45"])
            .arg(command)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "tmux: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn screen(&self, session: &str) -> String {
        self.tmux(&["capture-pane", "-p", "-t", session])
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .arg("-L")
            .arg(&self.socket)
            .arg("kill-server")
            .output();
    }
}

fn wait_for(what: &str, limit: Duration, mut ready: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ready() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The words after `word` on the first screen line that has it.
fn after<'a>(screen: &'a str, line_has: &str, word: &str) -> Vec<&'a str> {
    let line = screen
        .lines()
        .find(|l| l.contains(line_has))
        .unwrap_or_else(|| panic!("no line with {line_has:?} on:\n{screen}"));
    let words: Vec<&str> = line
        .split(|c: char| c.is_whitespace() || c == '│')
        .filter(|w| !w.is_empty())
        .collect();
    let at = words
        .iter()
        .position(|w| *w == word)
        .unwrap_or_else(|| panic!("no {word:?} in {line:?}"));
    words[at + 1..].to_vec()
}

/// "3.81" "MiB" read back as bytes, and the rounding the screen allows.
fn shown_bytes(value: &str, unit: &str) -> (f64, f64) {
    let v: f64 = value.parse().unwrap();
    let scale = match unit {
        "B" => return (v, 0.5),
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        other => panic!("unit {other}"),
    };
    (v * scale, 0.005 * scale)
}

fn assert_bytes(what: &str, screen: (&str, &str), endpoint: f64) {
    let (v, slack) = shown_bytes(screen.0, screen.1);
    assert!(
        (v - endpoint).abs() <= slack + 1e-6,
        "{what}: the screen shows {} {}, the endpoint {endpoint}",
        screen.0,
        screen.1
    );
}

fn summary_value(summary: &str, after_line: Option<&str>, name: &str) -> f64 {
    let mut lines = summary.lines().skip_while(|l| !l.starts_with("summary"));
    if let Some(anchor) = after_line {
        lines.by_ref().find(|l| l.trim() == anchor);
    }
    lines
        .find(|l| l.trim_start().starts_with(name))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in the summary:\n{summary}"))
}

#[test]
fn memtop_shows_what_the_endpoint_and_the_summary_say() {
    let Some(tmux) = Tmux::new() else { return };
    let (server, memtop) = (
        common::example("inference_server"),
        common::example("memtop"),
    );
    let addr = free_port();
    let dir = std::env::temp_dir().join(format!("procmem-memtop-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let job_out = dir.join("job.out");
    tmux.run(
        "job",
        &format!(
            "{} --requests 12 --concurrency 6 --prompt-len 40 --max-new-tokens 8 --budget 0.5x \
             --metrics-addr {addr} --linger 60 > {} 2>&1",
            server.display(),
            job_out.display()
        ),
    );
    let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_default();
    wait_for("the main job's summary", Duration::from_secs(300), || {
        read(&job_out).contains("lingering")
    });
    let summary = read(&job_out);
    let status = dir.join("memtop.status");
    tmux.run(
        "top",
        &format!(
            "{} {addr}; echo exit=$? > {}; sleep 60",
            memtop.display(),
            status.display()
        ),
    );
    // Two refreshes, then the screen is read.
    wait_for("memtop's screen", Duration::from_secs(30), || {
        tmux.screen("top").contains("holders")
    });
    std::thread::sleep(Duration::from_millis(2500));
    let screen = tmux.screen("top");
    let m = scrape(addr);
    let at = |series: &str| -> f64 {
        *m.get(series)
            .unwrap_or_else(|| panic!("{series} not served"))
    };
    let host = |name: &str| at(&format!("{name}{{authority=\"host\"}}"));
    eprintln!("{screen}");

    // The authority's line and bars.
    let line = after(&screen, "capacity", "capacity");
    assert_bytes(
        "capacity",
        (line[0], line[1]),
        host("procmem_governor_capacity_bytes"),
    );
    for (word, series) in [
        ("grants", "procmem_governor_grants_total"),
        ("denials", "procmem_governor_denials_total"),
        ("tickets", "procmem_governor_pressure_tickets_total"),
        ("waiting", "procmem_governor_waiting_requests"),
    ] {
        let shown: f64 = after(&screen, "capacity", word)[0].parse().unwrap();
        assert_eq!(shown, host(series), "{word}");
    }
    for (bar, series) in [
        ("approved", "procmem_governor_approved_bytes"),
        ("committed", "procmem_governor_committed_bytes"),
        ("OS", "procmem_authority_os_resident_bytes"),
    ] {
        let shown = after(&screen, &format!("  {bar} "), bar);
        assert_bytes(bar, (shown[0], shown[1]), host(series));
    }
    let drift = after(&screen, "capacity", "drift");
    assert_bytes(
        "drift",
        (drift[0], drift[1]),
        host("procmem_authority_drift_bytes"),
    );

    // The KV store's row: holder, authority, approved, tickets, freed, seqs, tokens,
    // preemptions swap/recompute, prefix hit rate, layers.
    let row = after(&screen, "│kv ", "kv");
    let holder = |name: &str| at(&format!("{name}{{authority=\"host\",holder=\"kv\"}}"));
    let kv = |name: &str| at(&format!("{name}{{store=\"kv\",authority=\"host\"}}"));
    let kv_mode = |name: &str, mode: &str| {
        at(&format!(
            "{name}{{store=\"kv\",authority=\"host\",mode=\"{mode}\"}}"
        ))
    };
    assert_eq!(row[0], "host");
    assert_bytes(
        "kv approved",
        (row[1], row[2]),
        holder("procmem_holder_approved_bytes"),
    );
    assert_eq!(
        row[3].parse::<f64>().unwrap(),
        holder("procmem_holder_pressure_tickets_total")
    );
    assert_bytes(
        "kv freed",
        (row[4], row[5]),
        holder("procmem_holder_pressure_freed_bytes_total"),
    );
    assert_eq!(row[6].parse::<f64>().unwrap(), kv("procmem_kv_sequences"));
    assert_eq!(row[7].parse::<f64>().unwrap(), kv("procmem_kv_tokens"));
    let (swap, recompute) = (
        kv_mode("procmem_kv_preemptions_total", "swap"),
        kv_mode("procmem_kv_preemptions_total", "recompute"),
    );
    assert_eq!(row[8], format!("{swap}/{recompute}"));
    let hits = kv("procmem_kv_prefix_hit_tokens_total");
    let queries = kv("procmem_kv_prefix_query_tokens_total");
    assert!(queries > 0.0);
    assert_eq!(row[9], format!("{:.1}%", 100.0 * hits / queries));
    let weights = after(&screen, "│weights ", "weights");
    let layers = |p: &str| {
        at(&format!(
            "procmem_residency_layers{{holder=\"weights\",authority=\"host\",placement=\"{p}\"}}"
        ))
    };
    // Its layers, then the disk tier's column (a holder with none shows "-").
    let [.., placed, disk] = weights.as_slice() else {
        panic!("the weights row: {weights:?}");
    };
    assert_eq!(
        *placed,
        format!("{}/{}", layers("device"), layers("host") + layers("disk"))
    );
    assert_eq!(*disk, "-");

    // The endpoint is the main job's summary.
    let authority = Some("authority host");
    assert_eq!(
        summary_value(&summary, authority, "capacity bytes"),
        host("procmem_governor_capacity_bytes")
    );
    assert_eq!(
        summary_value(&summary, authority, "grants"),
        host("procmem_governor_grants_total")
    );
    assert_eq!(
        summary_value(&summary, authority, "pressure tickets"),
        host("procmem_governor_pressure_tickets_total")
    );
    assert_eq!(
        summary_value(&summary, authority, "bytes freed by pressure"),
        host("procmem_governor_pressure_freed_bytes_total")
    );
    assert_eq!(
        summary_value(&summary, None, "sequences preempted by pressure"),
        swap + recompute
    );
    assert_eq!(
        summary_value(&summary, None, "prompt tokens from shared blocks"),
        hits
    );
    assert!(
        host("procmem_governor_pressure_tickets_total") > 0.0,
        "no pressure:\n{summary}"
    );

    // q quits, and memtop exits cleanly.
    tmux.tmux(&["send-keys", "-t", "top", "q"]);
    wait_for("memtop to quit on q", Duration::from_secs(10), || {
        read(&status).contains("exit=")
    });
    assert_eq!(read(&status).trim(), "exit=0");

    // A closed endpoint ends memtop with a line saying so.
    let closed = dir.join("memtop-closed.status");
    tmux.run(
        "top2",
        &format!(
            "{} {addr}; echo exit=$? > {}; sleep 60",
            memtop.display(),
            closed.display()
        ),
    );
    wait_for("the second memtop", Duration::from_secs(30), || {
        tmux.screen("top2").contains("holders")
    });
    tmux.tmux(&["send-keys", "-t", "job", "C-c"]);
    wait_for(
        "memtop to see the endpoint close",
        Duration::from_secs(30),
        || read(&closed).contains("exit="),
    );
    assert_eq!(read(&closed).trim(), "exit=0");
    let screen = tmux.screen("top2");
    assert!(
        screen.contains(&format!("memtop: http://{addr}/metrics closed")),
        "{screen}"
    );

    // An endpoint nobody serves is said plainly.
    let nobody = free_port();
    let out = Command::new(&memtop)
        .arg(nobody.to_string())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("memtop: cannot reach http://{nobody}/metrics")),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
