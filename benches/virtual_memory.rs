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

use common::{median_of, ns_per, write_report};

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

const CUDA_GRANULES: u64 = 256;

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
    let mut raw = Vec::new();
    for _ in 0..9 {
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
    raw.sort_by(|a, b| a.total_cmp(b));
    let (o, r) = (ours[ours.len() / 2], raw[raw.len() / 2]);
    json!({
        "granule_bytes": g,
        "granules_per_round": CUDA_GRANULES,
        "grow_ns_per_granule": o,
        "raw_map_ns_per_granule": r,
        "grow_vs_raw_ratio": o / r,
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

    let mut buf = VirtualBuffer::new(host.backing(), READ_BYTES, MemoryRole::KvCache).unwrap();
    buf.grow(READ_BYTES).unwrap();
    for (i, b) in buf.as_mut_slice().unwrap().iter_mut().enumerate() {
        *b = i as u8;
    }
    let vec: Vec<u8> = (0..READ_BYTES).map(|i| i as u8).collect();
    let ours_slice = buf.as_slice().unwrap();
    assert_eq!(sum(ours_slice), sum(&vec));
    let mut read_ours = Vec::new();
    let mut read_vec = Vec::new();
    for _ in 0..ROUNDS {
        read_ours.push(median_of(3, || {
            ns_per(READ_BYTES, || {
                black_box(sum(black_box(ours_slice)));
            })
        }));
        read_vec.push(median_of(3, || {
            ns_per(READ_BYTES, || {
                black_box(sum(black_box(&vec)));
            })
        }));
    }
    let read_ours_ns = med(&mut read_ours);
    let read_vec_ns = med(&mut read_vec);

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
            "read_ns_per_byte": read_ours_ns,
            "vec_read_ns_per_byte": read_vec_ns,
            "read_vs_vec_ratio": read_vec_ns / read_ours_ns,
            "cuda": cuda_growth(),
        }),
    );
}
