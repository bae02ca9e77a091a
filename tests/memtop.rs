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
        // One server per test: the tests of this binary run side by side.
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Some(Tmux {
            socket: format!("procmem-memtop-{}-{n}", std::process::id()),
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

/// A child killed when the test ends, however it ends.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The credit memtop shows for each process on `screen` (`name[pid] host credit 1.00 MiB`).
fn memtop_credits(screen: &str) -> BTreeMap<String, f64> {
    screen
        .lines()
        .filter_map(|l| {
            let words: Vec<&str> = l
                .split(|c: char| c.is_whitespace() || c == '│')
                .filter(|w| !w.is_empty())
                .collect();
            let at = words.iter().position(|w| *w == "credit")?;
            let name = words.get(at.checked_sub(2)?)?;
            if !name.contains('[') {
                return None;
            }
            let (v, _) = shown_bytes(words.get(at + 1)?, words.get(at + 2)?);
            Some((name.to_string(), v))
        })
        .collect()
}

/// The credit `cluster_status` printed for each process, refresh after refresh.
fn status_credits(text: &str) -> Vec<BTreeMap<String, f64>> {
    text.split("-- ")
        .skip(1)
        .map(|refresh| {
            refresh
                .lines()
                .filter_map(|l| {
                    let w: Vec<&str> = l.split_whitespace().collect();
                    let at = w.iter().position(|x| *x == "process")?;
                    let credit = w.iter().position(|x| *x == "credit")?;
                    Some((w.get(at + 1)?.to_string(), w.get(credit + 1)?.parse().ok()?))
                })
                .collect()
        })
        .collect()
}

/// Issue 46, 5: two main jobs share a node Governor of 16 MiB; the first takes it all (its
/// cache), the second starts and the node moves credit to it. memtop on the node's endpoint
/// and `cluster_status` on its watch group both show the first's credit falling and the
/// second's rising while they run.
#[test]
fn memtop_and_cluster_status_show_the_credit_moving_between_two_servers() {
    let Some(tmux) = Tmux::new() else { return };
    let metrics = free_port();
    let port = free_port().port().to_string();
    let dir = tempfile::tempdir().unwrap();
    let _node = Killed(
        Command::new(common::example("node_governor"))
            .args(["--authority", "host=16MiB", "--port", &port])
            .args(["--metrics-addr", &metrics.to_string()])
            .args(["--rejoin-grace-ms", "0", "--run-for", "300"])
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for("the node's endpoint", Duration::from_secs(30), || {
        TcpStream::connect(metrics).is_ok()
    });
    let status_out = dir.path().join("cluster_status.out");
    let _status = Killed(
        Command::new(common::example("cluster_status"))
            .args(["--node", &format!("127.0.0.1:{port}"), "--count", "300"])
            .stdout(std::fs::File::create(&status_out).unwrap())
            .spawn()
            .unwrap(),
    );
    tmux.run(
        "top",
        &format!(
            "{} {metrics} --interval 0.3; sleep 60",
            common::example("memtop").display()
        ),
    );
    let job = |name: &str| {
        let out = std::fs::File::create(dir.path().join(name)).unwrap();
        Killed(
            Command::new(common::example("inference_server"))
                .args(["--node", &format!("127.0.0.1:{port}")])
                .args([
                    "--requests",
                    "2000",
                    "--concurrency",
                    "6",
                    "--prompt-len",
                    "200",
                ])
                .args(["--max-new-tokens", "32", "--linger", "120"])
                .stdout(out)
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap(),
        )
    };
    let a = job("a.out");
    let a_name = format!("inference_server[{}]", a.0.id());
    // memtop's screens, read every 200 ms: the credit shown per process, in order.
    let mut seen: Vec<BTreeMap<String, f64>> = Vec::new();
    let read = |seen: &mut Vec<BTreeMap<String, f64>>| {
        seen.push(memtop_credits(&tmux.screen("top")));
        std::thread::sleep(Duration::from_millis(200));
    };
    let full = 12.0 * 1024.0 * 1024.0;
    let start = Instant::now();
    while seen
        .last()
        .and_then(|s| s.get(&a_name))
        .is_none_or(|c| *c < full)
    {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "A never held 12 MiB: {seen:?}"
        );
        read(&mut seen);
    }
    let b = job("b.out");
    let b_name = format!("inference_server[{}]", b.0.id());
    let shown = |s: &BTreeMap<String, f64>, n: &str| s.get(n).copied().unwrap_or(0.0) / 1048576.0;
    // Moved: B holds 3 MiB and A 1.5 MiB less than the most it held.
    let moved = |seen: &[BTreeMap<String, f64>]| {
        let a_peak = seen.iter().map(|s| shown(s, &a_name)).fold(0.0, f64::max);
        let last = seen.last().unwrap();
        shown(last, &b_name) >= 3.0 && shown(last, &a_name) <= a_peak - 1.5
    };
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(15) && !moved(&seen) {
        read(&mut seen);
    }
    let a_line: Vec<String> = seen
        .iter()
        .map(|s| format!("{:.1}", shown(s, &a_name)))
        .collect();
    let b_line: Vec<String> = seen
        .iter()
        .map(|s| format!("{:.1}", shown(s, &b_name)))
        .collect();
    eprintln!("memtop, A's credit (MiB): {}", a_line.join(" "));
    eprintln!("memtop, B's credit (MiB): {}", b_line.join(" "));
    assert!(moved(&seen), "memtop shows the credit moving from A to B");
    // cluster_status refreshes once a second, so it may miss A's peak that memtop saw: read
    // what it printed until A is shown holding at least 6 MiB, then at least 1.5 MiB less
    // after B joined, and B 3 MiB, 20 s at most.
    let mib = |r: &BTreeMap<String, f64>, n: &str| r.get(n).copied().unwrap_or(0.0) / 1048576.0;
    let start = Instant::now();
    loop {
        let refreshes = status_credits(&std::fs::read_to_string(&status_out).unwrap());
        let a_most = refreshes
            .iter()
            .map(|r| mib(r, &a_name))
            .fold(0.0, f64::max);
        let b_first = refreshes.iter().position(|r| r.contains_key(&b_name));
        let after = b_first.map_or(&[][..], |i| &refreshes[i..]);
        let a_least = after
            .iter()
            .map(|r| mib(r, &a_name))
            .fold(f64::MAX, f64::min);
        let b_most = after.iter().map(|r| mib(r, &b_name)).fold(0.0, f64::max);
        if a_most >= 6.0 && a_least <= a_most - 1.5 && b_most >= 3.0 {
            eprintln!(
                "cluster_status, {} refreshes: A at most {a_most:.1} MiB, after B joined at \
                 least {a_least:.1}; B at most {b_most:.1}",
                refreshes.len()
            );
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "cluster_status never showed the credit moving: {refreshes:?}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}
