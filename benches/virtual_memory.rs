//! Growing a `VirtualBuffer` one granule at a time against raw `mmap(MAP_FIXED)` of memfd
//! blocks, and reading a grown buffer against reading a `Vec`, side by side in one run.
//! Writes `target/reports/virtual_memory.json`.
#![allow(unsafe_code, dead_code)]

mod common;

use std::hint::black_box;
use std::os::fd::AsFd;

use procmem::host::HostMechanism;
use procmem::{MemoryRole, VirtualBuffer};
use rustix::fs::{fallocate, ftruncate, memfd_create, FallocateFlags, MemfdFlags};
use rustix::mm::{mmap, mmap_anonymous, munmap, MapFlags, ProtFlags};
use serde_json::json;

use common::{ns_per, write_report};

const GROW_GRANULES: u64 = 2048;
const ROUNDS: usize = 31;
const READ_BYTES: u64 = 32 << 20;

fn grow_ours(host: &HostMechanism, g: u64) -> f64 {
    let mut buf =
        VirtualBuffer::new(host.backing(), GROW_GRANULES * g, MemoryRole::KvCache).unwrap();
    let t = ns_per(GROW_GRANULES, || {
        for _ in 0..GROW_GRANULES {
            buf.grow(g).unwrap();
        }
    });
    black_box(&buf);
    t
}

/// The same physical result by hand: a PROT_NONE reservation, then each granule a
/// `mmap(MAP_SHARED | MAP_FIXED | MAP_POPULATE)` of a memfd block (the populate allocates the
/// page and maps it, as our commit does). `with_fallocate` adds the explicit allocation that
/// our commit makes so that running out of memory is an error instead of a later SIGBUS.
fn grow_raw(g: u64, with_fallocate: bool) -> f64 {
    let len = (GROW_GRANULES * g) as usize;
    let fd = memfd_create("bench-raw", MemfdFlags::CLOEXEC).unwrap();
    ftruncate(&fd, len as u64).unwrap();
    // SAFETY: a fresh PROT_NONE reservation chosen by the kernel; nothing is replaced.
    let base = unsafe {
        mmap_anonymous(
            std::ptr::null_mut(),
            len,
            ProtFlags::empty(),
            MapFlags::PRIVATE | MapFlags::NORESERVE,
        )
    }
    .unwrap() as u64;
    let t = ns_per(GROW_GRANULES, || {
        for i in 0..GROW_GRANULES {
            let off = i * g;
            if with_fallocate {
                fallocate(&fd, FallocateFlags::empty(), off, g).unwrap();
            }
            // SAFETY: the target lies inside the reservation made above, which nothing else uses.
            unsafe {
                mmap(
                    (base + off) as usize as *mut _,
                    g as usize,
                    ProtFlags::READ | ProtFlags::WRITE,
                    MapFlags::SHARED | MapFlags::FIXED | MapFlags::POPULATE,
                    fd.as_fd(),
                    off,
                )
            }
            .unwrap();
        }
    });
    // SAFETY: the whole reservation is ours and nothing refers into it any more.
    unsafe { munmap(base as usize as *mut _, len) }.unwrap();
    t
}

fn sum(bytes: &[u8]) -> u64 {
    bytes
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .fold(0u64, u64::wrapping_add)
}

/// Reads a grown buffer of `bytes` (grown as the KV store grows, a chunk of 64 granules at a
/// time) and a `Vec` of the same size, interleaved round by round, and says how each is
/// backed: its mappings in `/proc/self/maps` and the bytes of it on huge pages.
fn read_side_by_side(host: &HostMechanism, bytes: u64, rounds: usize) -> serde_json::Value {
    let chunk = 64 * procmem::granularity();
    let mut buf = VirtualBuffer::new(host.backing(), bytes, MemoryRole::KvCache).unwrap();
    while buf.len() < bytes {
        buf.grow(chunk.min(bytes - buf.len())).unwrap();
    }
    for (i, b) in buf.as_mut_slice().unwrap().iter_mut().enumerate() {
        *b = i as u8;
    }
    let vec: Vec<u8> = (0..bytes).map(|i| i as u8).collect();
    let ours = buf.as_slice().unwrap();
    assert_eq!(sum(ours), sum(&vec));
    let (mut read_ours, mut read_vec) = (Vec::new(), Vec::new());
    // Which goes first alternates, so neither always reads right after the other evicted it.
    for round in 0..rounds {
        let mut ours_ns = || {
            read_ours.push(ns_per(bytes, || {
                black_box(sum(black_box(ours)));
            }))
        };
        if round % 2 == 0 {
            ours_ns();
            read_vec.push(ns_per(bytes, || {
                black_box(sum(black_box(&vec)));
            }));
        } else {
            read_vec.push(ns_per(bytes, || {
                black_box(sum(black_box(&vec)));
            }));
            ours_ns();
        }
    }
    // The ratio is the median of each round's own ratio (the two reads of a round are
    // back to back, so drift on a shared machine cancels in it).
    let mut paired: Vec<f64> = read_vec
        .iter()
        .zip(&read_ours)
        .map(|(v, o)| v / o)
        .collect();
    paired.sort_by(|a, b| a.total_cmp(b));
    read_ours.sort_by(|a, b| a.total_cmp(b));
    read_vec.sort_by(|a, b| a.total_cmp(b));
    let (o, v) = (read_ours[rounds / 2], read_vec[rounds / 2]);
    let span = |p: *const u8| p as u64..p as u64 + bytes;
    let (ours_maps, ours_huge) = mappings(span(ours.as_ptr()));
    let (vec_maps, vec_huge) = mappings(span(vec.as_ptr()));
    json!({
        "bytes": bytes,
        "rounds": rounds,
        "read_ns_per_byte": o,
        "vec_read_ns_per_byte": v,
        "read_vs_vec_ratio": paired[rounds / 2],
        "mappings": ours_maps,
        "vec_mappings": vec_maps,
        "huge_page_bytes": ours_huge,
        "vec_huge_page_bytes": vec_huge,
    })
}

/// The mappings of `/proc/self/smaps` that overlap `range`, and their bytes on huge pages
/// (anonymous, shmem or file PMD mappings).
fn mappings(range: std::ops::Range<u64>) -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let (mut count, mut huge_kb, mut inside) = (0, 0u64, false);
    for line in text.lines() {
        let head = line.split_whitespace().next().unwrap_or("");
        if let Some((a, b)) = head.split_once('-') {
            if let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) {
                inside = a < range.end && b > range.start;
                count += u64::from(inside);
                continue;
            }
        }
        if !inside {
            continue;
        }
        for field in ["AnonHugePages:", "ShmemPmdMapped:", "FilePmdMapped:"] {
            if let Some(kb) = line.strip_prefix(field) {
                huge_kb += kb
                    .trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<u64>()
                    .unwrap_or(0);
            }
        }
    }
    (count, huge_kb * 1024)
}

/// The size of the largest cache `cpu0` reports (the last level), in bytes.
fn llc_bytes() -> u64 {
    let mut best = 0;
    for i in 0..8 {
        let dir = format!("/sys/devices/system/cpu/cpu0/cache/index{i}");
        let Ok(size) = std::fs::read_to_string(format!("{dir}/size")) else {
            break;
        };
        let size = size.trim();
        let (digits, unit) = size.split_at(size.trim_end_matches(['K', 'M', 'G']).len());
        let n: u64 = digits.parse().unwrap_or(0);
        let scale = match unit {
            "K" => 1 << 10,
            "M" => 1 << 20,
            "G" => 1 << 30,
            _ => 1,
        };
        best = best.max(n * scale);
    }
    best
}

/// The kernel's transparent huge page settings, for anonymous memory and for shmem (memfd).
fn thp_settings() -> serde_json::Value {
    let read = |f: &str| {
        std::fs::read_to_string(format!("/sys/kernel/mm/transparent_hugepage/{f}"))
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "unknown".into())
    };
    json!({"enabled": read("enabled"), "shmem_enabled": read("shmem_enabled")})
}

const CUDA_GRANULES: u64 = 256;
/// Granules per growth call in the chunked CUDA growth (the KV store grows in chunks).
const CUDA_CHUNK_GRANULES: u64 = 32;

/// The CUDA part: growing a VMM-backed buffer one granule at a time (handles from the pool)
/// against raw `cuMemMap` + `cuMemSetAccess` of handles created up front. `None` with the
/// reason where there is no driver or device.
fn cuda_growth() -> serde_json::Value {
    use procmem::cuda::{driver_present, CudaAccess, CudaDevice, CudaMechanism};
    use procmem::VirtualBacking;
    if !driver_present() {
        return json!({"skipped": "no CUDA driver (libcuda cannot be loaded on this machine)"});
    }
    if CudaDevice::count() == 0 {
        return json!({"skipped": "a CUDA driver is present but reports no device"});
    }
    let m = CudaMechanism::new(0, CUDA_GRANULES as usize).unwrap();
    let backing = m.backing();
    let g = VirtualBacking::granularity(backing.as_ref());
    let device = m.device().clone();
    let mut ours = Vec::new();
    let mut chunked = Vec::new();
    let mut raw = Vec::new();
    for _ in 0..9 {
        // Growth as the KV store does it: a chunk of granules per call (one access grant
        // for the whole chunk).
        let mut buf =
            VirtualBuffer::new(backing.clone(), CUDA_GRANULES * g, MemoryRole::KvCache).unwrap();
        chunked.push(ns_per(CUDA_GRANULES, || {
            for _ in 0..CUDA_GRANULES / CUDA_CHUNK_GRANULES {
                buf.grow(CUDA_CHUNK_GRANULES * g).unwrap();
            }
        }));
        drop(buf);
        let mut buf =
            VirtualBuffer::new(backing.clone(), CUDA_GRANULES * g, MemoryRole::KvCache).unwrap();
        ours.push(ns_per(CUDA_GRANULES, || {
            for _ in 0..CUDA_GRANULES {
                buf.grow(g).unwrap();
            }
        }));
        drop(buf);
        let range = device.reserve(CUDA_GRANULES * g, g).unwrap();
        let handles: Vec<_> = (0..CUDA_GRANULES)
            .map(|_| device.create_handle(g).unwrap())
            .collect();
        raw.push(ns_per(CUDA_GRANULES, || {
            for (i, h) in handles.iter().enumerate() {
                // SAFETY: granule i of a fresh reservation, nothing mapped there yet.
                unsafe {
                    device
                        .map(range.ptr() + i as u64 * g, h, CudaAccess::ReadWrite)
                        .unwrap()
                };
            }
        }));
        for i in 0..CUDA_GRANULES {
            // SAFETY: mapped above, unused by any stream.
            unsafe { device.unmap(range.ptr() + i * g, g).unwrap() };
        }
    }
    ours.sort_by(|a, b| a.total_cmp(b));
    chunked.sort_by(|a, b| a.total_cmp(b));
    raw.sort_by(|a, b| a.total_cmp(b));
    let (o, r) = (ours[ours.len() / 2], raw[raw.len() / 2]);
    let c = chunked[chunked.len() / 2];
    json!({
        "granule_bytes": g,
        "granules_per_round": CUDA_GRANULES,
        "grow_ns_per_granule": o,
        "raw_map_ns_per_granule": r,
        "grow_vs_raw_ratio": o / r,
        "chunk_granules": CUDA_CHUNK_GRANULES,
        "grow_chunk_ns_per_granule": c,
    })
}

fn main() {
    let host = HostMechanism::new().unwrap();
    let g = procmem::granularity();

    // Interleave the strategies round by round so drift on a shared machine hits both.
    let mut ours = Vec::new();
    let mut raw = Vec::new();
    let mut raw_falloc = Vec::new();
    for _ in 0..ROUNDS {
        ours.push(grow_ours(&host, g));
        raw.push(grow_raw(g, false));
        raw_falloc.push(grow_raw(g, true));
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    let grow_ns = med(&mut ours);
    let raw_ns = med(&mut raw);
    let raw_falloc_ns = med(&mut raw_falloc);

    let mut reads = serde_json::Map::new();
    let mut ratio_32m = 0.0;
    for (key, bytes, rounds) in [
        ("32m", READ_BYTES, ROUNDS),
        ("256m", 256 << 20, 9),
        ("1g", 1 << 30, 11),
    ] {
        let r = read_side_by_side(&host, bytes, rounds);
        if key == "32m" {
            ratio_32m = r["read_vs_vec_ratio"].as_f64().unwrap();
        }
        reads.insert(
            format!("read_vs_vec_ratio_{key}"),
            r["read_vs_vec_ratio"].clone(),
        );
        reads.insert(format!("read_{key}"), r);
    }

    write_report(
        "virtual_memory",
        &json!({
            "granule_bytes": g,
            "granules_per_round": GROW_GRANULES,
            "rounds": ROUNDS,
            "grow_ns_per_granule": grow_ns,
            "raw_mmap_ns_per_granule": raw_ns,
            "raw_fallocate_mmap_ns_per_granule": raw_falloc_ns,
            "grow_vs_raw_ratio": grow_ns / raw_ns,
            "grow_vs_raw_fallocate_ratio": grow_ns / raw_falloc_ns,
            "read_bytes": READ_BYTES,
            "read_vs_vec_ratio": ratio_32m,
            "llc_bytes": llc_bytes(),
            "transparent_hugepage": thp_settings(),
            "reads": reads,
            "cuda": cuda_growth(),
        }),
    );
}
