//! The loader over 10,000 mutated files (a byte, a field of 8 bytes with a boundary value, or a
//! cut, anywhere in the header or the data): no panic, no abort, every rejection a typed error,
//! and no single allocation larger than a small multiple of the file (nothing is sized from a
//! count before the count is checked against the bytes left).
//!
//! One test in this binary: the allocation counter is global.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use procmem_fixture as fixture;
use procmem_model::gguf::Gguf;
use procmem_model::{Smol, TextCodec};
use proptest::prelude::*;

struct Largest;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator unchanged; only records the largest request.
unsafe impl GlobalAlloc for Largest {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's layout is passed on as it came.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        // SAFETY: as for `alloc` and `dealloc`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Largest = Largest;

#[derive(Debug, Clone)]
enum Mutation {
    Byte(usize, u8),
    Field(usize, u64),
    Cut(usize),
}

fn mutation(len: usize) -> impl Strategy<Value = Mutation> {
    let boundary = prop_oneof![
        Just(0u64),
        Just(1),
        Just(u64::MAX),
        Just(u64::MAX / 2),
        Just(u32::MAX as u64),
        Just(1 << 32),
        Just(1 << 40),
        Just(1 << 62),
        any::<u64>(),
    ];
    prop_oneof![
        (0..len, any::<u8>()).prop_map(|(at, b)| Mutation::Byte(at, b)),
        (0..len - 8, boundary).prop_map(|(at, v)| Mutation::Field(at, v)),
        (0..len).prop_map(Mutation::Cut),
    ]
}

#[test]
fn mutated_files_never_panic_abort_or_overallocate() {
    let valid = fixture::tiny_llama();
    let dir = std::env::temp_dir().join(format!("procmem-gguf-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("m.gguf");
    let cases = std::env::var("PROCMEM_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let (loaded, refused) = (std::cell::Cell::new(0u32), std::cell::Cell::new(0u32));
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    runner
        .run(&mutation(valid.len()), |m| {
            let mut bytes = valid.clone();
            match m {
                Mutation::Byte(at, b) => bytes[at] = b,
                Mutation::Field(at, v) => bytes[at..at + 8].copy_from_slice(&v.to_le_bytes()),
                Mutation::Cut(at) => bytes.truncate(at),
            }
            std::fs::write(&path, &bytes).unwrap();
            // The reader, which meets the hostile bytes: nothing it allocates is sized from a
            // claim before the claim is checked against the file. Its largest structures are
            // typed arrays and the key-value map, a few bytes of memory per byte read.
            LARGEST.store(0, Ordering::Relaxed);
            let read = Gguf::open(&path).and_then(|mut g| {
                g.config()?;
                g.tokenizer()?;
                let names: Vec<String> = g.tensor_names().map(str::to_owned).collect();
                for name in names {
                    g.raw(&name)?;
                }
                Ok(())
            });
            let largest = LARGEST.load(Ordering::Relaxed);
            prop_assert!(
                largest <= 4 * valid.len() + (8 << 10),
                "{m:?}: an allocation of {largest} bytes for a file of {}",
                bytes.len()
            );
            // Then the model on what passed (candle's tensors, the tokenizer): it must
            // agree with the reader, and never panic.
            let result = Smol::load(&path).and_then(|l| TextCodec::new(&l.tokenizer));
            prop_assert!(
                read.is_ok() || result.is_err(),
                "{m:?}: the reader refused what the model loaded"
            );
            match result {
                Ok(_) => loaded.set(loaded.get() + 1),
                Err(_) => refused.set(refused.get() + 1),
            }
            Ok(())
        })
        .unwrap();
    std::fs::remove_dir_all(&dir).ok();
    let (loaded, refused) = (loaded.get(), refused.get());
    println!("gguf_fuzz: {cases} mutated files, {refused} refused with an error, {loaded} loaded (a float or a token changed), 0 panics");
    assert_eq!(loaded + refused, cases);
}
