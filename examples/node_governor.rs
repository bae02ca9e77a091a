//! The node Governor of one machine: several server processes share its budget.
//!
//! ```text
//! cargo run --release --example node_governor -- --authority host=8GiB --metrics-addr 127.0.0.1:9465
//! cargo run --release --example inference_server -- --node 127.0.0.1:7341 --requests 200
//! cargo run --release --example inference_server -- --node 127.0.0.1:7341 --node-priority 5
//! ```
//!
//! Processes join it with `ractor_cluster` (the cookie authenticates them; loopback unless told
//! otherwise). It prints its books once a second: per authority the capacity and the credit
//! approved, per process its credit and what it last reported the OS holds for it.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use procmem_actors::machine::{HostPressure, LinuxSource};
use procmem_actors::node::{NodeConfig, NodeHandle};
use procmem_actors::procmem::host::machine::PressurePolicy;

#[derive(Parser, Debug)]
#[command(about = "The node Governor: one memory budget for several server processes")]
struct Args {
    /// The node's name in the cluster (default `procmem-node:<port>`).
    #[arg(long)]
    name: Option<String>,
    /// TCP port of the cluster node.
    #[arg(long, default_value_t = 7341)]
    port: u16,
    /// Address to listen on.
    #[arg(long, default_value_t = IpAddr::V4(Ipv4Addr::LOCALHOST))]
    listen: IpAddr,
    /// The cookie processes must present.
    #[arg(long, default_value = "procmem")]
    cookie: String,
    /// An authority and its capacity, NAME=BYTES (e.g. host=8GiB, cuda:0=60GiB); repeatable.
    #[arg(long = "authority", value_parser = parse_authority, default_value = "host=1GiB")]
    authorities: Vec<(String, u64)>,
    /// Serve Prometheus metrics of the node's books here (off unless given).
    #[arg(long)]
    metrics_addr: Option<SocketAddr>,
    /// After a start, approve nothing for this long, so that processes holding credit from
    /// before a restart rejoin (and are counted) before a newcomer is served.
    #[arg(long, default_value_t = 1500)]
    rejoin_grace_ms: u64,
    /// The host authority's capacity follows the memory cgroup this node runs in (start it and
    /// its servers in one group): the limit less what the group holds outside the books, cut
    /// further under memory pressure. A lowered capacity asks the servers to give back.
    #[arg(long)]
    follow_machine: bool,
    /// Stop after this many seconds (0: run until killed).
    #[arg(long, default_value_t = 0)]
    run_for: u64,
}

fn parse_authority(s: &str) -> Result<(String, u64), String> {
    let (name, bytes) = s
        .split_once('=')
        .ok_or_else(|| format!("'{s}' is not NAME=BYTES"))?;
    if name.is_empty() || name.len() > procmem_actors::node::wire::MAX_NAME {
        return Err(format!("'{name}' is not an authority name"));
    }
    let bytes = procmem_model::launch::parse_bytes(bytes).map_err(|e| e.to_string())?;
    Ok((name.to_string(), bytes))
}

fn main() -> ExitCode {
    let args = Args::parse();
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    rt.block_on(async move {
        let defaults = NodeConfig::new(args.cookie.clone(), args.port, "host", 0);
        let config = NodeConfig {
            name: args.name.clone().unwrap_or(defaults.name.clone()),
            port: args.port,
            listen: args.listen,
            authorities: args.authorities.clone(),
            metrics: args.metrics_addr,
            rejoin_grace: Duration::from_millis(args.rejoin_grace_ms),
            ..defaults
        };
        let node = match NodeHandle::start(config).await {
            Ok(node) => node,
            Err(e) => {
                eprintln!("cannot start the node Governor: {e}");
                return ExitCode::FAILURE;
            }
        };
        println!(
            "node Governor on {}:{} ({}){}",
            args.listen,
            args.port,
            args.authorities
                .iter()
                .map(|(n, b)| format!("{n} {b} B"))
                .collect::<Vec<_>>()
                .join(", "),
            args.metrics_addr
                .map(|a| format!(", metrics on http://{a}/metrics"))
                .unwrap_or_default()
        );
        let _follow = follow(&args, &node);
        let start = std::time::Instant::now();
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            print_status(&node).await;
            if args.run_for > 0 && start.elapsed() >= Duration::from_secs(args.run_for) {
                node.stop();
                return ExitCode::SUCCESS;
            }
        }
    })
}

/// With `--follow-machine`, the host authority's capacity follows this process's cgroup.
fn follow(args: &Args, node: &NodeHandle) -> Option<HostPressure> {
    match args.authorities.iter().find(|(n, _)| n == "host") {
        Some((_, capacity)) if args.follow_machine => {
            let source = LinuxSource::detect();
            match source.cgroup() {
                Some((dir, _)) => println!("host capacity follows {}", dir.display()),
                None => {
                    println!("no memory cgroup found: the host capacity stays {capacity} B")
                }
            }
            Some(HostPressure::spawn_for_node(
                node.clone(),
                "host",
                PressurePolicy::new(*capacity),
                source,
                Duration::from_millis(500),
            ))
        }
        _ => None,
    }
}

/// A line per authority: capacity, credit, and each process's credit.
async fn print_status(node: &NodeHandle) {
    if let Some(s) = node.status().await {
        for (name, capacity, credit) in &s.authorities {
            let procs: Vec<String> = s
                .processes
                .iter()
                .filter(|p| &p.authority == name)
                .map(|p| {
                    format!(
                        "{}[{}] credit {} os {}{}",
                        p.name,
                        p.pid,
                        p.credit,
                        p.os_bytes,
                        if p.connected { "" } else { " (cut off)" }
                    )
                })
                .collect();
            println!(
                "{name}: capacity {capacity} credit {credit} waiting {} tickets {} | {}",
                s.waiting,
                s.tickets,
                procs.join(" | ")
            );
        }
    }
}
