//! What a router sees: every node Governor's summary, refreshed once a second.
//!
//! ```text
//! cargo run --release --example cluster_status -- --node 127.0.0.1:7341 --node 10.0.0.2:7341
//! ```
//!
//! It joins the cluster's watch group with the cookie; each node Governor publishes its
//! summary there twice a second: per authority the capacity, the credit approved and what is
//! free, the machine's memory pressure, and per model the processes serving it and the
//! prompt blocks they hold (a digest of their keys, in memory and on disk).
//!
//! `--route 1,2,3,...` (a prompt's token ids) prints, per node and model, how many tokens at
//! the prompt's start its processes may hold cached: where a router would send it.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use procmem_actors::node::ClusterWatch;

#[derive(Parser, Debug)]
#[command(about = "Every node Governor's figures, refreshed")]
struct Args {
    /// A node Governor's address; repeatable.
    #[arg(long = "node", required = true)]
    nodes: Vec<SocketAddr>,
    /// The cluster cookie.
    #[arg(long, default_value = "procmem")]
    cookie: String,
    /// Print this many refreshes, then exit (0: until killed).
    #[arg(long, default_value_t = 0)]
    count: u64,
    /// A prompt's token ids, comma-separated: print each node's cached start of it.
    #[arg(long, value_delimiter = ',')]
    route: Vec<u32>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let Ok(rt) = tokio::runtime::Runtime::new() else {
        eprintln!("cannot start the runtime");
        return ExitCode::FAILURE;
    };
    rt.block_on(async move {
        let watch = match ClusterWatch::connect(args.nodes.clone(), &args.cookie).await {
            Ok(w) => w,
            Err(e) => {
                eprintln!("cannot join the cluster: {e}");
                return ExitCode::FAILURE;
            }
        };
        let mut printed = 0;
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let latest = watch.latest();
            println!("-- {} of {} nodes reporting", latest.len(), args.nodes.len());
            for (s, age) in latest {
                let pressure = s
                    .pressure
                    .map_or("n/a".to_string(), |p| format!("{p:.1}%"));
                for (name, capacity, credit, free) in &s.authorities {
                    println!(
                        "{:<24} {name:<8} capacity {capacity:>14} credit {credit:>14} free {free:>14} \
                         pressure {pressure:>6} waiting {} (seen {} ms ago)",
                        s.node,
                        s.waiting,
                        age.as_millis()
                    );
                }
                for p in &s.processes {
                    println!(
                        "{:<24}   process {}[{}] {:<8} credit {:>14} approved {:>14}{}",
                        s.node,
                        p.name,
                        p.pid,
                        p.authority,
                        p.credit,
                        p.approved,
                        if p.connected { "" } else { " (cut off)" }
                    );
                }
                for m in &s.models {
                    let digests: Vec<String> = m
                        .prefixes
                        .iter()
                        .filter_map(|p| p.digest())
                        .map(|d| format!("{}-token blocks, {:.1}% set", d.block_tokens(), d.fill() * 100.0))
                        .collect();
                    println!(
                        "{:<24}   model {}: {} processes, {} cached blocks ({})",
                        s.node,
                        m.model,
                        m.processes,
                        m.cached_blocks,
                        digests.join("; ")
                    );
                    if !args.route.is_empty() {
                        println!(
                            "{:<24}   route: {} of the prompt's {} tokens may be cached here",
                            s.node,
                            m.cached_tokens(&args.route),
                            args.route.len()
                        );
                    }
                }
            }
            printed += 1;
            if args.count > 0 && printed >= args.count {
                watch.stop();
                return ExitCode::SUCCESS;
            }
        }
    })
}
