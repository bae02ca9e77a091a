//! Host virtual memory against the kernel's own accounting: growth without moving, sharing,
//! protection, copy-on-write, and typed refusals that change nothing.
#![cfg(target_os = "linux")]

use std::os::unix::process::ExitStatusExt;
use std::sync::Arc;

use procmem::host::{allocation_bytes, allocation_bytes_mut, HostMechanism};
use procmem::{
    AllocationRequest, CommitModel, FreeError, MapAccess, MemoryError, MemoryMechanism, MemoryRole,
    VirtualAllocation, VirtualBuffer, VirtualRequest,
};

mod common;
use common::rerun_in_child;

fn host() -> HostMechanism {
    HostMechanism::new().expect("host mechanism")
}

fn reserve(m: &HostMechanism, granules: u64) -> VirtualAllocation {
    let g = procmem::granularity();
    m.virtual_backing()
        .unwrap()
        .reserve(&VirtualRequest {
            bytes: granules * g,
            role: MemoryRole::KvCache,
        })
        .unwrap()
}

fn read(alloc: &VirtualAllocation, offset: u64) -> u8 {
    // SAFETY: callers only read granules they mapped readable in this allocation.
    unsafe { std::ptr::read_volatile((alloc.addr() + offset) as usize as *const u8) }
}

fn write(alloc: &VirtualAllocation, offset: u64, value: u8) {
    // SAFETY: callers only write granules they mapped writable in this allocation.
    unsafe { std::ptr::write_volatile((alloc.addr() + offset) as usize as *mut u8, value) }
}

#[test]
fn granularity_is_the_page_size_the_os_reports() {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64;
    assert_eq!(procmem::granularity(), page);
    assert_eq!(host().virtual_backing().unwrap().granularity(), page);
}

#[test]
fn pattern_survives_a_thousand_grows_and_the_base_never_moves() {
    let m = host();
    let g = procmem::granularity();
    let mut buf = VirtualBuffer::new(m.backing(), 1001 * g, MemoryRole::KvCache).unwrap();
    let base = buf.addr();
    for step in 0..1000u64 {
        buf.grow(g).unwrap();
        assert_eq!(buf.addr(), base, "base moved at grow {step}");
        let bytes = buf.as_mut_slice().unwrap();
        let new = &mut bytes[(step * g) as usize..];
        for (i, b) in new.iter_mut().enumerate() {
            *b = (step as usize * 31 + i) as u8;
        }
    }
    let bytes = buf.as_slice().unwrap();
    for step in 0..1000u64 {
        let chunk = &bytes[(step * g) as usize..((step + 1) * g) as usize];
        for (i, b) in chunk.iter().enumerate() {
            assert_eq!(
                *b,
                (step as usize * 31 + i) as u8,
                "granule {step} byte {i}"
            );
        }
    }
    assert_eq!(buf.resident_bytes().unwrap(), 1000 * g);
    assert_eq!(m.backing().resident_bytes().unwrap(), 1000 * g);
}

#[test]
fn shrink_returns_pages_to_the_os_and_regrowth_reads_zeroes() {
    let m = host();
    let g = procmem::granularity();
    let mut buf = VirtualBuffer::new(m.backing(), 8 * g, MemoryRole::KvCache).unwrap();
    buf.grow(4 * g).unwrap();
    buf.as_mut_slice().unwrap().fill(0xAB);
    let freed = buf.shrink(2 * g).unwrap();
    assert_eq!((freed.unmapped_bytes, freed.freed_bytes), (2 * g, 2 * g));
    assert_eq!(buf.resident_bytes().unwrap(), 2 * g);
    assert_eq!(m.backing().resident_bytes().unwrap(), 2 * g);
    buf.grow(2 * g).unwrap();
    let bytes = buf.as_slice().unwrap();
    assert!(bytes[..(2 * g) as usize].iter().all(|b| *b == 0xAB));
    assert!(bytes[(2 * g) as usize..].iter().all(|b| *b == 0));
}

#[test]
fn aliasing_one_block_at_two_addresses() {
    let m = host();
    let g = procmem::granularity();
    let shared = m.shared_mapping().unwrap();
    let block = shared.create_block(2 * g).unwrap();
    let mut a = reserve(&m, 4);
    let mut b = reserve(&m, 4);
    shared
        .map_block(&mut a, 0, &block, MapAccess::ReadWrite)
        .unwrap();
    shared
        .map_block(&mut b, 2 * g, &block, MapAccess::ReadWrite)
        .unwrap();
    write(&a, 5, 42);
    write(&b, 2 * g + g + 1, 43);
    assert_eq!(read(&b, 2 * g + 5), 42);
    assert_eq!(read(&a, g + 1), 43);
    // One block's worth of physical memory, however many addresses see it.
    assert_eq!(m.backing().resident_bytes().unwrap(), 2 * g);
    assert_eq!(shared.block_resident_bytes(&block).unwrap(), 2 * g);
    assert_eq!(a.granules().shared_bytes(), 2 * g);
}

const CHILD_ENV: &str = "PROCMEM_TEST_WRITE_READ_ONLY";

#[test]
fn read_only_view_faults_on_write() {
    let m = host();
    let g = procmem::granularity();
    let shared = m.shared_mapping().unwrap();
    let block = shared.create_block(g).unwrap();
    let mut writer = reserve(&m, 1);
    let mut reader = reserve(&m, 1);
    shared
        .map_block(&mut writer, 0, &block, MapAccess::ReadWrite)
        .unwrap();
    shared
        .map_block(&mut reader, 0, &block, MapAccess::ReadOnly)
        .unwrap();
    write(&writer, 0, 9);
    assert_eq!(read(&reader, 0), 9);
    if std::env::var_os(CHILD_ENV).is_some() {
        eprintln!("child: writing through the read-only view");
        write(&reader, 0, 1);
        eprintln!("child: the write did not fault");
        std::process::exit(0);
    }
    let output = rerun_in_child("read_only_view_faults_on_write", CHILD_ENV, "1");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("child: writing through the read-only view"),
        "{stderr}"
    );
    assert_eq!(output.status.signal(), Some(libc::SIGSEGV), "{stderr}");
    assert_eq!(read(&reader, 0), 9, "the block is unchanged");
}

#[test]
fn copy_on_write_gives_the_writer_its_own_page() {
    let m = host();
    let g = procmem::granularity();
    let shared = m.shared_mapping().unwrap();
    let block = shared.create_block(2 * g).unwrap();
    let mut owner = reserve(&m, 2);
    let mut other = reserve(&m, 2);
    let mut cow = reserve(&m, 2);
    shared
        .map_block(&mut owner, 0, &block, MapAccess::ReadWrite)
        .unwrap();
    shared
        .map_block(&mut other, 0, &block, MapAccess::ReadOnly)
        .unwrap();
    shared
        .map_block(&mut cow, 0, &block, MapAccess::CopyOnWrite)
        .unwrap();
    write(&owner, 0, 1);
    write(&owner, g, 2);
    assert_eq!(
        read(&cow, 0),
        1,
        "a copy-on-write view sees the block before writing"
    );
    assert_eq!(shared.private_copy_bytes(&cow).unwrap(), 0);

    write(&cow, 0, 77);
    assert_eq!(read(&cow, 0), 77);
    assert_eq!(read(&owner, 0), 1, "the owner's view is unchanged");
    assert_eq!(read(&other, 0), 1, "other views are unchanged");
    assert_eq!(
        read(&cow, g),
        2,
        "unwritten pages still come from the block"
    );
    // The copy is anonymous memory of the writer, not part of the block.
    assert_eq!(shared.private_copy_bytes(&cow).unwrap(), g);
    assert_eq!(shared.private_copy_bytes(&other).unwrap(), 0);
    assert_eq!(shared.block_resident_bytes(&block).unwrap(), 2 * g);
}

#[test]
fn a_block_is_freed_when_its_last_mapping_goes() {
    let m = host();
    let g = procmem::granularity();
    let backing = m.virtual_backing().unwrap();
    let shared = m.shared_mapping().unwrap();
    let block = shared.create_block(g).unwrap();
    let mut a = reserve(&m, 1);
    let mut b = reserve(&m, 1);
    shared
        .map_block(&mut a, 0, &block, MapAccess::ReadWrite)
        .unwrap();
    shared
        .map_block(&mut b, 0, &block, MapAccess::ReadOnly)
        .unwrap();
    assert_eq!(block.references(), 3);
    drop(block);
    assert_eq!(
        m.backing().resident_bytes().unwrap(),
        g,
        "mappings keep the block"
    );
    let first = backing.decommit_range(&mut a, 0..g).unwrap();
    assert_eq!((first.unmapped_bytes, first.freed_bytes), (g, 0));
    assert_eq!(
        m.backing().resident_bytes().unwrap(),
        g,
        "one mapping still holds it"
    );
    backing.decommit_range(&mut b, 0..g).unwrap();
    assert_eq!(
        m.backing().resident_bytes().unwrap(),
        0,
        "last mapping gone: pages freed"
    );
    assert!(m.backing().take_drop_errors().is_empty());
}

#[test]
fn the_eager_allocator_says_so_and_takes_every_byte_at_allocate() {
    let m = host();
    let g = procmem::granularity();
    let alloc = m.allocator();
    assert_eq!(alloc.commit_model(), CommitModel::Eager);
    let request = AllocationRequest::new(10 * g + 1, MemoryRole::Weights);
    assert_eq!(alloc.footprint(&request).unwrap(), 11 * g);
    let mut a = alloc.allocate(&request).unwrap();
    assert_eq!(a.footprint(), 11 * g);
    assert_eq!(
        alloc.resident_bytes(&a).unwrap(),
        11 * g,
        "populated at allocate"
    );
    assert_eq!((a.mechanism(), a.context()), (m.id(), m.context()));
    allocation_bytes_mut(&mut a).unwrap().fill(5);
    assert!(allocation_bytes(&a).unwrap().iter().all(|b| *b == 5));
    assert_eq!(alloc.free(a).unwrap(), 11 * g);
}

#[test]
fn capability_queries_answer_for_the_mechanism_itself() {
    let m = host();
    assert_eq!(m.allocator().mechanism(), m.id());
    assert_eq!(m.virtual_backing().unwrap().mechanism(), m.id());
    assert_eq!(m.shared_mapping().unwrap().mechanism(), m.id());
}

/// Every refusal below must be typed and leave the kernel's accounting and our books as they were.
#[test]
fn bad_input_gets_a_typed_error_and_changes_nothing() {
    let m = host();
    let other = host();
    let g = procmem::granularity();
    let backing = m.virtual_backing().unwrap();
    let shared = m.shared_mapping().unwrap();
    let mut buf = VirtualBuffer::new(m.backing(), 4 * g, MemoryRole::KvCache).unwrap();
    buf.grow(2 * g).unwrap();
    let mut raw = reserve(&m, 4);
    backing.commit_range(&mut raw, g..2 * g).unwrap();
    let block = shared.create_block(2 * g).unwrap();
    shared
        .map_block(&mut raw, 2 * g, &block, MapAccess::ReadOnly)
        .unwrap();

    let snapshot = |buf: &VirtualBuffer, raw: &VirtualAllocation| {
        (
            buf.len(),
            buf.resident_bytes().unwrap(),
            raw.granules().committed_bytes(),
            raw.granules().shared_bytes(),
            backing.committed_bytes(raw).unwrap(),
            m.backing().resident_bytes().unwrap(),
        )
    };
    let before = snapshot(&buf, &raw);

    let zero = VirtualRequest {
        bytes: 0,
        role: MemoryRole::KvCache,
    };
    assert!(matches!(
        backing.reserve(&zero),
        Err(MemoryError::ZeroSize { .. })
    ));
    let odd = VirtualRequest {
        bytes: g + 1,
        role: MemoryRole::KvCache,
    };
    assert!(matches!(
        backing.reserve(&odd),
        Err(MemoryError::Misaligned { .. })
    ));
    let huge = VirtualRequest {
        bytes: u64::MAX - g + 1,
        role: MemoryRole::KvCache,
    };
    assert!(matches!(
        backing.reserve(&huge),
        Err(MemoryError::SizeOverflow { .. })
    ));
    assert!(matches!(
        VirtualBuffer::new(m.backing(), 0, MemoryRole::KvCache),
        Err(MemoryError::ZeroSize { .. })
    ));
    assert!(matches!(
        VirtualBuffer::new(m.backing(), u64::MAX, MemoryRole::KvCache),
        Err(MemoryError::SizeOverflow { .. })
    ));
    assert!(matches!(buf.grow(0), Err(MemoryError::ZeroSize { .. })));
    assert!(matches!(
        buf.grow(g / 2),
        Err(MemoryError::Misaligned { .. })
    ));
    assert!(matches!(
        buf.grow(u64::MAX),
        Err(MemoryError::SizeOverflow { .. })
    ));
    assert!(matches!(
        buf.grow(3 * g),
        Err(MemoryError::OutOfReservation { .. })
    ));
    assert!(matches!(
        buf.shrink(3 * g),
        Err(MemoryError::ShrinkBelowZero { .. })
    ));
    assert!(matches!(
        buf.shrink(g / 2),
        Err(MemoryError::Misaligned { .. })
    ));
    assert!(matches!(
        backing.commit_range(&mut raw, 0..0),
        Err(MemoryError::ZeroSize { .. })
    ));
    assert!(matches!(
        backing.commit_range(&mut raw, 1..g),
        Err(MemoryError::Misaligned { .. })
    ));
    assert!(matches!(
        backing.commit_range(&mut raw, 3 * g..5 * g),
        Err(MemoryError::OutOfReservation { .. })
    ));
    assert!(matches!(
        backing.commit_range(&mut raw, 0..2 * g),
        Err(MemoryError::AlreadyCommitted { offset }) if offset == g
    ));
    assert!(matches!(
        backing.decommit_range(&mut raw, 0..g),
        Err(MemoryError::NotCommitted { offset: 0 })
    ));
    assert!(matches!(
        backing.decommit_range(&mut raw, 2 * g..3 * g),
        Err(MemoryError::PartialBlock { .. })
    ));
    assert!(matches!(
        shared.create_block(0),
        Err(MemoryError::ZeroSize { .. })
    ));
    assert!(matches!(
        shared.create_block(g + 3),
        Err(MemoryError::Misaligned { .. })
    ));
    assert!(matches!(
        shared.map_block(&mut raw, u64::MAX - g + 1, &block, MapAccess::ReadOnly),
        Err(MemoryError::SizeOverflow { .. })
    ));
    assert!(matches!(
        shared.map_block(&mut raw, g, &block, MapAccess::ReadOnly),
        Err(MemoryError::AlreadyCommitted { .. })
    ));

    // Foreign handles: another mechanism refuses them, and the allocation comes back intact.
    let other_backing = other.virtual_backing().unwrap();
    assert!(matches!(
        other_backing.commit_range(&mut raw, 0..g),
        Err(MemoryError::ForeignHandle { .. })
    ));
    assert!(matches!(
        other_backing.decommit_range(&mut raw, g..2 * g),
        Err(MemoryError::ForeignHandle { .. })
    ));
    assert!(matches!(
        other_backing.committed_bytes(&raw),
        Err(MemoryError::ForeignHandle { .. })
    ));
    let mut foreign_target = reserve(&other, 2);
    assert!(matches!(
        other.shared_mapping().unwrap().map_block(
            &mut foreign_target,
            0,
            &block,
            MapAccess::ReadOnly
        ),
        Err(MemoryError::ForeignHandle { .. })
    ));
    let a = m
        .allocator()
        .allocate(&AllocationRequest::new(g, MemoryRole::Workspace))
        .unwrap();
    let addr = a.addr();
    let a = match other.allocator().free(a) {
        Err(FreeError::Refused(refused)) => {
            assert!(matches!(refused.error, MemoryError::ForeignHandle { .. }));
            refused.handle
        }
        other => panic!("a foreign free must be refused, got {other:?}"),
    };
    assert_eq!(a.addr(), addr);
    assert_eq!(
        m.allocator().resident_bytes(&a).unwrap(),
        g,
        "still mapped after the refusal"
    );
    assert!(matches!(
        other.allocator().resident_bytes(&a),
        Err(MemoryError::ForeignHandle { .. })
    ));
    assert!(matches!(
        m.allocator()
            .allocate(&AllocationRequest::new(0, MemoryRole::Workspace)),
        Err(MemoryError::ZeroSize { .. })
    ));
    assert!(matches!(
        m.allocator()
            .allocate(&AllocationRequest::new(u64::MAX, MemoryRole::Workspace)),
        Err(MemoryError::SizeOverflow { .. })
    ));
    assert!(matches!(
        m.allocator()
            .allocate(&AllocationRequest::new(g, MemoryRole::Workspace).with_alignment(3)),
        Err(MemoryError::BadAlignment { .. })
    ));
    assert_eq!(m.allocator().free(a).unwrap(), g);

    assert_eq!(
        snapshot(&buf, &raw),
        before,
        "refusals changed the books or the OS state"
    );

    // Double decommit: the first succeeds, the second is refused and changes nothing.
    backing.decommit_range(&mut raw, g..2 * g).unwrap();
    let after_first = snapshot(&buf, &raw);
    assert!(matches!(
        backing.decommit_range(&mut raw, g..2 * g),
        Err(MemoryError::NotCommitted { .. })
    ));
    assert_eq!(snapshot(&buf, &raw), after_first);
    // Each refusal above is one class of bad input, checked typed and without effect.
    common::figure("bad_input_memory_api", 31, 31);
}

#[test]
fn dropping_a_reservation_releases_its_pages_and_blocks() {
    let m = host();
    let g = procmem::granularity();
    let shared = m.shared_mapping().unwrap();
    {
        let mut raw = reserve(&m, 8);
        m.virtual_backing()
            .unwrap()
            .commit_range(&mut raw, 0..4 * g)
            .unwrap();
        let block = shared.create_block(2 * g).unwrap();
        shared
            .map_block(&mut raw, 6 * g, &block, MapAccess::ReadWrite)
            .unwrap();
        drop(block);
        assert_eq!(m.backing().resident_bytes().unwrap(), 6 * g);
    }
    assert_eq!(m.backing().resident_bytes().unwrap(), 0);
    let _keep: Arc<_> = m.backing();
}

/// The copies every device offers (what swaps and weight loads go through), called with
/// ranges past the end, lengths that overflow, and another mechanism's handles: typed
/// refusals, nothing written, never a panic.
#[test]
fn copies_refuse_ranges_past_the_end_and_foreign_handles() {
    let m = host();
    let other = host();
    let g = procmem::granularity();
    // Allocations.
    let request = AllocationRequest::new(2 * g, MemoryRole::Workspace);
    let mut a = m.allocator().allocate(&request).unwrap();
    let alloc = m.allocator();
    alloc.write(&mut a, 10, b"abc").unwrap();
    let mut got = [0u8; 3];
    alloc.read(&a, 10, &mut got).unwrap();
    assert_eq!(&got, b"abc");
    let mut one = [0u8; 1];
    for offset in [2 * g, u64::MAX, u64::MAX - 1] {
        assert!(
            alloc.read(&a, offset, &mut one).is_err(),
            "read at {offset}"
        );
        assert!(
            alloc.write(&mut a, offset, b"x").is_err(),
            "write at {offset}"
        );
    }
    assert!(
        alloc.write(&mut a, 2 * g - 2, b"xyz").is_err(),
        "a write crossing the end"
    );
    assert!(
        other.allocator().read(&a, 0, &mut one).is_err(),
        "another mechanism's handle"
    );
    assert!(other.allocator().write(&mut a, 0, b"x").is_err());
    assert_eq!(
        &allocation_bytes(&a).unwrap()[10..13],
        b"abc",
        "nothing else written"
    );
    m.allocator().free(a).unwrap();

    // Grown buffers.
    let mut buf = VirtualBuffer::new(m.backing(), 4 * g, MemoryRole::KvCache).unwrap();
    buf.grow(g).unwrap();
    buf.write_from(g - 3, b"end").unwrap();
    let mut tail = [0u8; 3];
    buf.read_into(g - 3, &mut tail).unwrap();
    assert_eq!(&tail, b"end");
    for offset in [g, g - 2, u64::MAX, u64::MAX - 2] {
        assert!(
            buf.read_into(offset, &mut tail).is_err(),
            "read at {offset}"
        );
        assert!(buf.write_from(offset, b"end").is_err(), "write at {offset}");
    }
    let mut foreign = VirtualBuffer::new(other.backing(), g, MemoryRole::KvCache).unwrap();
    foreign.grow(g).unwrap();
    let backing = m.virtual_backing().unwrap();
    assert!(backing
        .read_range(foreign.allocation(), 0, &mut tail)
        .is_err());
}

/// Under a file-size limit (`ulimit -f`) the host mechanism works where its memory file fits
/// and refuses with a typed error where it would not, instead of being killed by SIGXFSZ
/// (issue 27, item 4: every host-backend program exited 153 at start under any limit).
#[test]
fn a_file_size_limit_is_a_typed_error_not_a_signal() {
    const ENV: &str = "PROCMEM_FSIZE_CHILD";
    if std::env::var_os(ENV).is_some() {
        let m = host();
        let g = procmem::granularity();
        // 64 MiB: within the limit of 256 MiB below.
        let mut small =
            VirtualBuffer::new(m.backing(), (64 << 20) / g * g, MemoryRole::KvCache).unwrap();
        small.grow(2 * g).unwrap();
        small.as_mut_slice().unwrap()[g as usize] = 7;
        assert_eq!(small.as_slice().unwrap()[g as usize], 7);
        let backing = m.virtual_backing().unwrap();
        let large = backing.reserve(&VirtualRequest {
            bytes: (1 << 30) / g * g,
            role: MemoryRole::KvCache,
        });
        assert!(
            matches!(large, Err(MemoryError::FileSizeLimit { limit, .. }) if limit == 256 << 20),
            "{large:?}"
        );
        println!("{}", large.unwrap_err());
        drop(small);
        // What was given back is carved again: many reservations in turn stay within it.
        for _ in 0..64 {
            let r = reserve(&m, (128 << 20) / g);
            drop(r);
        }
        println!("CHILD OK");
        return;
    }
    let out = std::process::Command::new("bash")
        .args(["-c", "ulimit -f 262144 && exec \"$@\"", "limited"])
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_file_size_limit_is_a_typed_error_not_a_signal",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ENV, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.signal(),
        None,
        "killed by a signal: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("file-size limit (ulimit -f)"), "{stdout}");
    assert!(stdout.contains("CHILD OK"), "{stdout}");
}
