//! The metrics endpoint listens nowhere unless told, and only where told: a manager built
//! without an address opens no listening socket; one given a loopback address listens on
//! that address alone, not on every interface. (Its own test binary: the listening sockets
//! are read per process, and the metrics recorder is process-global.)

use std::collections::HashSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener};

use procmem_actors::MemoryManager;

/// Local addresses of the TCP sockets this process is listening on, IPv4 and IPv6, from
/// `/proc/net/tcp{,6}` joined with the socket inodes of `/proc/self/fd`.
fn listening() -> Vec<SocketAddr> {
    let mine: HashSet<String> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_owned())
        })
        .collect();
    let mut out = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // f[1] = local "ADDRESS:PORT" (hex, address in 32-bit little-endian words),
            // f[3] = state (0A = LISTEN), f[9] = inode.
            if f.len() < 10 || f[3] != "0A" || !mine.contains(f[9]) {
                continue;
            }
            let Some((ip, port)) = f[1].split_once(':') else {
                continue;
            };
            let port = u16::from_str_radix(port, 16).unwrap();
            let words: Vec<u32> = (0..ip.len() / 8)
                .map(|i| {
                    u32::from_str_radix(&ip[8 * i..8 * i + 8], 16)
                        .unwrap()
                        .swap_bytes()
                })
                .collect();
            let addr = match words.as_slice() {
                [v4] => IpAddr::V4(Ipv4Addr::from(*v4)),
                [a, b, c, d] => {
                    let mut bytes = [0u8; 16];
                    for (i, w) in [a, b, c, d].into_iter().enumerate() {
                        bytes[4 * i..4 * i + 4].copy_from_slice(&w.to_be_bytes());
                    }
                    IpAddr::V6(Ipv6Addr::from(bytes))
                }
                _ => panic!("unexpected address {ip} in {table}"),
            };
            out.push(SocketAddr::new(addr, port));
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_endpoint_listens_nowhere_unless_told_and_only_where_told() {
    assert!(listening().is_empty(), "listening before anything started");
    let quiet = MemoryManager::builder()
        .host_budget(1 << 20)
        .build()
        .await
        .unwrap();
    assert!(
        listening().is_empty(),
        "a manager without a metrics address listens: {:?}",
        listening()
    );
    quiet.shutdown().await.unwrap();

    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let served = MemoryManager::builder()
        .host_budget(1 << 20)
        .metrics_addr(addr)
        .build()
        .await
        .unwrap();
    let sockets = listening();
    assert_eq!(
        sockets,
        vec![addr],
        "listens on the loopback address it was given, and nowhere else"
    );
    served.shutdown().await.unwrap();
}
