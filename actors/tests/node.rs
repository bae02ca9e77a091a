//! Several server processes under one node Governor, every one a real process on loopback:
//! the node, the servers (each a Governor, a CPU provider and a KV store over real memfd
//! memory) and hostile peers are this test binary run again in a role (`node_role`, ignored
//! when run alone). The test process only orchestrates: it reads what the children print, and
//! what the kernel says of them (the servers' KV lives in memfds: their allocated blocks,
//! through `/proc/<pid>/fd`).

mod common;

use procmem_actors::kv::StepEnd;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use procmem_actors::kv::{KvStoreHandle, PreemptMode};
use procmem_actors::machine::{CgroupVersion, HostPressure, LinuxSource};
use procmem_actors::node::wire::{
    HeldPrefixes, NodeNotice, NodeRequest, Share, WireError, MAX_PAYLOAD,
};
use procmem_actors::node::{LinkConfig, NodeConfig, NodeHandle, NodeLink};
use procmem_actors::procmem::host::machine::PressurePolicy;
use procmem_actors::procmem::kv::{prompt_keys, KvShape, PrefixDigest};

const ROLE: &str = "PROCMEM_NODE_ROLE";
const COOKIE: &str = "procmem-test-cookie";
const MIB: u64 = 1 << 20;

/// 16 KiB per token over 4 layers: a 64-token prompt is 1 MiB of KV.
const SHAPE: KvShape = KvShape {
    layers: 4,
    q_heads: 8,
    kv_heads: 4,
    head_dim: 128,
    max_tokens: 256,
    k_dtype: procmem_actors::procmem::kv::KvDtype::F32,
    v_dtype: procmem_actors::procmem::kv::KvDtype::F32,
};
const PROMPT: usize = 64;

// ---------------------------------------------------------------------------------------------
// The roles, run in child processes.

#[test]
#[ignore = "a role of the multi-process tests below, run by them in a child process"]
fn node_role() {
    let role = std::env::var(ROLE).expect("run by the multi-process tests");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        match role.as_str() {
            "node" => run_node().await,
            "server" => run_server().await,
            "hostile" => run_hostile().await,
            "watch" => run_watch().await,
            other => panic!("unknown role {other}"),
        }
    });
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} not set"))
}

fn say(line: String) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// The node: prints its books every 10 ms as `STATUS total capacity rejected reaped
/// tickets pid:credit:connected,... foreign`.
async fn run_node() {
    let port: u16 = env("PORT").parse().unwrap();
    let capacity: u64 = env("CAPACITY").parse().unwrap();
    let mut config = NodeConfig::new(COOKIE, port, "host", capacity);
    config.ticket_timeout = Duration::from_millis(300);
    if let Ok(name) = std::env::var("NODE_NAME") {
        config.name = name;
    }
    let node = NodeHandle::start(config).await.unwrap();
    // The capacity follows a cgroup's files where the test gives one (a directory it writes).
    let _follow = std::env::var("FOLLOW").ok().map(|dir| {
        let mut policy = PressurePolicy::new(capacity);
        policy.reserve = MIB;
        let source = LinuxSource::for_cgroup(Some((dir.into(), CgroupVersion::V2)));
        HostPressure::spawn_for_node(
            node.clone(),
            "host",
            policy,
            source,
            Duration::from_millis(20),
        )
    });
    say("READY".into());
    loop {
        if let Some(s) = node.status().await {
            let (_, cap, total) = s.authorities[0].clone();
            let procs: Vec<String> = s
                .processes
                .iter()
                .map(|p| format!("{}:{}:{}", p.pid, p.credit, p.connected as u8))
                .collect();
            say(format!(
                "STATUS {total} {cap} {} {} {} {} {}",
                s.rejected_frames,
                s.reaped,
                s.tickets,
                procs.join(","),
                s.foreign_frames
            ));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn item(seq: u64, pos: usize, layer: usize) -> procmem_actors::kv::AttendItem {
    common::kv_item(&SHAPE, seq, pos, layer)
}

/// Runs `seq` over its whole prompt, one token per step.
async fn fill(kv: &KvStoreHandle, seq: u64, from: usize) -> Result<(), String> {
    fill_timed(kv, seq, from).await.map(|_| ())
}

/// [`fill`], one step at a time; the longest a step waited to be prepared (for room).
async fn fill_timed(kv: &KvStoreHandle, seq: u64, from: usize) -> Result<Duration, String> {
    let mut longest = Duration::ZERO;
    for pos in from..PROMPT {
        let asked = Instant::now();
        let step = kv.prepare(vec![seq]).await.map_err(|e| e.to_string())?;
        longest = longest.max(asked.elapsed());
        for layer in 0..SHAPE.layers {
            step.attend(layer, vec![item(seq, pos, layer)])
                .await
                .map_err(|e| e.to_string())?;
        }
        step.complete(StepEnd::Submitted)
            .await
            .map_err(|e| e.to_string())?;
    }
    Ok(longest)
}

fn prompt(seq: u64) -> Vec<u32> {
    (0..PROMPT as u32)
        .map(|i| i * 31 + seq as u32 * 1009)
        .collect()
}

/// A server: a Governor whose capacity is its node credit, a CPU provider and a KV store.
/// `CACHE` sequences are run and closed (their prompts stay cached); then `BURST` sequences are
/// run and held. Prints `CACHED`, `BURST first_grant_ms total_ms` and `CAP capacity os` lines.
async fn run_server() {
    let port: u16 = env("PORT").parse().unwrap();
    let (g, p) = common::system(0, 1).await;
    let mut link = LinkConfig::new(
        SocketAddr::from(([127, 0, 0, 1], port)),
        COOKIE,
        env("NAME"),
    );
    link.priority = env("PRIORITY").parse().unwrap();
    if std::env::var_os("TCP_ONLY").is_some() {
        link.unix = None;
    }
    link.chunk = MIB;
    link.wait = Duration::from_secs(3);
    let provider = p.clone();
    link.os_bytes = Some(std::sync::Arc::new(move || common::os_bytes(&provider)));
    link.model = "smol".into();
    // The store starts after the join (its memory comes through it): until then, nothing.
    let store = std::sync::Arc::new(std::sync::OnceLock::<KvStoreHandle>::new());
    link.with_store(std::sync::Arc::clone(&store));
    let node = NodeLink::join(link, g.clone()).await.unwrap();
    let (kv, _) = KvStoreHandle::spawn(
        common::kv_config(SHAPE, 1, PreemptMode::Recompute, Duration::from_secs(3)),
        g.clone(),
        p.clone(),
    )
    .await
    .unwrap();
    let _ = store.set(kv.clone());
    say(format!("JOINED {}", node.token()));
    let watch = {
        let (g, p) = (g.clone(), p.clone());
        tokio::spawn(async move {
            loop {
                if let Ok(s) = g.snapshot().await {
                    say(format!("CAP {} {}", s.books.capacity, common::os_bytes(&p)));
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
    };
    let cache: u64 = env("CACHE").parse().unwrap();
    for seq in 1..=cache {
        kv.open(seq, prompt(seq), 0).await.unwrap();
        fill(&kv, seq, 0).await.unwrap();
        kv.close(seq);
    }
    // A prompt used by every conversation: opened again `HOT` times, its blocks hit each time.
    let hot: u64 = std::env::var("HOT").map_or(0, |v| v.parse().unwrap());
    for seq in 100..100 + hot {
        let opened = kv.open(seq, prompt(1), 0).await.unwrap();
        fill(&kv, seq, opened.cached_tokens).await.unwrap();
        kv.close(seq);
    }
    say(format!("CACHED {}", common::os_bytes(&p)));
    if let Ok(probe) = std::env::var("PROBE") {
        // At the test's word: how much of that prompt is still cached.
        let kv = kv.clone();
        tokio::spawn(async move {
            while !std::path::Path::new(&probe).exists() {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            let opened = kv.open(9999, prompt(1), 0).await.unwrap();
            say(format!("PROBE {}", opened.cached_tokens));
        });
    }
    if std::env::var_os("CHURN").is_some() {
        // Busy all the time: one sequence at a time opens on a cached prompt, decodes 64
        // tokens (1 MiB more) and closes, so what it uses moves every few steps.
        let kv = kv.clone();
        tokio::spawn(async move {
            for seq in 5000.. {
                let Ok(opened) = kv.open(seq, prompt(7), 0).await else {
                    continue;
                };
                let _ = fill(&kv, seq, opened.cached_tokens).await;
                for pos in PROMPT..2 * PROMPT {
                    let Ok(step) = kv.prepare(vec![seq]).await else {
                        break;
                    };
                    for layer in 0..SHAPE.layers {
                        let _ = step.attend(layer, vec![item(seq, pos, layer)]).await;
                    }
                    let _ = step.complete(StepEnd::Submitted).await;
                }
                kv.close(seq);
            }
        });
    }
    let burst: u64 = env("BURST").parse().unwrap();
    if let Ok(rounds) = std::env::var("ROUNDS") {
        // Bursts that move: round `r` starts when the test creates `GO.r`; its sequences are
        // held until all are filled, then closed (their prompts stay cached).
        let go = env("GO");
        for r in 0..rounds.parse::<u64>().unwrap() {
            let file = format!("{go}.{r}");
            while !std::path::Path::new(&file).exists() {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            let seqs: Vec<u64> = (0..burst).map(|i| 1000 * (r + 1) + i).collect();
            let (start, mut longest) = (Instant::now(), Duration::ZERO);
            for &seq in &seqs {
                let asked = Instant::now();
                let opened = kv.open(seq, prompt(seq), 0).await.unwrap();
                longest = longest.max(asked.elapsed());
                longest = longest.max(fill_timed(&kv, seq, opened.cached_tokens).await.unwrap());
            }
            say(format!(
                "BURST {r} {} {}",
                start.elapsed().as_millis(),
                longest.as_millis()
            ));
            for seq in seqs {
                kv.close(seq);
            }
        }
    }
    if let Some(go) = std::env::var("GO")
        .ok()
        .filter(|_| std::env::var_os("ROUNDS").is_none())
    {
        // The burst waits for the test's word.
        while !std::path::Path::new(&go).exists() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    if burst > 0 && std::env::var_os("ROUNDS").is_none() {
        let start = Instant::now();
        let mut first = None;
        for seq in 1000..1000 + burst {
            let opened = kv.open(seq, prompt(seq), 0).await.unwrap();
            fill(&kv, seq, opened.cached_tokens).await.unwrap();
            first.get_or_insert(start.elapsed());
        }
        say(format!(
            "BURST {} {}",
            first.unwrap_or_default().as_millis(),
            start.elapsed().as_millis()
        ));
    }
    if let Ok(leave) = std::env::var("LEAVE") {
        // Leaves the node at the test's word (its memory stays: the node only has to honour
        // the leave of the session in force).
        while !std::path::Path::new(&leave).exists() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        node.leave().await;
        say("LEFT".into());
    } else {
        let _keep = node;
        std::future::pending::<()>().await;
    }
    let _keep = (watch, kv);
    std::future::pending::<()>().await;
}

/// A peer with the cookie that sends what no well-behaved process sends, through the
/// cluster's real sessions, then asks for the node's books. Prints `SENT kind` per frame.
async fn run_hostile() {
    use procmem_actors::node::wire::NodeMsg;
    use ractor::message::{BoxedDowncastErr, SerializedMessage};

    /// Any payload under any variant name: what a hostile peer can put in a frame.
    struct Raw(String, Vec<u8>, bool);
    impl ractor::Message for Raw {
        fn serializable() -> bool {
            true
        }
        fn serialize(self) -> Result<SerializedMessage, BoxedDowncastErr> {
            if self.2 {
                let (tx, _rx) = ractor::concurrency::oneshot();
                Ok(SerializedMessage::Call {
                    variant: self.0,
                    args: self.1,
                    reply: tx.into(),
                    metadata: None,
                })
            } else {
                Ok(SerializedMessage::Cast {
                    variant: self.0,
                    args: self.1,
                    metadata: None,
                })
            }
        }
    }

    let port: u16 = env("PORT").parse().unwrap();
    let cookie = env("COOKIE");
    let server = ractor_cluster::NodeServer::new(
        0,
        cookie,
        "hostile".into(),
        "localhost".into(),
        None,
        None,
    );
    let (server, _) = ractor::Actor::spawn(None, server, ()).await.unwrap();
    ractor_cluster::client_connect(&server, ("127.0.0.1", port))
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(3);
    let node = loop {
        let found = ractor::pg::get_members(&procmem_actors::node::NODE_GROUP.to_string())
            .into_iter()
            .find(|c| !c.get_id().is_local());
        if let Some(cell) = found {
            break cell;
        }
        if Instant::now() > deadline {
            say("NOJOIN".into());
            std::future::pending::<()>().await;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let raw: ractor::ActorRef<Raw> = node.clone().into();
    let enc = |n: &NodeNotice| postcard::to_stdvec(n).unwrap();
    let encr = |r: &NodeRequest| postcard::to_stdvec(r).unwrap();
    let victim: u64 = env("VICTIM").parse().unwrap();
    let give = |bytes| NodeNotice::Give {
        token: victim,
        key: 0,
        authority: "host".into(),
        bytes,
        ticket: 0,
    };
    let valid = enc(&give(1));
    let report = |block_tokens, bits| NodeNotice::Report {
        token: 12345,
        key: 0,
        authority: "host".into(),
        approved: 0,
        os_bytes: 0,
        model: "smol".into(),
        prefixes: Some(HeldPrefixes {
            block_tokens,
            blocks: u64::MAX,
            bits,
        }),
    };
    let frames: Vec<(&str, Raw)> = vec![
        ("garbage_cast", Raw("cast".into(), vec![0xff; 40], false)),
        ("garbage_call", Raw("call".into(), vec![0xfe; 40], true)),
        (
            "unknown_variant",
            Raw("detonate".into(), valid.clone(), false),
        ),
        (
            "truncated",
            Raw("cast".into(), valid[..valid.len() - 1].to_vec(), false),
        ),
        (
            "trailing_bytes",
            Raw("cast".into(), [valid.clone(), vec![0]].concat(), false),
        ),
        (
            "over_payload_limit",
            Raw("cast".into(), vec![0; MAX_PAYLOAD + 1], false),
        ),
        (
            "report_with_a_torn_digest",
            Raw("cast".into(), enc(&report(16, vec![0xff; 100])), false),
        ),
        (
            "report_with_a_digest_of_block_size_zero",
            Raw(
                "cast".into(),
                enc(&report(0, vec![0xff; PrefixDigest::BYTES])),
                false,
            ),
        ),
        ("empty", Raw("cast".into(), vec![], false)),
        (
            "give_zero_without_ticket",
            Raw("cast".into(), enc(&give(0)), false),
        ),
        (
            "give_more_than_credit",
            Raw("cast".into(), enc(&give(u64::MAX)), false),
        ),
        (
            "give_from_a_stranger",
            Raw(
                "cast".into(),
                enc(&NodeNotice::Give {
                    token: 12345,
                    key: 0,
                    authority: "host".into(),
                    bytes: 1,
                    ticket: 0,
                }),
                false,
            ),
        ),
        (
            "leave_of_a_stranger",
            Raw(
                "cast".into(),
                enc(&NodeNotice::Leave { token: 999, key: 0 }),
                false,
            ),
        ),
        (
            "join_token_zero",
            Raw(
                "call".into(),
                encr(&NodeRequest::Join {
                    token: 0,
                    key: 0,
                    pid: 1,
                    name: "x".into(),
                    priority: 0,
                    authority: "host".into(),
                    held: u64::MAX,
                    share: Share::default(),
                }),
                true,
            ),
        ),
        (
            "join_with_a_name_too_long",
            Raw(
                "call".into(),
                encr(&NodeRequest::Join {
                    token: 5,
                    key: 0,
                    pid: std::process::id(),
                    name: "x".repeat(4000),
                    priority: 0,
                    authority: "host".into(),
                    held: 0,
                    share: Share::default(),
                }),
                true,
            ),
        ),
        (
            "ask_without_joining",
            Raw(
                "call".into(),
                encr(&NodeRequest::Ask {
                    token: 77,
                    key: 0,
                    authority: "host".into(),
                    bytes: u64::MAX,
                    at_least: u64::MAX,
                    wait_ms: u64::MAX,
                }),
                true,
            ),
        ),
        // Valid frames for someone else: the victim's token (no secret: its link group is
        // named after it) with a key that is not the one its session was issued. Before the
        // key, the leave reaped the victim and its credit went to the next comer.
        (
            "leave_for_another",
            Raw(
                "cast".into(),
                enc(&NodeNotice::Leave {
                    token: victim,
                    key: 1,
                }),
                false,
            ),
        ),
        (
            "give_for_another",
            Raw(
                "cast".into(),
                enc(&NodeNotice::Give {
                    token: victim,
                    key: 1,
                    authority: "host".into(),
                    bytes: 1,
                    ticket: 0,
                }),
                false,
            ),
        ),
        (
            "report_for_another",
            Raw(
                "cast".into(),
                enc(&NodeNotice::Report {
                    token: victim,
                    key: 1,
                    authority: "host".into(),
                    approved: 0,
                    os_bytes: 0,
                    model: "spoof".into(),
                    prefixes: None,
                }),
                false,
            ),
        ),
        (
            "ask_for_another",
            Raw(
                "call".into(),
                encr(&NodeRequest::Ask {
                    token: victim,
                    key: 1,
                    authority: "host".into(),
                    bytes: 1 << 20,
                    at_least: 1,
                    wait_ms: 0,
                }),
                true,
            ),
        ),
        (
            "join_as_another",
            Raw(
                "call".into(),
                encr(&NodeRequest::Join {
                    token: victim,
                    key: 0,
                    pid: std::process::id(),
                    name: "impostor".into(),
                    priority: 0,
                    authority: "host".into(),
                    held: 1 << 20,
                    share: Share::default(),
                }),
                true,
            ),
        ),
    ];
    let _ = WireError::Invalid("");
    for (kind, frame) in frames {
        let _ = raw.cast(frame);
        say(format!("SENT {kind}"));
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    say("DONE".into());
    let _keep: ractor::ActorRef<NodeMsg> = node.into();
    std::future::pending::<()>().await;
}

/// A router's view: prints `SUMMARY node credit models` for every node, every 100 ms.
async fn run_watch() {
    let nodes: Vec<SocketAddr> = env("NODES")
        .split(',')
        .map(|p| SocketAddr::from(([127, 0, 0, 1], p.parse().unwrap())))
        .collect();
    let watch = procmem_actors::node::ClusterWatch::connect(nodes, COOKIE)
        .await
        .unwrap();
    loop {
        for (s, _) in watch.latest() {
            // Per model: processes, blocks held, and a router's reading of two prompts: one
            // the server cached, one nobody sent (`name:n:blocks:whole:hit:miss`).
            let models: Vec<String> = s
                .models
                .iter()
                .map(|m| {
                    let bt = m.prefixes.first().map_or(0, |p| p.block_tokens as usize);
                    let whole = prompt_keys(&prompt(1), bt).len() * bt;
                    let (hit, miss) = (m.cached_tokens(&prompt(1)), m.cached_tokens(&prompt(999)));
                    format!(
                        "{}:{}:{}:{whole}:{hit}:{miss}",
                        m.model, m.processes, m.cached_blocks
                    )
                })
                .collect();
            say(format!(
                "SUMMARY {} {} {} {}",
                s.node,
                s.authorities[0].1,
                s.authorities[0].2,
                models.join(",")
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// The orchestration, in the test process.

struct Proc {
    child: Child,
    lines: Receiver<String>,
}

impl Proc {
    fn spawn(role: &str, vars: &[(&str, String)]) -> Proc {
        Proc::spawn_under(&[], role, vars)
    }

    /// The role run by `wrapper` (`unshare --pid --fork`, say) where one is given.
    fn spawn_under(wrapper: &[&str], role: &str, vars: &[(&str, String)]) -> Proc {
        let exe = std::env::current_exe().unwrap();
        let mut cmd = match wrapper.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(exe);
                c
            }
            None => Command::new(exe),
        };
        cmd.args([
            "--exact",
            "node_role",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE, role)
        .env("RUST_LOG", "off")
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
        for (k, v) in vars {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                // The harness prints its own "test node_role ... " before the role's first line.
                let line = match line.strip_prefix("test node_role ... ") {
                    Some(rest) => rest.to_string(),
                    None => line,
                };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Proc { child, lines }
    }

    /// The next line starting with `prefix` (others are handed to `seen`), within `within`.
    fn wait(&self, prefix: &str, within: Duration, mut seen: impl FnMut(&str)) -> String {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.starts_with(prefix) => return line,
                Ok(line) => seen(&line),
                Err(RecvTimeoutError::Timeout) => panic!("no {prefix:?} within {within:?}"),
                Err(RecvTimeoutError::Disconnected) => panic!("child exited before {prefix:?}"),
            }
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// `total capacity rejected reaped tickets [(pid, credit, connected)]` of a STATUS line.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Status {
    total: u64,
    capacity: u64,
    rejected: u64,
    reaped: u64,
    tickets: u64,
    procs: Vec<(u32, u64, bool)>,
    foreign: u64,
}

impl Status {
    /// The node credit of the server `p` (0 where the node does not list it).
    fn credit_of(&self, p: &Proc) -> u64 {
        self.procs
            .iter()
            .find(|(pid, _, _)| *pid == p.pid())
            .map_or(0, |(_, c, _)| *c)
    }
}

/// A server's variables for one round of bursts, started when the test creates `go.0`.
fn one_round(go: &std::path::Path) -> [(&'static str, String); 2] {
    [
        ("ROUNDS", "1".to_string()),
        ("GO", go.to_string_lossy().into_owned()),
    ]
}

/// A `BURST r total_ms longest_wait_ms` line of a server's rounds: the two figures.
fn burst_round(line: &str) -> Vec<u64> {
    line.split(' ')
        .skip(2)
        .map(|v| v.parse().unwrap())
        .collect()
}

fn parse(line: &str) -> Status {
    let f: Vec<&str> = line.split(' ').collect();
    let procs = f
        .get(6)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.split(',')
                .map(|p| {
                    let v: Vec<&str> = p.split(':').collect();
                    (v[0].parse().unwrap(), v[1].parse().unwrap(), v[2] == "1")
                })
                .collect()
        })
        .unwrap_or_default();
    Status {
        total: f[1].parse().unwrap(),
        capacity: f[2].parse().unwrap(),
        rejected: f[3].parse().unwrap(),
        reaped: f[4].parse().unwrap(),
        tickets: f[5].parse().unwrap(),
        procs,
        foreign: f[7].parse().unwrap(),
    }
}

/// The node's latest status line (lines queue up while the test does other things); every
/// line read on the way is checked: approved credit never exceeds the node's capacity.
fn status(node: &Proc) -> Status {
    latest_status(node, true)
}

/// [`status`], checking that the credit is within the capacity only where `within` (a node
/// whose capacity was lowered holds more until its processes give back).
fn latest_status(node: &Proc, within: bool) -> Status {
    let check = |line: &str| {
        let s = parse(line);
        assert!(
            !within || s.total <= s.capacity,
            "credit over capacity: {s:?}"
        );
        s
    };
    let mut s = check(&node.wait("STATUS", Duration::from_secs(5), |_| {}));
    while let Ok(line) = node.lines.try_recv() {
        if line.starts_with("STATUS") {
            s = check(&line);
        }
    }
    s
}

/// Waits for a status that satisfies `pred`.
fn status_until(node: &Proc, within: Duration, pred: impl Fn(&Status) -> bool) -> Status {
    status_until_checked(node, within, true, pred)
}

/// [`status_until`], the credit checked against the capacity only where `checked`.
fn status_until_checked(
    node: &Proc,
    within: Duration,
    checked: bool,
    pred: impl Fn(&Status) -> bool,
) -> Status {
    let deadline = Instant::now() + within;
    loop {
        let s = latest_status(node, checked);
        if pred(&s) {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "node never reached it; last {s:?}"
        );
    }
}

/// Bytes the kernel holds in `pid`'s memfds (the servers' KV, mapped or cached unmapped):
/// `st_blocks` of each memfd, through `/proc/<pid>/fd`.
fn shmem(pid: u32) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return 0;
    };
    fds.flatten()
        .filter(|fd| {
            std::fs::read_link(fd.path()).is_ok_and(|t| t.to_string_lossy().starts_with("/memfd:"))
        })
        .filter_map(|fd| std::fs::metadata(fd.path()).ok())
        .map(|m| m.blocks() * 512)
        .sum()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn node(capacity: u64) -> (Proc, u16) {
    node_named(capacity, "procmem-node")
}

fn node_named(capacity: u64, name: &str) -> (Proc, u16) {
    node_with(capacity, &[("NODE_NAME", name.to_string())])
}

fn node_with(capacity: u64, more: &[(&str, String)]) -> (Proc, u16) {
    let port = free_port();
    let mut vars = vec![
        ("PORT", port.to_string()),
        ("CAPACITY", capacity.to_string()),
    ];
    vars.extend(more.iter().cloned());
    let node = Proc::spawn("node", &vars);
    node.wait("READY", Duration::from_secs(20), |_| {});
    (node, port)
}

fn server(port: u16, name: &str, priority: u32, cache: u64, burst: u64) -> Proc {
    server_with(port, name, priority, cache, burst, &[])
}

fn server_with(
    port: u16,
    name: &str,
    priority: u32,
    cache: u64,
    burst: u64,
    more: &[(&str, String)],
) -> Proc {
    let mut vars = vec![
        ("PORT", port.to_string()),
        ("NAME", name.to_string()),
        ("PRIORITY", priority.to_string()),
        ("CACHE", cache.to_string()),
        ("BURST", burst.to_string()),
    ];
    vars.extend(more.iter().cloned());
    Proc::spawn("server", &vars)
}

/// Samples the kernel's figures for both servers until `until` prints `prefix`; returns the
/// largest sum seen and the line.
fn sample_until(servers: &[&Proc], until: &Proc, prefix: &str, within: Duration) -> (u64, String) {
    let deadline = Instant::now() + within;
    let mut peak = 0;
    loop {
        let sum: u64 = servers.iter().map(|p| shmem(p.pid())).sum();
        peak = peak.max(sum);
        match until.lines.try_recv() {
            Ok(line) if line.starts_with(prefix) => return (peak, line),
            Ok(_) => {}
            Err(_) => std::thread::sleep(Duration::from_millis(2)),
        }
        assert!(Instant::now() < deadline, "no {prefix:?} within {within:?}");
    }
}

#[test]
fn two_servers_share_one_budget_and_a_burst_evicts_the_idle_servers_cache() {
    let budget = 12 * MIB;
    let (node, port) = node(budget);
    // A caches 8 prompts (8 MiB) and idles; B then needs 6 MiB more than is free.
    let a = server(port, "idle", 0, 8, 0);
    let (a_peak, _) = sample_until(&[&a], &a, "CACHED", Duration::from_secs(60));
    assert!(a_peak >= 7 * MIB, "A really holds its cache: {a_peak}");
    let b = server(port, "bursty", 5, 0, 8);
    let (peak, line) = sample_until(&[&a, &b], &b, "BURST", Duration::from_secs(60));
    let f: Vec<u64> = line
        .split(' ')
        .skip(1)
        .map(|v| v.parse().unwrap())
        .collect();
    let s = status(&node);
    eprintln!(
        "node_budget: budget {budget} B, peak of both servers' memfd bytes {peak} B, A after {} B, \
         B {} B; burst first grant {} ms, 8 sequences {} ms; tickets {}",
        shmem(a.pid()),
        shmem(b.pid()),
        f[0],
        f[1],
        s.tickets
    );
    assert!(
        peak <= budget,
        "the kernel held {peak} B for the two, over {budget}"
    );
    assert!(s.tickets > 0, "the idle server was asked");
    assert!(
        shmem(a.pid()) < 7 * MIB,
        "the idle server's cache was evicted"
    );
    assert!(shmem(b.pid()) >= 7 * MIB, "the burst got its memory");
    common::figure("node_budget", 1, 1);
}

/// A word file for the servers, fresh.
fn word(name: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("procmem-node-{name}-{}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    path
}

fn signal(p: &Proc, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &p.pid().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig}");
}

/// Two servers, each guaranteed half of 12 MiB. One holds 9 MiB in open sequences it never
/// closes; the other, under its guarantee, needs 4 MiB and gets them from the first (its
/// sequences preempted, in its own process), not after its conversations end: they never do.
#[test]
fn a_process_under_its_guarantee_gets_its_room_while_another_holds_it_in_live_sequences() {
    let budget = 12 * MIB;
    let (node, port) = node(budget);
    let a = server(port, "holder", 0, 0, 9);
    a.wait("BURST", Duration::from_secs(60), |_| {});
    let go = word("go-guarantee");
    let b = server_with(
        port,
        "entitled",
        0,
        0,
        4,
        &[("GO", go.to_string_lossy().into_owned())],
    );
    b.wait("CACHED", Duration::from_secs(60), |_| {});
    let before = status_until(&node, Duration::from_secs(5), |s| s.procs.len() == 2);
    std::fs::write(&go, b"go").unwrap();
    // Its opens wait 3 s for room at most and the child stops at the first refusal.
    let (peak, line) = sample_until(&[&a, &b], &b, "BURST", Duration::from_secs(30));
    let _ = std::fs::remove_file(&go);
    let f: Vec<u64> = line
        .split(' ')
        .skip(1)
        .map(|v| v.parse().unwrap())
        .collect();
    let after = status(&node);
    let credit = |s: &Status, p: &Proc| s.procs.iter().find(|x| x.0 == p.pid()).unwrap().1;
    eprintln!(
        "node_guarantee: holder {} B -> {} B of credit, entitled {} B -> {} B; 4 sequences in {} ms; \
         both servers' memfd bytes at most {peak} B of {budget}",
        credit(&before, &a),
        credit(&after, &a),
        credit(&before, &b),
        credit(&after, &b),
        f[1]
    );
    assert!(peak <= budget, "{peak} B held");
    assert!(credit(&after, &b) >= 4 * MIB, "{after:?}");
    assert!(
        credit(&after, &a) >= budget / 2,
        "the holder keeps its guarantee: {after:?}"
    );
    common::figure("node_guarantee", 1, 1);
}

/// The holder is stopped (SIGSTOP) while over its guarantee: it cannot give, so what it holds
/// above its guarantee is taken back in the books once it has been silent a second, and the
/// process under its guarantee gets its room. Continued, the stopped process's holders make
/// the room at once; the books never go below its guarantee and count no frame as hostile.
#[test]
fn a_stopped_process_over_its_guarantee_does_not_keep_the_other_waiting() {
    let budget = 12 * MIB;
    let (node, port) = node(budget);
    let a = server(port, "stopped", 0, 0, 9);
    a.wait("BURST", Duration::from_secs(60), |_| {});
    let go = word("go-stopped");
    let b = server_with(
        port,
        "waiting",
        0,
        0,
        4,
        &[("GO", go.to_string_lossy().into_owned())],
    );
    b.wait("CACHED", Duration::from_secs(60), |_| {});
    let before = status_until(&node, Duration::from_secs(5), |s| s.procs.len() == 2);
    signal(&a, "-STOP");
    let stopped = Instant::now();
    std::fs::write(&go, b"go").unwrap();
    let line = b.wait("BURST", Duration::from_secs(30), |_| {});
    let waited = stopped.elapsed();
    let _ = std::fs::remove_file(&go);
    let during = status(&node);
    let credit = |s: &Status, p: &Proc| s.procs.iter().find(|x| x.0 == p.pid()).unwrap().1;
    let (a_held, b_held) = (shmem(a.pid()), shmem(b.pid()));
    signal(&a, "-CONT");
    let after = status_until(&node, Duration::from_secs(5), |s| {
        s.procs.len() == 2 && shmem(a.pid()) <= credit(s, &a)
    });
    eprintln!(
        "node_sigstop: stopped holder {} B -> {} B of credit (memfd {a_held} B while stopped, \
         {} B after SIGCONT); the waiting server's 4 sequences done {} ms after the stop \
         ({line}); both held {} B of {budget} while stopped",
        credit(&before, &a),
        credit(&during, &a),
        shmem(a.pid()),
        waited.as_millis(),
        a_held + b_held,
    );
    assert!(
        credit(&during, &a) >= budget / 2,
        "never below its guarantee"
    );
    assert!(credit(&during, &b) >= 4 * MIB);
    assert_eq!(after.rejected, before.rejected, "no frame counted hostile");
    assert!(after.total <= after.capacity);
    common::figure("node_sigstop", 1, 1);
}

/// An idle server holds one prompt every conversation used (hot) and four used once (cold),
/// under its guarantee; a burst that needs all of the node (its own 3 cold prompts and 9
/// sequences) takes the cold ones and its own cache, and the hot prompt is still there when the idle server's next conversation comes.
#[test]
fn an_idle_processs_hot_prefix_survives_another_processs_burst() {
    let budget = 12 * MIB;
    let (node, port) = node(budget);
    let probe = word("probe");
    let a = server_with(
        port,
        "idle",
        0,
        4,
        0,
        &[
            ("HOT", "3".into()),
            ("PROBE", probe.to_string_lossy().into_owned()),
        ],
    );
    a.wait("CACHED", Duration::from_secs(60), |_| {});
    let b = server(port, "bursty", 0, 3, 9);
    let (peak, _) = sample_until(&[&a, &b], &b, "BURST", Duration::from_secs(60));
    let s = status(&node);
    std::fs::write(&probe, b"probe").unwrap();
    let cached: usize = a.wait("PROBE", Duration::from_secs(10), |_| {})[6..]
        .parse()
        .unwrap();
    let _ = std::fs::remove_file(&probe);
    eprintln!(
        "node_hot_prefix: the idle server's hot prompt {cached} of {PROMPT} tokens cached after \
         the burst; idle server memfd {} B, burst {} B, at most {peak} B of {budget}; tickets {}",
        shmem(a.pid()),
        shmem(b.pid()),
        s.tickets
    );
    assert!(peak <= budget);
    assert!(
        cached + 16 >= PROMPT,
        "the hot prompt was evicted: {cached} cached"
    );
    common::figure("node_hot_prefix", 1, 1);
}

#[test]
fn a_server_killed_with_sigkill_gets_its_credit_back_within_a_second() {
    let (node, port) = node(12 * MIB);
    let mut a = server(port, "victim", 0, 4, 0);
    a.wait("CACHED", Duration::from_secs(60), |_| {});
    let go = std::env::temp_dir().join(format!("procmem-node-go-{}", std::process::id()));
    let _ = std::fs::remove_file(&go);
    let b = server_with(
        port,
        "survivor",
        5,
        2,
        9,
        &[("GO", go.to_string_lossy().into_owned())],
    );
    b.wait("CACHED", Duration::from_secs(60), |_| {});
    let before = status_until(&node, Duration::from_secs(5), |s| s.procs.len() == 2);
    let a_pid = a.pid();
    let a_credit = before.procs.iter().find(|p| p.0 == a_pid).unwrap().1;
    assert!(a_credit >= 4 * MIB);
    let killed = Instant::now();
    a.kill9();
    let after = status_until(&node, Duration::from_secs(5), |s| s.procs.len() == 1);
    let back = killed.elapsed();
    let b_credit = after.procs[0].1;
    eprintln!(
        "node_kill9: {a_credit} B of credit back {} ms after SIGKILL; node total {} B = B's credit {b_credit} B",
        back.as_millis(),
        after.total
    );
    assert!(back < Duration::from_secs(1), "credit back after {back:?}");
    assert_eq!(after.total, b_credit, "books: only the survivor's credit");
    assert!(
        shmem(b.pid()) <= b_credit,
        "the survivor's memory is within its credit"
    );
    assert_eq!(after.reaped, before.reaped + 1);
    // The survivor goes on, into what the dead one held: 2 + 9 MiB of a 12 MiB budget.
    std::fs::write(&go, b"go").unwrap();
    let (peak, _) = sample_until(&[&b], &b, "BURST", Duration::from_secs(60));
    let _ = std::fs::remove_file(&go);
    let end = status(&node);
    assert!(
        peak >= 10 * MIB && peak <= end.capacity,
        "the survivor grew to {peak}"
    );
    common::figure("node_kill9", 1, 1);
}

#[test]
fn a_restarted_node_rebuilds_its_books_from_the_processes_and_approves_no_byte_twice() {
    let budget = 8 * MIB;
    let (mut node1, port) = node(budget);
    let a = server(port, "holder", 0, 5, 0);
    a.wait("CACHED", Duration::from_secs(60), |_| {});
    let before = status_until(&node1, Duration::from_secs(5), |s| s.procs.len() == 1);
    let held = before.procs[0].1;
    node1.kill9();
    // A new node on the same port: the process rejoins with what it holds.
    let node2 = Proc::spawn(
        "node",
        &[("PORT", port.to_string()), ("CAPACITY", budget.to_string())],
    );
    node2.wait("READY", Duration::from_secs(20), |_| {});
    let rebuilt = status_until(&node2, Duration::from_secs(10), |s| s.procs.len() == 1);
    assert_eq!(
        rebuilt.procs[0].1, held,
        "rebuilt from the process's report"
    );
    assert_eq!(rebuilt.total, held);
    // Another process asks for more than is free: it gets only what is free (A's memory is
    // not approved twice), the rest by A giving back under a ticket.
    let b = server(port, "newcomer", 5, 0, 5);
    let (peak, _) = sample_until(&[&a, &b], &b, "BURST", Duration::from_secs(60));
    let end = status(&node2);
    eprintln!(
        "node_restart: A held {held} B before the restart, {} B in the rebuilt books; \
         with a newcomer the peak of both servers' memfd bytes was {peak} B of {budget} B",
        rebuilt.procs[0].1
    );
    assert!(peak <= budget && end.total <= budget);
    common::figure("node_restart", 1, 1);
}

/// Raw TCP: what anyone on the machine can send to the node's port before authenticating.
fn raw_frames(port: u16) -> Vec<(&'static str, Vec<u8>)> {
    let frame = |len: u64, body: &[u8]| [len.to_be_bytes().to_vec(), body.to_vec()].concat();
    vec![
        ("random_bytes", vec![0x5a; 300]),
        ("length_u64_max", frame(u64::MAX, b"x")),
        ("length_zero", frame(0, b"")),
        ("length_over_limit", frame(1 << 40, &[0; 16])),
        ("valid_length_garbage_body", frame(32, &[0xff; 32])),
        ("truncated_frame", frame(1000, &[1; 10])),
        (
            "http_request",
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
        ),
        ("one_byte", vec![7]),
    ]
    .into_iter()
    .inspect(|_| assert!(port > 0))
    .collect()
}

#[test]
fn hostile_frames_leave_the_node_running_and_its_books_unchanged() {
    let (node, port) = node(8 * MIB);
    let a = server(port, "bystander", 0, 2, 0);
    let token: u64 = a.wait("JOINED", Duration::from_secs(30), |_| {})[7..]
        .parse()
        .unwrap();
    a.wait("CACHED", Duration::from_secs(60), |_| {});
    let before = status_until(&node, Duration::from_secs(5), |s| s.procs.len() == 1);
    let mut kinds = 0;
    let mut survived = 0;
    for (kind, bytes) in raw_frames(port) {
        kinds += 1;
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let _ = s.write_all(&bytes);
        let _ = s.set_read_timeout(Some(Duration::from_millis(100)));
        let _ = s.read(&mut [0u8; 64]);
        drop(s);
        let now = status(&node);
        if now.procs == before.procs && now.total == before.total {
            survived += 1;
        } else {
            eprintln!("hostile {kind}: books changed: {now:?}");
        }
    }
    // A peer with the wrong cookie never reaches the node Governor.
    let wrong = Proc::spawn(
        "hostile",
        &[
            ("PORT", port.to_string()),
            ("COOKIE", "not-the-cookie".into()),
            ("VICTIM", token.to_string()),
        ],
    );
    wrong.wait("NOJOIN", Duration::from_secs(20), |_| {});
    kinds += 1;
    survived += 1;
    // A peer with the cookie, sending malformed and invalid payloads through real sessions.
    let evil = Proc::spawn(
        "hostile",
        &[
            ("PORT", port.to_string()),
            ("COOKIE", COOKIE.into()),
            ("VICTIM", token.to_string()),
        ],
    );
    let mut sent = Vec::new();
    evil.wait("DONE", Duration::from_secs(30), |l| {
        if let Some(k) = l.strip_prefix("SENT ") {
            sent.push(k.to_string());
        }
    });
    let after = status_until(&node, Duration::from_secs(5), |s| {
        s.rejected >= before.rejected + sent.len() as u64
    });
    kinds += sent.len();
    if after.procs == before.procs && after.total == before.total {
        survived += sent.len();
    }
    eprintln!(
        "hostile_frames: {kinds} kinds ({} raw TCP, 1 wrong cookie, {} through the session: {}), \
         {} rejected frames counted, books {} B before and after",
        raw_frames(port).len(),
        sent.len(),
        sent.join(" "),
        after.rejected - before.rejected,
        after.total
    );
    assert_eq!(after.procs, before.procs, "books unchanged");
    assert!(kinds >= 10);
    common::figure("hostile_frames", survived, kinds);
    assert_eq!(survived, kinds);
    // Valid frames for another process: each refused and counted as foreign, none applied.
    let spoofs = sent
        .iter()
        .filter(|k| k.ends_with("_for_another") || k.ends_with("_as_another"))
        .count() as u64;
    let foreign = after.foreign - before.foreign;
    let refused = if after.procs == before.procs {
        foreign.min(spoofs)
    } else {
        0
    };
    // (`give_more_than_credit` names the victim too, without its key: one more foreign.)
    eprintln!(
        "node_spoof: {spoofs} valid frames for another process, {foreign} frames refused as \
         foreign, books unchanged"
    );
    common::figure("node_spoof", refused as usize, spoofs as usize);
    assert_eq!(spoofs, 5);
    assert!(foreign >= spoofs, "{foreign} foreign frames counted");
}

#[test]
fn a_watcher_sees_every_node_and_the_prefixes_each_model_caches() {
    let (n1, p1) = node_named(16 * MIB, "node-one");
    let (n2, p2) = node_named(8 * MIB, "node-two");
    let a = server(p1, "server", 0, 3, 0);
    a.wait("CACHED", Duration::from_secs(60), |_| {});
    let watch = Proc::spawn("watch", &[("NODES", format!("{p1},{p2}"))]);
    let deadline = Instant::now() + Duration::from_secs(20);
    let (mut one, mut two) = (None, None);
    while one.is_none() || two.is_none() {
        assert!(
            Instant::now() < deadline,
            "not every node seen: {one:?} {two:?}"
        );
        let line = watch.wait("SUMMARY", Duration::from_secs(20), |_| {});
        let f: Vec<&str> = line.split(' ').collect();
        match f[1] {
            // Node one: the server's model, with the prefixes it cached (3 prompts): a router
            // finds every whole block of a prompt it sent, and none of one nobody sent.
            "node-one" if f.get(4).is_some_and(|m| m.starts_with("smol:1:")) => {
                let m: Vec<usize> = f[4]
                    .split(':')
                    .skip(2)
                    .map(|x| x.parse().unwrap())
                    .collect();
                let [blocks, whole, hit, miss] = m[..] else {
                    panic!("{line}")
                };
                if blocks > 0 && hit == whole {
                    assert!(whole > 0, "{line}");
                    assert_eq!(miss, 0, "{line}");
                    one = Some(line.clone())
                }
            }
            "node-two" => two = Some(line.clone()),
            _ => {}
        }
    }
    eprintln!("cluster_view: {} | {}", one.unwrap(), two.unwrap());
    drop((n1, n2, a));
    common::figure("cluster_view", 1, 1);
}

/// A server in its own PID namespace (`unshare --pid --fork`: its own pid is 1) joins over the
/// node's Unix socket; the node watches the pid the kernel gives for that socket, so a SIGKILL
/// gives its credit back (issue 27, item 3: the node watched its own pid 1 and kept 64 MiB
/// credited to the dead process).
#[test]
fn a_server_in_a_pid_namespace_is_watched_as_the_process_it_is() {
    let probe = Command::new("unshare")
        .args(["--pid", "--fork", "--kill-child", "true"])
        .status();
    if !probe.is_ok_and(|s| s.success()) {
        eprintln!("SKIPPED: unshare --pid needs root here");
        return;
    }
    let (node, port) = node(8 * MIB);
    let mut a = Proc::spawn_under(
        &["unshare", "--pid", "--fork", "--kill-child"],
        "server",
        &[
            ("PORT", port.to_string()),
            ("NAME", "contained".into()),
            ("PRIORITY", "0".into()),
            ("CACHE", "3".into()),
            ("BURST", "0".into()),
        ],
    );
    a.wait("CACHED", Duration::from_secs(60), |_| {});
    let before = status_until(&node, Duration::from_secs(5), |s| {
        s.procs.len() == 1 && s.procs[0].0 != 1
    });
    let (pid, credit, _) = before.procs[0];
    assert!(credit > 0);
    let killed = Instant::now();
    a.kill9();
    let after = status_until(&node, Duration::from_secs(5), |s| s.procs.is_empty());
    eprintln!(
        "node_pid_namespace: a server whose own pid is 1 was watched as pid {pid}; its {credit} B of \
         credit came back {} ms after SIGKILL; node total {} B",
        killed.elapsed().as_millis(),
        after.total
    );
    assert_eq!(after.total, 0);
    assert_eq!(after.reaped, before.reaped + 1);
    common::figure("node_pid_namespace", 1, 1);
}

/// A server the kernel cannot name (joined over TCP only) is watched by its session: its
/// credit comes back once the session has been gone for the grace, never from a pid it sent.
#[test]
fn a_server_over_tcp_is_watched_by_its_session() {
    let (node, port) = node(8 * MIB);
    let mut a = server_with(port, "remote", 0, 3, 0, &[("TCP_ONLY", "1".into())]);
    a.wait("CACHED", Duration::from_secs(60), |_| {});
    let before = status_until(&node, Duration::from_secs(5), |s| s.procs.len() == 1);
    let credit = before.procs[0].1;
    let killed = Instant::now();
    a.kill9();
    let after = status_until(&node, Duration::from_secs(10), |s| s.procs.is_empty());
    let back = killed.elapsed();
    eprintln!(
        "node_session_watch: {credit} B of credit back {} ms after SIGKILL (grace 2 s)",
        back.as_millis()
    );
    assert!(
        back >= Duration::from_millis(1500),
        "reaped before its grace: {back:?}"
    );
    assert_eq!(after.total, 0);
    common::figure("node_session_watch", 1, 1);
}

/// A process that rejoined a restarted node holds the key the new node issued: its leave is
/// honoured (before, the `NodeLink` kept the first node's key, the leave was refused as
/// foreign, and the credit stayed until the process exited).
#[test]
fn a_leave_after_a_node_restart_carries_the_new_key() {
    let budget = 8 * MIB;
    let (mut node1, port) = node(budget);
    let leave = std::env::temp_dir().join(format!("procmem-node-leave-{}", std::process::id()));
    let _ = std::fs::remove_file(&leave);
    let a = server_with(
        port,
        "leaver",
        0,
        2,
        0,
        &[("LEAVE", leave.to_string_lossy().into_owned())],
    );
    a.wait("CACHED", Duration::from_secs(60), |_| {});
    status_until(&node1, Duration::from_secs(5), |s| s.procs.len() == 1);
    node1.kill9();
    let node2 = Proc::spawn(
        "node",
        &[("PORT", port.to_string()), ("CAPACITY", budget.to_string())],
    );
    node2.wait("READY", Duration::from_secs(20), |_| {});
    let rejoined = status_until(&node2, Duration::from_secs(10), |s| s.procs.len() == 1);
    std::fs::write(&leave, b"leave").unwrap();
    a.wait("LEFT", Duration::from_secs(10), |_| {});
    let after = status_until(&node2, Duration::from_secs(5), |s| s.procs.is_empty());
    let _ = std::fs::remove_file(&leave);
    eprintln!(
        "node_rejoin_leave: {} B of credit rejoined, back after the leave; foreign frames {}",
        rejoined.procs[0].1, after.foreign
    );
    assert_eq!(after.total, 0);
    assert_eq!(after.foreign, 0, "the leave carried the key in force");
}

/// Issue 46: a process holding all of the node's credit, some of it free, needs more than is
/// free. The node has nobody else to ask, so it sends no ticket storm: the asker is never
/// ticketed for the bytes its own ask waits for (before, it gave its free bytes back, the
/// node granted them straight back to its ask, and round again: 387,963 tickets in one
/// real run).
#[test]
fn a_process_waiting_for_room_is_not_ticketed_for_its_own_ask() {
    let (node, port) = node(4 * MIB + MIB / 2);
    let a = server(port, "a", 0, 0, 8);
    let full = status_until(&node, Duration::from_secs(30), |s| {
        s.total + MIB > s.capacity && s.procs.len() == 1
    });
    std::thread::sleep(Duration::from_millis(1500));
    let later = status(&node);
    let sent = later.tickets - full.tickets;
    eprintln!(
        "node_storm: one process holding {} of {} bytes, short of room: {sent} tickets in 1.5 s",
        later.total, later.capacity
    );
    assert!(
        sent <= 3,
        "a ticket storm: {sent} tickets in 1.5 s ({later:?})"
    );
    drop(a);
}

#[test]
fn bursts_that_move_between_three_servers_move_the_credit_with_them() {
    // Three servers of one priority, 3 MiB of cached prompts each, under 12 MiB; a burst of
    // 6 MiB moves from one to the next. Each burst needs room the others hold as cache.
    let capacity = 12 * MIB;
    let (node, port) = node(capacity);
    let dir = tempfile::tempdir().unwrap();
    let go = |name: &str| dir.path().join(name);
    let servers: Vec<Proc> = ["a", "b", "c"]
        .iter()
        .map(|name| {
            let vars = one_round(&go(name));
            let p = server_with(port, name, 0, 3, 6, &vars);
            p.wait("CACHED", Duration::from_secs(60), |_| {});
            p
        })
        .collect();
    let mut answered = 0;
    for (i, (name, p)) in ["a", "b", "c"].iter().zip(&servers).enumerate() {
        let before = status(&node);
        std::fs::write(go(&format!("{name}.0")), b"").unwrap();
        let line = p.wait("BURST", Duration::from_secs(60), |_| {});
        let f = burst_round(&line);
        let after = status(&node);
        let credit = |s: &Status| s.credit_of(p);
        eprintln!(
            "node_moving_bursts: burst {i} on {name}: 6 sequences in {} ms, longest wait for \
             room {} ms; its credit {} -> {} of {capacity} B; {} tickets",
            f[0],
            f[1],
            credit(&before),
            credit(&after),
            after.tickets - before.tickets
        );
        assert!(
            credit(&after) >= 5 * MIB,
            "the credit moved to the server in its burst (what its store maps may be a few \
             granules short of 6 MiB): {before:?} -> {after:?}"
        );
        assert!(
            f[1] < 1000,
            "a step of the burst waited {} ms for room the others held as cache",
            f[1]
        );
        answered += 1;
    }
    common::figure("node_moving_bursts", answered, 3);
}

#[test]
fn a_busy_process_does_not_keep_the_node_from_asking_an_idle_one() {
    // The least important server is busy all the time (what it uses moves every few steps)
    // and holds little; an idle one holds 6 MiB of cached prompts; a burst of 6 MiB needs
    // what the idle one holds. Asking the busy one again each time its usage moved would
    // never reach the idle one.
    let capacity = 12 * MIB;
    let (node, port) = node(capacity);
    let dir = tempfile::tempdir().unwrap();
    let go = dir.path().join("go");
    let busy = server_with(port, "busy", 0, 1, 0, &[("CHURN", "1".into())]);
    busy.wait("CACHED", Duration::from_secs(60), |_| {});
    let idle = server(port, "idle", 1, 6, 0);
    idle.wait("CACHED", Duration::from_secs(60), |_| {});
    let vars = one_round(&go);
    let burst = server_with(port, "burst", 2, 0, 6, &vars);
    burst.wait("JOINED", Duration::from_secs(60), |_| {});
    std::thread::sleep(Duration::from_millis(500));
    let before = status(&node);
    std::fs::write(dir.path().join("go.0"), b"").unwrap();
    let line = burst.wait("BURST", Duration::from_secs(60), |_| {});
    let f = burst_round(&line);
    let after = status(&node);
    let credit = |s: &Status, p: &Proc| s.credit_of(p);
    eprintln!(
        "node_busy_neighbour: burst of 6 sequences in {} ms, longest wait for room {} ms; \
         credit busy {} -> {}, idle {} -> {}, burst {} -> {} of {capacity} B; {} tickets",
        f[0],
        f[1],
        credit(&before, &busy),
        credit(&after, &busy),
        credit(&before, &idle),
        credit(&after, &idle),
        credit(&before, &burst),
        credit(&after, &burst),
        after.tickets - before.tickets
    );
    // The credit follows what the store maps, which may be a few granules short of 6 MiB.
    assert!(
        credit(&after, &burst) >= 5 * MIB,
        "the burst got its room: {after:?}"
    );
    assert!(
        credit(&after, &idle) < credit(&before, &idle),
        "the idle server was asked and gave: {before:?} -> {after:?}"
    );
    assert!(
        f[1] < 1000,
        "a step of the burst waited {} ms for room",
        f[1]
    );
    common::figure("node_busy_neighbour", 1, 1);
}

/// Issue 46, 3: the machine shrinks under a node. Its capacity follows a cgroup (here files in
/// a directory, read as the kernel's are: `memory.high` falls from none to 7 MiB, 1 MiB kept
/// for what is held outside the books); two servers holding its 12 MiB as cached prompts give
/// back until the books, and the bytes the kernel holds in their memfds, are within the new
/// capacity. Lifted again, a burst gets its room back.
#[test]
fn a_node_following_a_shrinking_cgroup_takes_credit_back_from_its_processes() {
    let group = tempfile::tempdir().unwrap();
    let file = |name: &str, text: &str| std::fs::write(group.path().join(name), text).unwrap();
    file("memory.max", "max\n");
    file("memory.high", "max\n");
    file("memory.current", "0\n");
    file("memory.stat", "anon 0\ninactive_file 0\n");
    file(
        "memory.pressure",
        "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n\
         full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
    );
    let capacity = 12 * MIB;
    let dir = group.path().to_string_lossy().into_owned();
    let (node, port) = node_with(capacity, &[("FOLLOW", dir)]);
    let go = group.path().join("go");
    let a = server(port, "a", 0, 6, 0);
    a.wait("CACHED", Duration::from_secs(60), |_| {});
    let vars = one_round(&go);
    let b = server_with(port, "b", 0, 5, 6, &vars);
    b.wait("CACHED", Duration::from_secs(60), |_| {});
    let full = status_until(&node, Duration::from_secs(10), |s| s.total >= 10 * MIB);
    let held_full = shmem(a.pid()) + shmem(b.pid());
    let start = Instant::now();
    file("memory.high", &format!("{}\n", 7 * MIB));
    let shrunk = status_until_checked(&node, Duration::from_secs(10), false, |s| {
        s.capacity == 6 * MIB && s.total <= s.capacity
    });
    let took = start.elapsed();
    // What the kernel holds follows the books (a store punches out what it evicts).
    let deadline = Instant::now() + Duration::from_secs(5);
    let held = loop {
        let held = shmem(a.pid()) + shmem(b.pid());
        if held <= 6 * MIB || Instant::now() > deadline {
            break held;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    file("memory.high", "max\n");
    status_until(&node, Duration::from_secs(5), |s| s.capacity == capacity);
    std::fs::write(group.path().join("go.0"), b"").unwrap();
    let line = b.wait("BURST", Duration::from_secs(60), |_| {});
    let after = status(&node);
    eprintln!(
        "node_follows_machine: credit {} B of {} B (memfds {held_full} B); limit 7 MiB: \
         credit {} B of {} B in {} ms ({} tickets), memfds {held} B; lifted: burst {line:?}, \
         its credit {} B",
        full.total,
        full.capacity,
        shrunk.total,
        shrunk.capacity,
        took.as_millis(),
        shrunk.tickets - full.tickets,
        after.credit_of(&b)
    );
    assert!(
        took < Duration::from_secs(3),
        "the books took {took:?} to come under the lowered capacity"
    );
    assert!(
        held <= 6 * MIB,
        "the kernel still holds {held} B for the two"
    );
    assert!(
        after.credit_of(&b) >= 5 * MIB,
        "the burst got its room once the limit was lifted: {after:?}"
    );
    common::figure("node_follows_machine", 1, 1);
}

/// A process holding most of the node's credit as cached prompts needs room for new ones, and
/// nobody else can give: the node refuses its ask at once and its own store evicts. Before,
/// its Governor asked only the node for what it lacked (the node decides who gives), the node
/// had nobody to ask, and each step waited out the ask (a real main job stalled for 10 s).
#[test]
fn a_process_alone_on_the_node_makes_room_from_its_own_cache() {
    let (node, port) = node(6 * MIB);
    let dir = tempfile::tempdir().unwrap();
    let go = dir.path().join("go");
    let vars = one_round(&go);
    let a = server_with(port, "alone", 0, 5, 3, &vars);
    a.wait("CACHED", Duration::from_secs(60), |_| {});
    let before = status(&node);
    std::fs::write(dir.path().join("go.0"), b"").unwrap();
    let line = a.wait("BURST", Duration::from_secs(60), |_| {});
    let f = burst_round(&line);
    let after = status(&node);
    eprintln!(
        "node_alone: {} B of {} B held as cache; a burst of 3 sequences in {} ms, longest wait \
         for room {} ms; {} node tickets",
        before.total,
        before.capacity,
        f[0],
        f[1],
        after.tickets - before.tickets
    );
    assert!(
        f[1] < 1000,
        "a step waited {} ms for room its own cache held",
        f[1]
    );
    common::figure("node_alone", 1, 1);
}
