//! CUDA mechanisms. Without a driver every entry point must say so with a typed error; with
//! one (and a device), the VMM backing is checked against the driver.

use std::sync::Arc;

mod common;
use common::rerun_in_child;

use procmem::cuda::{driver_present, CudaDevice, CudaMechanism};
use procmem::{
    MapAccess, MemoryError, MemoryMechanism, MemoryRole, VirtualBacking, VirtualBuffer,
    VirtualRequest,
};

/// Says why a test is skipped, straight to stderr so the test harness does not swallow it.
fn skipped(test: &str, why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
}

/// The mechanism on device 0, or `None` after saying why the test is skipped.
fn gpu(test: &str) -> Option<CudaMechanism> {
    if !driver_present() {
        skipped(
            test,
            "no CUDA driver (libcuda cannot be loaded on this machine)",
        );
        return None;
    }
    if CudaDevice::count() == 0 {
        skipped(test, "a CUDA driver is present but reports no device");
        return None;
    }
    Some(CudaMechanism::new(0, 8).expect("open CUDA device 0"))
}

#[test]
fn without_a_driver_every_entry_point_says_so() {
    if driver_present() {
        skipped(
            "without_a_driver_every_entry_point_says_so",
            "a CUDA driver is present",
        );
        return;
    }
    assert!(matches!(
        CudaDevice::open(0),
        Err(MemoryError::NoCudaDriver { .. })
    ));
    assert!(matches!(
        CudaMechanism::new(0, 4),
        Err(MemoryError::NoCudaDriver { .. })
    ));
    assert_eq!(CudaDevice::count(), 0);
    let message = CudaDevice::open(0).unwrap_err().to_string();
    assert!(message.contains("no CUDA driver"), "{message}");
}

#[test]
fn cuda_granularity_comes_from_the_driver() {
    let Some(m) = gpu("cuda_granularity_comes_from_the_driver") else {
        return;
    };
    let g = m.virtual_backing().unwrap().granularity();
    assert!(g.is_power_of_two() && g >= 64 * 1024, "granularity {g}");
    assert_eq!(g, m.device().granularity().unwrap());
    eprintln!("CUDA VMM granularity: {g} bytes");
}

#[test]
fn cuda_buffer_grows_without_moving_and_keeps_its_bytes() {
    let Some(m) = gpu("cuda_buffer_grows_without_moving_and_keeps_its_bytes") else {
        return;
    };
    let backing = m.backing();
    let g = VirtualBacking::granularity(backing.as_ref());
    let device = Arc::clone(m.device());
    let free_before = device.mem_info().unwrap().free;
    let mut buf = VirtualBuffer::new(backing.clone(), 64 * g, MemoryRole::KvCache).unwrap();
    let base = buf.addr();
    for i in 0..32u64 {
        buf.grow(g).unwrap();
        assert_eq!(buf.addr(), base);
        let pattern = vec![(i % 251) as u8; g as usize];
        // SAFETY: granule i was just mapped read-write.
        unsafe { device.copy_to_device(base + i * g, &pattern).unwrap() };
    }
    for i in 0..32u64 {
        let mut back = vec![0u8; g as usize];
        // SAFETY: granule i is mapped.
        unsafe { device.copy_to_host(&mut back, base + i * g).unwrap() };
        assert!(
            back.iter().all(|b| *b == (i % 251) as u8),
            "granule {i} lost its bytes"
        );
    }
    assert_eq!(buf.resident_bytes().unwrap(), 32 * g);
    let free_during = device.mem_info().unwrap().free;
    assert!(
        free_before - free_during >= 24 * g,
        "the driver sees the physical memory"
    );
    assert!(buf.as_slice().is_err(), "device memory has no host slice");
    buf.shrink(16 * g).unwrap();
    assert_eq!(buf.resident_bytes().unwrap(), 16 * g);
}

#[test]
fn cuda_failed_growth_rolls_back_every_mapping() {
    let Some(m) = gpu("cuda_failed_growth_rolls_back_every_mapping") else {
        return;
    };
    let backing = m.backing();
    let g = VirtualBacking::granularity(backing.as_ref());
    let mut a = backing
        .reserve(&VirtualRequest {
            bytes: 16 * g,
            role: MemoryRole::KvCache,
        })
        .unwrap();
    backing.commit_range(&mut a, 0..2 * g).unwrap();
    let pooled = (backing.pooled_bytes() / g) as usize;
    let live = (backing.live_bytes() / g) as usize;
    // The pool covers `pooled` granules and the cap lets one more handle be created: a growth
    // of `pooled + 3` granules maps `pooled + 1` of them, then fails and must undo them all.
    backing.set_handle_cap(Some(live + 1));
    let want = (pooled + 3) as u64;
    let err = backing
        .commit_range(&mut a, 2 * g..(2 + want) * g)
        .unwrap_err();
    assert!(matches!(err, MemoryError::OutOfMemory { .. }), "{err}");
    assert_eq!(
        a.granules().committed_bytes(),
        2 * g,
        "the old length is intact"
    );
    assert_eq!(
        backing.committed_bytes(&a).unwrap(),
        2 * g,
        "nothing stayed mapped"
    );
    assert_eq!(
        backing.pooled_bytes(),
        (pooled as u64 + 1) * g,
        "every handle went back to the pool"
    );
    assert_eq!(backing.live_bytes(), (live as u64 + 1) * g);
    backing.set_handle_cap(None);
    backing.commit_range(&mut a, 2 * g..4 * g).unwrap();
}

#[test]
fn cuda_shared_block_maps_at_two_addresses_read_only_where_asked() {
    let Some(m) = gpu("cuda_shared_block_maps_at_two_addresses_read_only_where_asked") else {
        return;
    };
    let backing = m.backing();
    let shared = m.shared_mapping().unwrap();
    let g = VirtualBacking::granularity(backing.as_ref());
    let device = Arc::clone(m.device());
    let block = shared.create_block(g).unwrap();
    let mut writer = backing
        .reserve(&VirtualRequest {
            bytes: 2 * g,
            role: MemoryRole::KvCache,
        })
        .unwrap();
    let mut reader = backing
        .reserve(&VirtualRequest {
            bytes: 2 * g,
            role: MemoryRole::KvCache,
        })
        .unwrap();
    shared
        .map_block(&mut writer, 0, &block, MapAccess::ReadWrite)
        .unwrap();
    shared
        .map_block(&mut reader, g, &block, MapAccess::ReadOnly)
        .unwrap();
    assert!(matches!(
        shared.map_block(&mut reader, 0, &block, MapAccess::CopyOnWrite),
        Err(MemoryError::Unsupported { .. })
    ));
    let data = vec![42u8; g as usize];
    // SAFETY: mapped read-write in `writer`.
    unsafe { device.copy_to_device(writer.addr(), &data).unwrap() };
    let mut back = vec![0u8; g as usize];
    // SAFETY: mapped readable in `reader`.
    unsafe { device.copy_to_host(&mut back, reader.addr() + g).unwrap() };
    assert_eq!(back, data, "both addresses see one physical block");
    assert_eq!(block.references(), 3);
    backing.decommit_range(&mut writer, 0..g).unwrap();
    assert_eq!(block.references(), 2);
}

const CHILD_ENV: &str = "PROCMEM_CUDA_READ_ONLY_CHILD";

/// In a child process (a faulting write can leave the CUDA context unusable): maps one block
/// read-write at one address and read-only at another, writes through the read-only one with
/// `how` ("copy": a host-to-device copy; "memset": an asynchronous fill on a stream), and
/// prints what the driver said and what the block holds afterwards.
fn read_only_child(how: &str) {
    use procmem::cuda::CudaStream;
    let m = CudaMechanism::new(0, 0).expect("open CUDA device 0");
    let backing = m.backing();
    let shared = m.shared_mapping().unwrap();
    let g = VirtualBacking::granularity(backing.as_ref());
    let device = Arc::clone(m.device());
    let block = shared.create_block(g).unwrap();
    let request = VirtualRequest {
        bytes: g,
        role: MemoryRole::KvCache,
    };
    let mut writer = backing.reserve(&request).unwrap();
    let mut reader = backing.reserve(&request).unwrap();
    shared
        .map_block(&mut writer, 0, &block, MapAccess::ReadWrite)
        .unwrap();
    shared
        .map_block(&mut reader, 0, &block, MapAccess::ReadOnly)
        .unwrap();
    // SAFETY: mapped read-write in `writer`.
    unsafe { device.copy_to_device(writer.addr(), &vec![42u8; g as usize]) }.unwrap();
    eprintln!("child: writing through the read-only view with {how}");
    let result = match how {
        // SAFETY: deliberately violates `copy_to_device`'s precondition (the range is mapped
        // read-only); this is the property under test, in a process of its own.
        "copy" => unsafe { device.copy_to_device(reader.addr(), &[7u8; 4096]) },
        _ => CudaStream::new(Arc::clone(&device)).and_then(|stream| {
            // SAFETY: as above, deliberately, for `memset_async`.
            unsafe { stream.memset_async(reader.addr(), 7, 4096) }?;
            stream.synchronize()
        }),
    };
    eprintln!("child: write result {result:?}");
    let mut back = vec![0u8; 4096];
    // SAFETY: mapped read-write in `writer`.
    match unsafe { device.copy_to_host(&mut back, writer.addr()) } {
        Ok(()) => eprintln!("child: first byte after {}", back[0]),
        Err(e) => eprintln!("child: block unreadable after the write: {e}"),
    }
}

/// A sharer mapped read-only cannot change a shared block: the driver refuses or faults the
/// write (the context may then be unusable, hence the child process), or the bytes stay.
#[test]
fn cuda_read_only_sharer_cannot_write() {
    const TEST: &str = "cuda_read_only_sharer_cannot_write";
    if let Some(how) = std::env::var_os(CHILD_ENV) {
        read_only_child(how.to_str().unwrap());
        return;
    }
    if gpu(TEST).is_none() {
        return;
    }
    for how in ["copy", "memset"] {
        let output = rerun_in_child(TEST, CHILD_ENV, how);
        let stderr = String::from_utf8_lossy(&output.stderr);
        eprintln!("{how}: child exited {:?}\n{stderr}", output.status);
        assert!(
            stderr.contains("child: write result"),
            "{how}: the child never tried the write\n{stderr}"
        );
        let refused = stderr.contains("child: write result Err");
        let unchanged = stderr.contains("child: first byte after 42");
        let unreadable = stderr.contains("child: block unreadable");
        // Readable afterwards: the bytes must be intact, whatever the driver said. Unreadable
        // (the fault poisoned the context): the write itself must have been refused.
        assert!(
            unchanged || (refused && unreadable),
            "{how}: a read-only sharer changed the shared block\n{stderr}"
        );
    }
}

/// The CUDA decode kernels (split-KV, GQA groups sharing one KV read) against the host
/// operator on the same inputs, for every pair of K and V types (`f32`, `f16`, `q8_0`), with
/// the new token's row written (rounded or quantized) by the row kernel. The host operator
/// reads the very bytes the GPU holds, read back; the row the GPU quantized is held to the
/// host's quantization of the same values within one step of its block. `q8_0` rows are laid
/// out in groups (three 1,088-byte rows to a 4 KiB page), as a store groups small ones.
#[test]
fn cuda_decode_kernel_equals_the_host_operator() {
    use procmem::cuda::{CudaStream, DecodeKernels, DecodeLaunch};
    use procmem::kv::{gqa_decode_rows, narrow_into, Heads, KvDtype, KvRows, RowLayout};
    let Some(m) = gpu("cuda_decode_kernel_equals_the_host_operator") else {
        return;
    };
    let device = m.device().clone();
    let kernels = DecodeKernels::load(device.clone()).expect("load the PTX");
    let stream = CudaStream::new(device.clone()).unwrap();
    let (q_heads, kv_heads, hd, tokens) = (32u32, 8u32, 128u32, 1000u32);
    let row = (kv_heads * hd) as usize;
    let vals = |n: usize, seed: usize| -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 2654435761 + seed * 40503) % 2001) as f32 / 1000.0) - 1.0)
            .collect()
    };
    let q = vals((q_heads * hd) as usize, 1);
    let k = vals(tokens as usize * row, 2);
    let v = vals(tokens as usize * row, 3);
    let bytes = |x: &[f32]| x.iter().flat_map(|f| f.to_le_bytes()).collect::<Vec<u8>>();
    let layout = |dtype: KvDtype| {
        let row_bytes = dtype.row_bytes(row).unwrap();
        match dtype {
            KvDtype::Q8_0 => RowLayout {
                row_bytes,
                group_rows: 3,
                group_bytes: 4096,
            },
            _ => RowLayout::dense(row_bytes),
        }
    };
    // Every row at its place in `dtype`'s layout.
    let kept = |dtype: KvDtype, x: &[f32]| {
        let rows = layout(dtype);
        let mut out = vec![0u8; rows.offset(tokens as u64) as usize];
        for (t, r) in x.chunks_exact(row).enumerate() {
            let at = rows.offset(t as u64) as usize;
            narrow_into(dtype, r, &mut out[at..][..rows.row_bytes as usize]);
        }
        out
    };
    for (k_dtype, v_dtype) in KvDtype::ALL
        .iter()
        .flat_map(|a| KvDtype::ALL.map(|b| (*a, b)))
    {
        let (k_host, v_host) = (kept(k_dtype, &k), kept(v_dtype, &v));
        let (dq, dk, dv) = (
            device.alloc(q.len() as u64 * 4).unwrap(),
            device.alloc(k_host.len() as u64).unwrap(),
            device.alloc(v_host.len() as u64).unwrap(),
        );
        let mut launch = DecodeLaunch {
            q: dq,
            k: dk,
            v: dv,
            k_dtype,
            v_dtype,
            k_rows: layout(k_dtype),
            v_rows: layout(v_dtype),
            tokens,
            q_heads,
            kv_heads,
            head_dim: hd,
            partials: 0,
            out: device.alloc(q.len() as u64 * 4).unwrap(),
        };
        launch.partials = device.alloc(launch.partials_bytes()).unwrap();
        let last = tokens as u64 - 1;
        let staging = device.alloc(row as u64 * 4 * 2).unwrap();
        // SAFETY: every address was allocated above on this device with the sizes written.
        unsafe {
            device.copy_to_device(dq, &bytes(&q)).unwrap();
            // Everything but the last row by copy; the last row by the write kernel.
            let (kl, vl) = (layout(k_dtype).offset(last), layout(v_dtype).offset(last));
            device.copy_to_device(dk, &k_host[..kl as usize]).unwrap();
            device.copy_to_device(dv, &v_host[..vl as usize]).unwrap();
            let at = last as usize * row;
            device.copy_to_device(staging, &bytes(&k[at..])).unwrap();
            device
                .copy_to_device(staging + row as u64 * 4, &bytes(&v[at..]))
                .unwrap();
            kernels
                .write_row(&stream, k_dtype, dk + kl, staging, row as u32)
                .unwrap();
            kernels
                .write_row(
                    &stream,
                    v_dtype,
                    dv + vl,
                    staging + row as u64 * 4,
                    row as u32,
                )
                .unwrap();
            kernels.decode(&stream, &launch).unwrap();
        }
        stream.synchronize().unwrap();
        let read = |addr: u64, len: usize| {
            let mut out = vec![0u8; len];
            // SAFETY: allocated above with at least `len` bytes; the stream is idle.
            unsafe { device.copy_to_host(&mut out, addr).unwrap() };
            out
        };
        let got: Vec<f32> = read(launch.out, q.len() * 4)
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let (k_gpu, v_gpu) = (read(dk, k_host.len()), read(dv, v_host.len()));
        let pair = format!("K {k_dtype} V {v_dtype}");
        // The row the GPU wrote reads back as the host's within one step of its block.
        for (dtype, gpu, host) in [(k_dtype, &k_gpu, &k_host), (v_dtype, &v_gpu, &v_host)] {
            let rows = layout(dtype);
            let at = rows.offset(last) as usize..(rows.offset(last) + rows.row_bytes) as usize;
            let g = KvRows::from_bytes(dtype, &gpu[at.clone()])
                .unwrap()
                .to_f32_vec();
            let h = KvRows::from_bytes(dtype, &host[at]).unwrap().to_f32_vec();
            for (i, (a, b)) in g.iter().zip(&h).enumerate() {
                assert!(
                    (a - b).abs() <= 1.0 / 127.0 + 1e-6,
                    "{pair}: written value {i}: {a} vs {b}"
                );
            }
        }
        let mut want = vec![0f32; q.len()];
        gqa_decode_rows(
            &q,
            KvRows::from_layout(k_dtype, &k_gpu, tokens as usize, row, layout(k_dtype)).unwrap(),
            KvRows::from_layout(v_dtype, &v_gpu, tokens as usize, row, layout(v_dtype)).unwrap(),
            tokens as usize,
            Heads::new(32, 8, 128),
            &mut want,
        );
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(
                (a - b).abs() <= 1e-3 * b.abs().max(1.0),
                "{pair} element {i}: GPU {a} vs host {b}"
            );
        }
        for p in [dq, dk, dv, launch.out, launch.partials, staging] {
            // SAFETY: allocated above, freed once, the stream is idle.
            unsafe { device.free(p).unwrap() };
        }
    }
}
