//! memtop: a live view of a procmem metrics endpoint in the terminal.
//!
//! ```sh
//! cargo run --release --example inference_server -- --metrics-addr 127.0.0.1:9464 --linger 60 &
//! cargo run --release --example memtop -- 127.0.0.1:9464
//! ```
//!
//! Once a second it scrapes the endpoint (a server's, or a node Governor's) and redraws: per
//! authority a bar of approved, committed and OS-resident bytes against the capacity, the
//! drift and the waiting requests; per holder its bytes, the sequences and tokens of a KV
//! store, its preemptions and prefix hit rate, a residency's layers; the last pressure tickets
//! (told apart by the per-holder ticket counters between two scrapes); and, from a node
//! Governor, each process's credit. `q` (or Esc, or Ctrl-C) quits; an endpoint that closes
//! ends it with a line saying so, and one that cannot be reached at start is reported and
//! memtop exits with status 1.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::process::ExitCode;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant, SystemTime};

use clap::Parser;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Cell, LineGauge, Paragraph, Row, Table};
use ratatui::{DefaultTerminal, Frame};

#[derive(Parser, Debug)]
#[command(about = "A live view of a procmem metrics endpoint")]
struct Args {
    /// The endpoint: `host:port` or `http://host:port/metrics`.
    #[arg(default_value = "127.0.0.1:9464")]
    endpoint: String,
    /// Seconds between refreshes.
    #[arg(long, default_value_t = 1.0)]
    interval: f64,
}

/// One sample of the Prometheus text format.
#[derive(Debug, Clone)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// One scrape, parsed.
#[derive(Debug, Default)]
struct Scrape {
    samples: Vec<Sample>,
}

impl Scrape {
    /// Parses the text exposition format (comments skipped; a line that does not parse is
    /// skipped rather than trusted).
    fn parse(text: &str) -> Scrape {
        let samples = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .filter_map(parse_line)
            .collect();
        Scrape { samples }
    }

    /// Samples of `name` whose labels include every pair of `with`.
    fn series<'a>(
        &'a self,
        name: &'a str,
        with: &'a [(&'a str, &'a str)],
    ) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples.iter().filter(move |s| {
            s.name == name
                && with
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).is_some_and(|x| x == v))
        })
    }

    /// The sum of the samples of `name` matching `with` (None when there is none).
    fn get(&self, name: &str, with: &[(&str, &str)]) -> Option<f64> {
        let mut found = self.series(name, with).peekable();
        found.peek()?;
        Some(found.map(|s| s.value).sum())
    }

    /// The values of `label` over the samples of `name`, sorted, once each.
    fn label_values(&self, name: &str, label: &str) -> Vec<String> {
        let set: BTreeSet<String> = self
            .series(name, &[])
            .filter_map(|s| s.labels.get(label).cloned())
            .collect();
        set.into_iter().collect()
    }
}

fn parse_line(line: &str) -> Option<Sample> {
    let (name, rest) = match line.find(['{', ' ']) {
        Some(i) => line.split_at(i),
        None => return None,
    };
    let mut labels = BTreeMap::new();
    let rest = if let Some(body) = rest.strip_prefix('{') {
        let mut chars = body.char_indices();
        let end;
        loop {
            // key="value", with \" \\ \n escapes in the value
            let mut key = String::new();
            let mut c = chars.next()?;
            while c.1 == ',' || c.1 == ' ' {
                c = chars.next()?;
            }
            if c.1 == '}' {
                end = c.0;
                break;
            }
            while c.1 != '=' {
                key.push(c.1);
                c = chars.next()?;
            }
            if chars.next()?.1 != '"' {
                return None;
            }
            let mut value = String::new();
            loop {
                match chars.next()?.1 {
                    '"' => break,
                    '\\' => match chars.next()?.1 {
                        'n' => value.push('\n'),
                        other => value.push(other),
                    },
                    other => value.push(other),
                }
            }
            labels.insert(key, value);
        }
        &body[end + 1..]
    } else {
        rest
    };
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some(Sample {
        name: name.to_string(),
        labels,
        value,
    })
}

/// Where to scrape.
struct Endpoint {
    url: String,
    addr: SocketAddr,
    host: String,
    path: String,
}

impl Endpoint {
    fn parse(given: &str) -> Result<Endpoint, String> {
        let rest = given.strip_prefix("http://").unwrap_or(given);
        if rest.contains("://") {
            return Err(format!("{given}: only http:// endpoints are served"));
        }
        let (host, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/metrics"),
        };
        let addr = host
            .to_socket_addrs()
            .map_err(|e| format!("{given}: {e}"))?
            .next()
            .ok_or_else(|| format!("{given}: no address"))?;
        Ok(Endpoint {
            url: format!("http://{host}{path}"),
            addr,
            host: host.to_string(),
            path: path.to_string(),
        })
    }

    /// One scrape: the body of a `200 OK`, or why not. A whole scrape takes at most
    /// `SCRAPE_LIMIT`, however slowly the endpoint drips.
    fn scrape(&self) -> Result<String, Failed> {
        let started = Instant::now();
        let timeout = Duration::from_secs(2);
        let mut s = TcpStream::connect_timeout(&self.addr, timeout).map_err(Failed::io)?;
        s.set_read_timeout(Some(timeout)).map_err(Failed::io)?;
        write!(
            s,
            "GET {} HTTP/1.0\r\nHost: {}\r\nConnection: close\r\n\r\n",
            self.path, self.host
        )
        .map_err(Failed::io)?;
        let mut reply = Vec::new();
        let mut chunk = [0u8; 64 << 10];
        loop {
            let n = s.read(&mut chunk).map_err(Failed::io)?;
            if n == 0 {
                break;
            }
            reply.extend_from_slice(&chunk[..n]);
            if reply.len() > 64 << 20 || started.elapsed() > SCRAPE_LIMIT {
                return Err(Failed::slow(
                    "the endpoint's reply is too large or too slow",
                ));
            }
        }
        let reply = String::from_utf8_lossy(&reply);
        let Some((head, body)) = reply.split_once("\r\n\r\n") else {
            return Err(Failed {
                gone: true,
                why: "the connection closed before a reply".into(),
            });
        };
        let status = head.lines().next().unwrap_or_default();
        if status.split_whitespace().nth(1) != Some("200") {
            return Err(Failed::slow(&format!("the endpoint answered {status:?}")));
        }
        Ok(body.to_string())
    }
}

/// The most one scrape may take.
const SCRAPE_LIMIT: Duration = Duration::from_secs(5);

/// Why a scrape failed, and whether the endpoint is gone (nobody listens any more) rather
/// than slow or answering oddly.
#[derive(Debug)]
struct Failed {
    gone: bool,
    why: String,
}

impl Failed {
    fn io(e: std::io::Error) -> Failed {
        use std::io::ErrorKind::*;
        Failed {
            gone: matches!(
                e.kind(),
                ConnectionRefused | ConnectionReset | ConnectionAborted | NotConnected
            ),
            why: e.to_string(),
        }
    }

    fn slow(why: &str) -> Failed {
        Failed {
            gone: false,
            why: why.to_string(),
        }
    }
}

/// Bytes as an operator reads them (binary units, two decimals); exact below 1 KiB.
fn bytes(b: f64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    let sign = if b < 0.0 { "-" } else { "" };
    let mut v = b.abs();
    if v < 1024.0 {
        return format!("{sign}{v:.0} B");
    }
    let mut unit = 0;
    v /= 1024.0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{sign}{v:.2} {}", UNITS[unit])
}

/// A pressure ticket seen between two scrapes.
struct TicketEvent {
    at: SystemTime,
    authority: String,
    holder: String,
    tickets: f64,
    freed: f64,
}

/// What memtop keeps between refreshes.
struct View {
    endpoint: Arc<Endpoint>,
    /// Why the last scrape failed, while the endpoint is still there.
    stale: Option<String>,
    scrape: Scrape,
    at: SystemTime,
    /// Per (authority, holder): tickets and bytes freed at the last scrape.
    last_tickets: BTreeMap<(String, String), (f64, f64)>,
    events: VecDeque<TicketEvent>,
}

impl View {
    fn refresh(&mut self, text: &str) {
        self.scrape = Scrape::parse(text);
        self.at = SystemTime::now();
        for s in self
            .scrape
            .series("procmem_holder_pressure_tickets_total", &[])
        {
            let (Some(authority), Some(holder)) =
                (s.labels.get("authority"), s.labels.get("holder"))
            else {
                continue;
            };
            let with = [
                ("authority", authority.as_str()),
                ("holder", holder.as_str()),
            ];
            let freed = self
                .scrape
                .get("procmem_holder_pressure_freed_bytes_total", &with)
                .unwrap_or(0.0);
            let key = (authority.clone(), holder.clone());
            let (tickets_before, freed_before) = self
                .last_tickets
                .insert(key, (s.value, freed))
                .unwrap_or((0.0, 0.0));
            if s.value > tickets_before {
                self.events.push_front(TicketEvent {
                    at: self.at,
                    authority: authority.clone(),
                    holder: holder.clone(),
                    tickets: s.value - tickets_before,
                    freed: freed - freed_before,
                });
            }
        }
        self.events.truncate(50);
    }
}

fn clock(t: SystemTime) -> String {
    let secs = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    format!(
        "{:02}:{:02}:{:02}",
        (secs / 3600) % 24,
        (secs / 60) % 60,
        secs % 60
    )
}

fn draw(frame: &mut Frame, view: &View) {
    let m = &view.scrape;
    let authorities = m.label_values("procmem_governor_capacity_bytes", "authority");
    let node_authorities = m.label_values("procmem_node_capacity_bytes", "authority");
    let holders: Vec<(String, String)> = m
        .series("procmem_holder_approved_bytes", &[])
        .filter_map(|s| {
            Some((
                s.labels.get("authority")?.clone(),
                s.labels.get("holder")?.clone(),
            ))
        })
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let processes = m.label_values("procmem_node_process_credit_bytes", "process");
    let [title, books, holder_area, bottom] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Length((authorities.len() * 4 + node_authorities.len() * 3) as u16 + 2),
        Constraint::Length(holders.len().max(1) as u16 + 3),
        Constraint::Min(4),
    ])
    .areas(frame.area());
    frame.render_widget(
        Paragraph::new(Line::from(vec![
            Span::styled("memtop ", Style::new().add_modifier(Modifier::BOLD)),
            Span::raw(format!(
                "{}  refreshed {}  q quits  ",
                view.endpoint.url,
                clock(view.at)
            )),
            Span::styled(
                view.stale
                    .as_ref()
                    .map_or(String::new(), |why| format!("stale: {why}")),
                Style::new().fg(Color::Red),
            ),
        ])),
        title,
    );
    draw_books(frame, books, m, &authorities, &node_authorities);
    draw_holders(frame, holder_area, m, &holders);
    let [tickets, procs] =
        Layout::horizontal([Constraint::Percentage(60), Constraint::Percentage(40)]).areas(bottom);
    draw_tickets(frame, tickets, view);
    draw_processes(frame, procs, m, &processes, &node_authorities);
}

/// The pressure tickets seen between scrapes, newest last.
fn draw_tickets(frame: &mut Frame, area: Rect, view: &View) {
    let lines: Vec<Line> = view
        .events
        .iter()
        .map(|e| {
            Line::from(format!(
                "{}  {:<12} {:<8} tickets {:>3}  freed {}",
                clock(e.at),
                e.holder,
                e.authority,
                e.tickets,
                bytes(e.freed)
            ))
        })
        .collect();
    let lines = if lines.is_empty() {
        vec![Line::from("none since memtop started")]
    } else {
        lines
    };
    frame.render_widget(
        Paragraph::new(lines).block(
            Block::new()
                .borders(Borders::ALL)
                .title(" last pressure tickets "),
        ),
        area,
    );
}

/// From a node Governor each process's credit and OS bytes; from a server, its latencies.
fn draw_processes(
    frame: &mut Frame,
    procs: Rect,
    m: &Scrape,
    processes: &[String],
    node_authorities: &[String],
) {
    let mut lines: Vec<Line> = Vec::new();
    for p in processes {
        for a in node_authorities {
            let with = [("authority", a.as_str()), ("process", p.as_str())];
            if let Some(credit) = m.get("procmem_node_process_credit_bytes", &with) {
                let os = m.get("procmem_node_process_os_bytes", &with).unwrap_or(0.0);
                // A reaped process's series stay in the exporter at zero: not a row.
                if credit == 0.0 && os == 0.0 {
                    continue;
                }
                lines.push(Line::from(format!(
                    "{p:<10} {a:<6} credit {}  os {}",
                    bytes(credit),
                    bytes(os)
                )));
            }
        }
    }
    if lines.is_empty() {
        let latency = |name: &str| {
            quantile(m, name, 0.99).map_or("no samples".to_string(), |s| {
                format!("<= {:.0} us", s * 1e6)
            })
        };
        lines.push(Line::from(format!(
            "grant p99       {}",
            latency("procmem_governor_grant_seconds")
        )));
        lines.push(Line::from(format!(
            "refund p99      {}",
            latency("procmem_deferred_free_fence_to_refund_seconds")
        )));
        lines.push(Line::from(format!(
            "growth map p99  {}",
            latency("procmem_kv_growth_map_seconds")
        )));
    }
    let title = if processes.is_empty() {
        " latencies since start (bucket bounds) "
    } else {
        " processes (node) "
    };
    frame.render_widget(
        Paragraph::new(lines).block(Block::new().borders(Borders::ALL).title(title)),
        procs,
    );
}

/// The upper bound of the bucket holding quantile `q` of histogram `name` (every label set
/// summed), in seconds.
fn quantile(m: &Scrape, name: &str, q: f64) -> Option<f64> {
    let bucket = format!("{name}_bucket");
    let mut bounds: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
    for s in m.series(&bucket, &[]) {
        let le: f64 = match s.labels.get("le")?.as_str() {
            "+Inf" => f64::INFINITY,
            v => v.parse().ok()?,
        };
        bounds.entry(le.to_bits()).or_insert((le, 0.0)).1 += s.value;
    }
    let mut sorted: Vec<(f64, f64)> = bounds.into_values().collect();
    sorted.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total = sorted.last()?.1;
    if total <= 0.0 {
        return None;
    }
    sorted
        .into_iter()
        .find(|(_, count)| *count >= q * total)
        .map(|(le, _)| le)
}

fn draw_books(
    frame: &mut Frame,
    area: Rect,
    m: &Scrape,
    authorities: &[String],
    node_authorities: &[String],
) {
    let block = Block::new().borders(Borders::ALL).title(" authorities ");
    let inner = block.inner(area);
    frame.render_widget(block, area);
    // Four lines per authority (figures, then three bars), three per node authority.
    let lines = authorities.len() * 4 + node_authorities.len() * 3;
    let areas = Layout::vertical(vec![Constraint::Length(1); lines]).split(inner);
    let mut at = areas.iter();
    for a in authorities {
        let with = [("authority", a.as_str())];
        let get = |name: &str| m.get(name, &with).unwrap_or(0.0);
        let capacity = get("procmem_governor_capacity_bytes");
        let approved = get("procmem_governor_approved_bytes");
        let committed = get("procmem_governor_committed_bytes");
        let os = m.get("procmem_authority_os_resident_bytes", &with);
        let drift = m.get("procmem_authority_drift_bytes", &with);
        let line = format!(
            "{a:<8} capacity {}  waiting {}  drift {}  grants {}  denials {}  tickets {}",
            bytes(capacity),
            get("procmem_governor_waiting_requests"),
            drift.map_or("n/a".into(), bytes),
            get("procmem_governor_grants_total"),
            get("procmem_governor_denials_total"),
            get("procmem_governor_pressure_tickets_total"),
        );
        if let Some(r) = at.next() {
            frame.render_widget(
                Paragraph::new(line).style(Style::new().add_modifier(Modifier::BOLD)),
                *r,
            );
        }
        let bars = [
            ("approved ", Some(approved), Color::Yellow),
            ("committed", Some(committed), Color::Green),
            ("OS       ", os, Color::Cyan),
        ];
        for (label, value, color) in bars {
            if let Some(r) = at.next() {
                gauge(frame, *r, label, value, capacity, color);
            }
        }
    }
    for a in node_authorities {
        let with = [("authority", a.as_str())];
        let capacity = m.get("procmem_node_capacity_bytes", &with).unwrap_or(0.0);
        let credit = m.get("procmem_node_credit_bytes", &with).unwrap_or(0.0);
        if let Some(r) = at.next() {
            frame.render_widget(
                Paragraph::new(format!(
                    "node {a:<6} capacity {}  tickets {}",
                    bytes(capacity),
                    m.get("procmem_node_tickets_total", &with).unwrap_or(0.0)
                ))
                .style(Style::new().add_modifier(Modifier::BOLD)),
                *r,
            );
        }
        if let Some(r) = at.next() {
            gauge(
                frame,
                *r,
                "credit   ",
                Some(credit),
                capacity,
                Color::Yellow,
            );
        }
        let _ = at.next();
    }
}

fn gauge(
    frame: &mut Frame,
    area: Rect,
    label: &str,
    value: Option<f64>,
    capacity: f64,
    color: Color,
) {
    let ratio = match value {
        Some(v) if capacity > 0.0 => (v / capacity).clamp(0.0, 1.0),
        _ => 0.0,
    };
    let text = match value {
        Some(v) => format!("  {label} {:>12} {:>5.1}%", bytes(v), ratio * 100.0),
        None => format!("  {label} {:>12}", "n/a"),
    };
    frame.render_widget(
        LineGauge::default()
            .filled_style(Style::new().fg(color))
            .label(text)
            .ratio(ratio),
        area,
    );
}

fn draw_holders(frame: &mut Frame, area: Rect, m: &Scrape, holders: &[(String, String)]) {
    let header = Row::new(
        [
            "holder",
            "authority",
            "approved",
            "tickets",
            "freed",
            "seqs",
            "tokens",
            "preempt s/r",
            "prefix hit",
            "layers d/o",
            "tier below",
        ]
        .map(|h| Cell::from(h).style(Style::new().add_modifier(Modifier::BOLD))),
    );
    let rows = holders
        .iter()
        .map(|(authority, holder)| holder_row(m, authority, holder));
    let widths = [
        Constraint::Length(16),
        Constraint::Length(9),
        Constraint::Length(11),
        Constraint::Length(7),
        Constraint::Length(11),
        Constraint::Length(5),
        Constraint::Length(7),
        Constraint::Length(11),
        Constraint::Length(10),
        Constraint::Length(10),
        Constraint::Length(18),
    ];
    frame.render_widget(
        Table::new(rows, widths)
            .header(header)
            .block(Block::new().borders(Borders::ALL).title(" holders ")),
        area,
    );
}

/// One holder's row: its books, and a KV store's or a residency's figures.
fn holder_row(m: &Scrape, authority: &str, holder: &str) -> Row<'static> {
    let h = [("authority", authority), ("holder", holder)];
    let kv = [("store", holder), ("authority", authority)];
    let get = |name: &str, with: &[(&str, &str)]| m.get(name, with);
    let count = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v}"));
    let preempt = match (
        get(
            "procmem_kv_preemptions_total",
            &[kv[0], kv[1], ("mode", "swap")],
        ),
        get(
            "procmem_kv_preemptions_total",
            &[kv[0], kv[1], ("mode", "recompute")],
        ),
    ) {
        (Some(s), Some(r)) => format!("{s}/{r}"),
        _ => "-".into(),
    };
    let hit = match (
        get("procmem_kv_prefix_hit_tokens_total", &kv),
        get("procmem_kv_prefix_query_tokens_total", &kv),
    ) {
        (Some(hit), Some(q)) if q > 0.0 => format!("{:.1}%", 100.0 * hit / q),
        (Some(_), Some(_)) => "0.0%".into(),
        _ => "-".into(),
    };
    let r = [("holder", holder), ("authority", authority)];
    // Layers on the device / offloaded (to the host tier or disk).
    let placed = |p: &str| get("procmem_residency_layers", &[r[0], r[1], ("placement", p)]);
    let layers = match (placed("device"), placed("host"), placed("disk")) {
        (Some(d), host, disk) => format!("{d}/{}", host.unwrap_or(0.0) + disk.unwrap_or(0.0)),
        _ => "-".into(),
    };
    // The prefix cache's tier below (disk under host memory, host memory under a GPU):
    // blocks and bytes held, where the store has one.
    let tier = |kind: &str| {
        let blocks = get(&format!("procmem_kv_prefix_{kind}_blocks"), &kv)?;
        let held = get(&format!("procmem_kv_prefix_{kind}_bytes"), &kv)?;
        Some(format!("{kind} {blocks} {}", bytes(held)))
    };
    let disk = tier("disk")
        .or_else(|| tier("host"))
        .unwrap_or_else(|| "-".into());
    Row::new(vec![
        holder.to_string(),
        authority.to_string(),
        get("procmem_holder_approved_bytes", &h).map_or("-".into(), bytes),
        count(get("procmem_holder_pressure_tickets_total", &h)),
        get("procmem_holder_pressure_freed_bytes_total", &h).map_or("-".into(), bytes),
        count(get("procmem_kv_sequences", &kv)),
        count(get("procmem_kv_tokens", &kv)),
        preempt,
        hit,
        layers,
        disk,
    ])
}

/// Why the loop ended.
enum End {
    Quit,
    Closed(String),
}

fn run(
    terminal: &mut DefaultTerminal,
    view: &mut View,
    scrapes: &mpsc::Receiver<Result<String, Failed>>,
) -> std::io::Result<End> {
    loop {
        while let Ok(scraped) = scrapes.try_recv() {
            match scraped {
                Ok(text) => {
                    view.refresh(&text);
                    view.stale = None;
                }
                Err(f) if f.gone => return Ok(End::Closed(f.why)),
                Err(f) => view.stale = Some(f.why),
            }
        }
        terminal.draw(|f| draw(f, view))?;
        // Keys are read while a scrape runs on its own thread: a slow endpoint never keeps
        // `q` from working.
        if event::poll(Duration::from_millis(100))? {
            if let Event::Key(key) = event::read()? {
                let ctrl_c =
                    key.code == KeyCode::Char('c') && key.modifiers.contains(KeyModifiers::CONTROL);
                if key.kind == KeyEventKind::Press
                    && (matches!(key.code, KeyCode::Char('q') | KeyCode::Esc) || ctrl_c)
                {
                    return Ok(End::Quit);
                }
            }
        }
    }
}

/// Scrapes `endpoint` every `interval` on a thread of its own, until the receiver goes.
fn scraper(endpoint: Arc<Endpoint>, interval: Duration) -> mpsc::Receiver<Result<String, Failed>> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || loop {
        let started = Instant::now();
        if tx.send(endpoint.scrape()).is_err() {
            return;
        }
        std::thread::sleep(interval.saturating_sub(started.elapsed()));
    });
    rx
}

fn main() -> ExitCode {
    let args = Args::parse();
    if !(args.interval.is_finite() && (0.05..=3600.0).contains(&args.interval)) {
        eprintln!("memtop: --interval must be between 0.05 and 3600 seconds");
        return ExitCode::from(2);
    }
    let endpoint = match Endpoint::parse(&args.endpoint) {
        Ok(e) => e,
        Err(why) => {
            eprintln!("memtop: {why}");
            return ExitCode::from(2);
        }
    };
    // The first scrape before the screen is taken: an endpoint that cannot be reached is
    // said plainly on a normal terminal.
    let first = match endpoint.scrape() {
        Ok(text) => text,
        Err(f) => {
            eprintln!("memtop: cannot reach {}: {}", endpoint.url, f.why);
            return ExitCode::from(1);
        }
    };
    let endpoint = Arc::new(endpoint);
    let scrapes = scraper(
        Arc::clone(&endpoint),
        Duration::from_secs_f64(args.interval),
    );
    let mut view = View {
        endpoint,
        stale: None,
        scrape: Scrape::default(),
        at: SystemTime::now(),
        last_tickets: BTreeMap::new(),
        events: VecDeque::new(),
    };
    // Tickets sent before memtop started are history, not events.
    view.refresh(&first);
    view.events.clear();
    let mut terminal = ratatui::init();
    let ended = run(&mut terminal, &mut view, &scrapes);
    ratatui::restore();
    match ended {
        Ok(End::Quit) => ExitCode::SUCCESS,
        Ok(End::Closed(why)) => {
            println!(
                "memtop: {} closed ({why}); last refreshed at {}",
                view.endpoint.url,
                clock(view.at)
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("memtop: the terminal failed: {e}");
            ExitCode::from(1)
        }
    }
}
