//! The metrics endpoint listens nowhere unless told, and only where told: a manager built
//! without an address opens no listening socket; one given a loopback address listens on
//! that address alone, not on every interface. (Its own test binary: the listening sockets
//! are read per process, and the metrics recorder is process-global.)

use std::collections::HashSet;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener};

use procmem_actors::MemoryManager;

/// Local addresses of the TCP sockets this process is listening on (IPv4), from
/// `/proc/net/tcp` joined with the socket inodes of `/proc/self/fd`.
fn listening() -> Vec<SocketAddrV4> {
    let mine: HashSet<String> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_owned())
        })
        .collect();
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            // f[1] = local "AABBCCDD:PORT" (hex, address little-endian), f[3] = state
            // (0A = LISTEN), f[9] = inode.
            if f.len() < 10 || f[3] != "0A" || !mine.contains(f[9]) {
                return None;
            }
            let (ip, port) = f[1].split_once(':')?;
            let ip = u32::from_str_radix(ip, 16).ok()?;
            let port = u16::from_str_radix(port, 16).ok()?;
            Some(SocketAddrV4::new(Ipv4Addr::from(ip.swap_bytes()), port))
        })
        .collect()
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
        vec![SocketAddrV4::new(Ipv4Addr::LOCALHOST, port)],
        "listens on the loopback address it was given, and nowhere else"
    );
    served.shutdown().await.unwrap();
}
