//! One sequence's KV memory without actors: bit-identical decoding against a `Vec`, growth
//! that rolls back at every failure point, prefix sharing and copy on write, all checked
//! against the kernel's count of physical pages.
#![cfg(target_os = "linux")]

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use procmem::host::HostMechanism;
use procmem::kv::{gqa_decode, KvDtype, KvError, KvPart, KvSequence, KvShape};
use procmem::{
    CommitResult, DecommitResult, HostBacking, MapAccess, MechanismId, MemoryError,
    MemoryMechanism, Place, VirtualAllocation, VirtualBacking, VirtualRequest,
};

const SHAPE: KvShape = KvShape {
    layers: 2,
    q_heads: 8,
    kv_heads: 2,
    head_dim: 16,
    max_tokens: 1100,
    k_dtype: KvDtype::F32,
    v_dtype: KvDtype::F32,
};

/// Deterministic pseudo-random floats in [-1, 1).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next()).collect()
    }
}

/// A backing that fails the `n`-th commit from now on (counting from zero).
struct FailingBacking {
    inner: Arc<HostBacking>,
    fail_at: AtomicUsize,
}

impl VirtualBacking for FailingBacking {
    fn mechanism(&self) -> MechanismId {
        VirtualBacking::mechanism(self.inner.as_ref())
    }
    fn place(&self) -> Place {
        self.inner.place()
    }
    fn granularity(&self) -> u64 {
        VirtualBacking::granularity(self.inner.as_ref())
    }
    fn reserve(&self, request: &VirtualRequest) -> Result<VirtualAllocation, MemoryError> {
        self.inner.reserve(request)
    }
    fn commit_range(
        &self,
        a: &mut VirtualAllocation,
        r: Range<u64>,
    ) -> Result<CommitResult, MemoryError> {
        if self.fail_at.fetch_sub(1, Ordering::SeqCst) == 0 {
            return Err(MemoryError::OutOfMemory {
                op: "injected mapping failure",
                bytes: r.end - r.start,
            });
        }
        self.inner.commit_range(a, r)
    }
    fn decommit_range(
        &self,
        a: &mut VirtualAllocation,
        r: Range<u64>,
    ) -> Result<DecommitResult, MemoryError> {
        self.inner.decommit_range(a, r)
    }
    fn committed_bytes(&self, a: &VirtualAllocation) -> Result<u64, MemoryError> {
        self.inner.committed_bytes(a)
    }
}

fn append(seq: &mut KvSequence, kv: &[(Vec<f32>, Vec<f32>)]) -> Result<(), KvError> {
    let per = seq.growth_for(1);
    if !per.is_empty() {
        let g = seq.map_growth(per)?;
        seq.publish(g);
    }
    let pos = seq.tokens();
    for (layer, (k, v)) in kv.iter().enumerate() {
        seq.write(layer, pos, k, v)?;
    }
    seq.advance()
}

#[test]
fn a_thousand_decode_steps_match_a_plain_vec_bit_for_bit() {
    let host = HostMechanism::new().unwrap();
    let backing = host.backing();
    let mut seq = KvSequence::reserve(backing.clone(), SHAPE, 4).unwrap();
    let mut reference: Vec<(Vec<f32>, Vec<f32>)> = vec![(Vec::new(), Vec::new()); SHAPE.layers];
    let mut rng = Lcg(7);
    let tf = SHAPE.token_elems();
    let base: Vec<u64> = seq.buffers().iter().map(|b| b.addr()).collect();
    for step in 0..1000 {
        let kv: Vec<_> = (0..SHAPE.layers)
            .map(|_| (rng.vec(tf), rng.vec(tf)))
            .collect();
        append(&mut seq, &kv).unwrap();
        for (layer, (k, v)) in kv.iter().enumerate() {
            reference[layer].0.extend_from_slice(k);
            reference[layer].1.extend_from_slice(v);
        }
        for (layer, (rk, rv)) in reference.iter().enumerate() {
            let q = rng.vec(SHAPE.q_heads * SHAPE.head_dim);
            let mut ours = vec![0f32; q.len()];
            let mut theirs = vec![0f32; q.len()];
            gqa_decode(
                &q,
                seq.keys::<f32>(layer).unwrap(),
                seq.values::<f32>(layer).unwrap(),
                step + 1,
                SHAPE.heads(),
                &mut ours,
            );
            gqa_decode(&q, rk, rv, step + 1, SHAPE.heads(), &mut theirs);
            let same = ours
                .iter()
                .zip(&theirs)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "step {step} layer {layer} differs");
        }
    }
    let now: Vec<u64> = seq.buffers().iter().map(|b| b.addr()).collect();
    assert_eq!(base, now, "no buffer ever moved");
    let chunk = 4 * procmem::granularity();
    let tokens_bytes = 1000 * SHAPE.token_bytes(KvPart::K);
    let per_buffer = seq.mapped_bytes() / SHAPE.buffers() as u64;
    assert!(
        per_buffer >= tokens_bytes && per_buffer < tokens_bytes + chunk,
        "at most one chunk ahead"
    );
    assert_eq!(
        backing.resident_bytes().unwrap(),
        seq.exclusive_bytes(),
        "what we hold is what the kernel counts"
    );
}

#[test]
fn a_mapping_failure_at_every_point_of_a_growth_changes_nothing() {
    let host = HostMechanism::new().unwrap();
    for fail_at in 0..SHAPE.buffers() {
        let failing = Arc::new(FailingBacking {
            inner: host.backing(),
            fail_at: AtomicUsize::new(usize::MAX),
        });
        let mut seq = KvSequence::reserve(failing.clone(), SHAPE, 1).unwrap();
        let mut rng = Lcg(fail_at as u64);
        let tf = SHAPE.token_elems();
        let block = SHAPE.block_tokens(procmem::granularity());
        for _ in 0..block {
            let kv: Vec<_> = (0..SHAPE.layers)
                .map(|_| (rng.vec(tf), rng.vec(tf)))
                .collect();
            append(&mut seq, &kv).unwrap();
        }
        let before_keys = seq.keys::<f32>(1).unwrap().to_vec();
        let before = (
            seq.tokens(),
            seq.mapped_bytes(),
            seq.exclusive_bytes(),
            host.backing().resident_bytes().unwrap(),
        );
        failing.fail_at.store(fail_at, Ordering::SeqCst);
        let kv: Vec<_> = (0..SHAPE.layers)
            .map(|_| (rng.vec(tf), rng.vec(tf)))
            .collect();
        let err = append(&mut seq, &kv).unwrap_err();
        assert!(
            matches!(err, KvError::Memory(MemoryError::OutOfMemory { .. })),
            "{err}"
        );
        let after = (
            seq.tokens(),
            seq.mapped_bytes(),
            seq.exclusive_bytes(),
            host.backing().resident_bytes().unwrap(),
        );
        assert_eq!(before, after, "failure at commit {fail_at} left a trace");
        assert!(
            seq.keys::<f32>(1).unwrap() == &before_keys[..],
            "the old view is intact and readable"
        );
        failing.fail_at.store(usize::MAX, Ordering::SeqCst);
        append(&mut seq, &kv).unwrap();
        drop(seq);
        assert_eq!(host.backing().resident_bytes().unwrap(), 0);
    }
}

#[test]
fn shared_prefixes_cost_only_the_unshared_part_and_copy_on_write_isolates() {
    let host = HostMechanism::new().unwrap();
    let backing = host.backing();
    let mapping = host.shared_mapping().unwrap();
    let g = procmem::granularity();
    let block_tokens = SHAPE.block_tokens(g);
    let blocks_n = 3;
    let prefix_tokens = block_tokens * blocks_n;
    let tf = SHAPE.token_elems();
    let mut rng = Lcg(99);
    let prefix_kv: Vec<Vec<(Vec<f32>, Vec<f32>)>> = (0..prefix_tokens)
        .map(|_| {
            (0..SHAPE.layers)
                .map(|_| (rng.vec(tf), rng.vec(tf)))
                .collect()
        })
        .collect();

    // The first sequence fills new blocks through read-write mappings.
    let blocks: Vec<_> = (0..blocks_n * SHAPE.buffers())
        .map(|_| {
            mapping
                .create_block(SHAPE.block_bytes(KvPart::K, g))
                .unwrap()
        })
        .collect();
    let mut writer = KvSequence::reserve(backing.clone(), SHAPE, 1).unwrap();
    writer
        .attach_prefix(mapping, &blocks, &[MapAccess::ReadWrite; 3], 0)
        .unwrap();
    for (pos, kv) in prefix_kv.iter().enumerate() {
        for (layer, (k, v)) in kv.iter().enumerate() {
            writer.write(layer, pos, k, v).unwrap();
        }
        writer.advance().unwrap();
    }
    let block_bytes_total = (blocks_n * SHAPE.buffers()) as u64 * SHAPE.block_bytes(KvPart::K, g);
    assert_eq!(backing.resident_bytes().unwrap(), block_bytes_total);

    // Readers map the same blocks read-only: no new physical memory for the prefix.
    let mut readers: Vec<KvSequence> = (0..2)
        .map(|_| {
            let mut s = KvSequence::reserve(backing.clone(), SHAPE, 1).unwrap();
            s.attach_prefix(mapping, &blocks, &[MapAccess::ReadOnly; 3], prefix_tokens)
                .unwrap();
            s
        })
        .collect();
    assert_eq!(
        backing.resident_bytes().unwrap(),
        block_bytes_total,
        "sharing cost nothing physical"
    );
    assert!(
        readers[0].keys::<f32>(0).unwrap() == writer.keys::<f32>(0).unwrap(),
        "readers see the writer's prefix"
    );

    // Each reader decodes on its own: physical memory grows by its unshared part only.
    for r in &mut readers {
        for _ in 0..5 {
            let kv: Vec<_> = (0..SHAPE.layers)
                .map(|_| (rng.vec(tf), rng.vec(tf)))
                .collect();
            append(r, &kv).unwrap();
        }
    }
    let unshared: u64 = readers.iter().map(|r| r.exclusive_bytes()).sum();
    assert_eq!(
        backing.resident_bytes().unwrap(),
        block_bytes_total + unshared
    );

    // Writing into a shared block is refused until the block is copied on write.
    let pos = block_tokens + 1;
    let new_k = vec![42.0f32; tf];
    assert!(matches!(
        readers[0].write(0, pos, &new_k, &new_k),
        Err(KvError::SharedBlock(_))
    ));
    let expected_copy = readers[0].copy_on_write_bytes(pos);
    assert_eq!(
        expected_copy,
        SHAPE.buffers() as u64 * SHAPE.block_bytes(KvPart::K, g)
    );
    let before = backing.resident_bytes().unwrap();
    assert_eq!(readers[0].copy_on_write(pos).unwrap(), expected_copy);
    assert_eq!(backing.resident_bytes().unwrap(), before + expected_copy);
    let prefix_floats = prefix_tokens * tf;
    assert!(
        readers[0].keys::<f32>(0).unwrap()[..prefix_floats] == writer.keys::<f32>(0).unwrap()[..],
        "the copy holds the same bytes"
    );
    readers[0].write(0, pos, &new_k, &new_k).unwrap();
    let start = pos * tf;
    assert!(
        readers[0].keys::<f32>(0).unwrap()[start..start + tf] == new_k[..],
        "the writer of the copy sees its write"
    );
    assert!(
        writer.keys::<f32>(0).unwrap()[start..start + tf] != new_k[..],
        "the writer's view is unchanged"
    );
    assert!(
        readers[1].keys::<f32>(0).unwrap()[start..start + tf] != new_k[..],
        "other readers are unchanged"
    );

    drop((writer, readers));
    assert_eq!(
        backing.resident_bytes().unwrap(),
        block_bytes_total,
        "the blocks live while handles remain"
    );
    drop(blocks);
    assert_eq!(
        backing.resident_bytes().unwrap(),
        0,
        "the last user frees the blocks"
    );
}

/// What a swap copies out and back, asked for wrongly: a buffer past the model, more rows than
/// are mapped, a destination of the wrong length, rows that do not fill whole tokens. Each is a
/// typed refusal and the sequence is unchanged; the right call round-trips the bytes.
#[test]
fn swap_copies_refuse_wrong_buffers_lengths_and_rows() {
    let host = HostMechanism::new().unwrap();
    let backing: Arc<dyn VirtualBacking> = host.backing();
    let mut seq = KvSequence::reserve(backing, SHAPE, 1).unwrap();
    let rows: Vec<(Vec<f32>, Vec<f32>)> = (0..3)
        .map(|t| {
            let row: Vec<f32> = (0..SHAPE.token_elems())
                .map(|i| (t * 100 + i) as f32)
                .collect();
            (row.clone(), row)
        })
        .collect();
    for row in &rows {
        append(&mut seq, std::slice::from_ref(row)).unwrap();
    }
    let tb = SHAPE.token_bytes(KvPart::K) as usize;
    let mut out = vec![0u8; 3 * tb];
    seq.read_buffer(1, 3, &mut out).unwrap();
    let mut wrong = vec![0u8; 3 * tb - 1];
    assert!(
        seq.read_buffer(1, 3, &mut wrong).is_err(),
        "destination too short"
    );
    assert!(
        seq.read_buffer(SHAPE.buffers(), 3, &mut out).is_err(),
        "no such buffer"
    );
    assert!(seq.read_buffer(usize::MAX, 3, &mut out).is_err());
    let mut huge = vec![0u8; 0];
    assert!(
        seq.read_buffer(0, usize::MAX, &mut huge).is_err(),
        "rows not mapped"
    );
    assert!(
        seq.write_buffer_bytes(0, &out[..tb + 1]).is_err(),
        "not whole rows"
    );
    assert!(seq.write_buffer_bytes(usize::MAX, &out).is_err());
    let too_many = vec![0u8; (seq.mapped_bytes() / SHAPE.buffers() as u64) as usize + tb];
    assert!(
        seq.write_buffer_bytes(0, &too_many).is_err(),
        "past what is mapped"
    );
    // Nothing changed; the bytes read out go back where they came from.
    let mut again = vec![0u8; 3 * tb];
    seq.read_buffer(1, 3, &mut again).unwrap();
    assert_eq!(out, again);
    seq.write_buffer_bytes(0, &out).unwrap();
    seq.read_buffer(0, 3, &mut again).unwrap();
    assert_eq!(out, again);
    // Rows from a position: rows 0 and 1 written again at 1 and 2.
    seq.write_buffer_rows(0, 1, &out[..2 * tb]).unwrap();
    seq.read_buffer(0, 3, &mut again).unwrap();
    assert_eq!(again, [&out[..tb], &out[..2 * tb]].concat());
    seq.write_buffer_rows(0, 0, &out).unwrap();
    for from in [usize::MAX, usize::MAX / tb, seq.mapped_tokens()] {
        assert!(
            seq.write_buffer_rows(0, from, &out[..tb]).is_err(),
            "from {from}: past what is mapped"
        );
    }
    assert!(seq.write_buffer_rows(0, 1, &out[..tb + 1]).is_err());
    seq.read_buffer(0, 3, &mut again).unwrap();
    assert_eq!(again, out, "refused writes changed nothing");
}
