//! After everything is dropped, no mapping and no file descriptor is left behind.
//! Alone in its own test binary so no other test's handles come and go meanwhile.
#![cfg(target_os = "linux")]

use procmem::host::HostMechanism;
use procmem::{AllocationRequest, MapAccess, MemoryMechanism, MemoryRole, VirtualBuffer};

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn maps() -> String {
    std::fs::read_to_string("/proc/self/maps").unwrap()
}

fn mapped_inside(maps: &str, range: std::ops::Range<u64>) -> usize {
    maps.lines()
        .filter_map(|l| {
            l.split_whitespace().next()?.split_once('-').map(|(a, b)| {
                (
                    u64::from_str_radix(a, 16).unwrap(),
                    u64::from_str_radix(b, 16).unwrap(),
                )
            })
        })
        .filter(|(a, b)| *a < range.end && *b > range.start)
        .count()
}

#[test]
fn nothing_is_left_behind() {
    let fds_before = open_fds();
    let g = procmem::granularity();
    let mut ranges = Vec::new();
    {
        let host = HostMechanism::new().unwrap();
        let shared = host.shared_mapping().unwrap();
        let block = shared.create_block(4 * g).unwrap();
        let mut buffers = Vec::new();
        for i in 0..16u64 {
            let mut b = VirtualBuffer::new(host.backing(), 64 * g, MemoryRole::KvCache).unwrap();
            b.grow((i % 7 + 1) * g).unwrap();
            b.as_mut_slice().unwrap().fill(i as u8);
            ranges.push(b.addr()..b.addr() + b.capacity());
            buffers.push(b);
        }
        let backing = host.virtual_backing().unwrap();
        let mut raw = backing
            .reserve(&procmem::VirtualRequest {
                bytes: 16 * g,
                role: MemoryRole::KvCache,
            })
            .unwrap();
        shared
            .map_block(&mut raw, 0, &block, MapAccess::CopyOnWrite)
            .unwrap();
        backing.commit_range(&mut raw, 8 * g..10 * g).unwrap();
        ranges.push(raw.addr()..raw.addr() + raw.len());
        let a = host
            .allocator()
            .allocate(&AllocationRequest::new(3 * g, MemoryRole::Weights))
            .unwrap();
        ranges.push(a.addr()..a.addr() + a.footprint());
        assert!(
            open_fds() > fds_before,
            "the mechanism holds its memfd while alive"
        );
        assert!(maps().contains("memfd:procmem-host"));
        drop((a, raw, buffers, block));
        assert_eq!(host.backing().resident_bytes().unwrap(), 0);
        assert!(host.backing().take_drop_errors().is_empty());
        assert!(host.host_allocator().take_drop_errors().is_empty());
    }
    assert_eq!(open_fds(), fds_before, "a file descriptor leaked");
    let maps = maps();
    assert!(
        !maps.contains("memfd:procmem-host"),
        "a memfd mapping leaked:\n{maps}"
    );
    for r in ranges {
        assert_eq!(mapped_inside(&maps, r.clone()), 0, "{r:x?} is still mapped");
    }
}
