//! KV in eight bits (`q8_0`): the operators over quantized rows held to an `f64` reference on
//! the dequantized values, the row write quantizing in place in a sequence's mapped buffers,
//! and the shapes that cannot hold it refused with a typed error.
#![cfg(target_os = "linux")]

use procmem::host::HostMechanism;
use procmem::kv::{
    gqa_causal_rows, gqa_decode, gqa_decode_rows, q8_0, Heads, KvDtype, KvError, KvPart, KvRows,
    KvSequence, KvShape, ShapeError, SPLIT_TOKENS,
};
use procmem::MemoryMechanism;

/// Deterministic pseudo-random floats in [-1, 1), some rows far larger than others (so a
/// block's scale matters).
fn data(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|i| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
            u * (1 + (i / 64) % 5) as f32
        })
        .collect()
}

/// Blocks one after the other, as rows.
fn q8(blocks: &[u8]) -> KvRows<'_> {
    KvRows::from_bytes(KvDtype::Q8_0, blocks).unwrap()
}

fn quantized(x: &[f32]) -> Vec<u8> {
    let mut q = vec![0u8; q8_0::bytes_for(x.len()).unwrap()];
    q8_0::quantize(x, &mut q);
    q
}

/// The decode step in `f64`, one value at a time, over K and V as `f64`s.
fn reference(q: &[f32], k: &[f64], v: &[f64], tokens: usize, h: Heads) -> Vec<f64> {
    let (stride, group) = (h.kv * h.dim, h.q / h.kv);
    let scale = 1.0 / (h.dim as f64).sqrt();
    let mut out = vec![0f64; h.q * h.dim];
    for qh in 0..h.q {
        let kv = (qh / group) * h.dim;
        let s: Vec<f64> = (0..tokens)
            .map(|t| {
                (0..h.dim)
                    .map(|d| f64::from(q[qh * h.dim + d]) * k[t * stride + kv + d])
                    .sum::<f64>()
                    * scale
            })
            .collect();
        let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = s.iter().map(|x| (x - max).exp()).collect();
        let sum: f64 = e.iter().sum();
        for (t, p) in e.iter().enumerate() {
            for d in 0..h.dim {
                out[qh * h.dim + d] += p / sum * v[t * stride + kv + d];
            }
        }
    }
    out
}

fn widened(rows: KvRows<'_>) -> Vec<f64> {
    rows.to_f32_vec().into_iter().map(f64::from).collect()
}

/// The fast operator over q8_0 K and V (and mixed with f16 and f32) is within 1e-4 of the
/// `f64` step over the values the blocks hold, at several splits and both common head sizes;
/// and it gives the very bits of the `f32` operator over those values.
#[test]
fn decode_over_q8_0_rows_matches_an_f64_reference_on_the_dequantized_values() {
    for (h, tokens) in [
        (Heads::new(9, 3, 64), 3 * SPLIT_TOKENS + 17),
        (Heads::new(32, 8, 128), SPLIT_TOKENS + 1),
        (Heads::new(4, 4, 32), 5),
    ] {
        let n = tokens * h.kv * h.dim;
        let (k, v) = (data(n, 1), data(n, 2));
        let q = data(h.q * h.dim, 3);
        let (kq, vq) = (quantized(&k), quantized(&v));
        let v16: Vec<half::f16> = v.iter().map(|x| half::f16::from_f32(*x)).collect();
        for (kr, vr) in [
            (q8(&kq), q8(&vq)),
            (q8(&kq), KvRows::F16(&v16)),
            (KvRows::F32(&k), q8(&vq)),
        ] {
            let mut out = vec![0f32; h.q * h.dim];
            gqa_decode_rows(&q, kr, vr, tokens, h, &mut out);
            let want = reference(&q, &widened(kr), &widened(vr), tokens, h);
            for (i, (a, b)) in out.iter().zip(&want).enumerate() {
                let tol = 1e-4 * b.abs().max(1.0);
                assert!(
                    (f64::from(*a) - b).abs() <= tol,
                    "{h:?} {:?}/{:?} value {i}: {a} vs {b}",
                    kr.dtype(),
                    vr.dtype()
                );
            }
            let (k32, v32) = (kr.to_f32_vec(), vr.to_f32_vec());
            let mut plain = vec![0f32; out.len()];
            gqa_decode(&q, &k32, &v32, tokens, h, &mut plain);
            assert_eq!(out, plain, "widened rows give the f32 operator's bits");
        }
        // The quantization error itself, against the f32 values: a few percent of the outputs
        // at most (values up to 5 step by up to 0.04; the model's own loss is the kv_quant
        // bench's).
        let mut exact = vec![0f32; h.q * h.dim];
        gqa_decode(&q, &k, &v, tokens, h, &mut exact);
        let mut quant = vec![0f32; exact.len()];
        gqa_decode_rows(&q, q8(&kq), q8(&vq), tokens, h, &mut quant);
        let err = exact
            .iter()
            .zip(&quant)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        let big = exact.iter().fold(0f32, |m, x| m.max(x.abs()));
        assert!(
            err < 0.05 * big,
            "{h:?}: q8_0 moved an output by {err} of {big}"
        );
    }
}

/// A causal chunk over q8_0 rows gives each row the bits of its own decode step.
#[test]
fn a_causal_chunk_over_q8_0_gives_each_row_its_decode_bits() {
    let h = Heads::new(9, 3, 64);
    let (w, stride) = (h.q * h.dim, h.kv * h.dim);
    for (start, rows) in [(0, 40), (250, 19), (0, 1)] {
        let kq = quantized(&data((start + rows) * stride, 4));
        let vq = quantized(&data((start + rows) * stride, 5));
        let q = data(rows * w, 6);
        let mut out = vec![0f32; q.len()];
        gqa_causal_rows(&q, q8(&kq), q8(&vq), start, h, &mut out);
        for j in 0..rows {
            let t = start + j + 1;
            let (k, v) = (q8(&kq), q8(&vq));
            let mut want = vec![0f32; w];
            let seen = 0..t * stride;
            gqa_decode_rows(
                &q[j * w..][..w],
                k.slice(seen.clone()),
                v.slice(seen),
                t,
                h,
                &mut want,
            );
            assert_eq!(out[j * w..][..w], want[..], "row {j} from {start}");
        }
    }
}

const SHAPE: KvShape = KvShape {
    layers: 2,
    q_heads: 9,
    kv_heads: 3,
    head_dim: 64,
    max_tokens: 2048,
    k_dtype: KvDtype::Q8_0,
    v_dtype: KvDtype::Q8_0,
};

/// A sequence kept in q8_0 takes 204 bytes a token per buffer, 20 rows to a page (16 bytes
/// spare); a row written from `f32` is quantized in place and reads back as the blocks
/// `q8_0::quantize` makes, the spare bytes untouched; the operator over the grouped rows gives
/// the bits it gives over the same blocks one after the other; typed writes and reads of
/// another type are refused; the views say where the rows are.
#[test]
fn a_q8_0_sequence_quantizes_rows_as_they_are_written() {
    let host = HostMechanism::new().unwrap();
    let mut seq = KvSequence::reserve(host.backing(), SHAPE, 64).unwrap();
    let elems = SHAPE.token_elems();
    assert_eq!(SHAPE.token_bytes(KvPart::K), 204);
    let rows = 300;
    let grow = seq.growth_for(rows);
    let growth = seq.map_growth(grow).unwrap();
    seq.publish(growth);
    let (k, v) = (data(rows * elems, 7), data(rows * elems, 8));
    for layer in 0..SHAPE.layers {
        seq.write_rows_f32(layer, 0, &k[..100 * elems], &v[..100 * elems])
            .unwrap();
        seq.write_rows_f32(layer, 100, &k[100 * elems..], &v[100 * elems..])
            .unwrap();
    }
    seq.advance_by(rows).unwrap();
    let (kr, vr) = seq.rows_upto(1, rows).unwrap();
    let (kq, vq) = (quantized(&k), quantized(&v));
    assert_eq!(kr, q8(&kq));
    assert_eq!(vr, q8(&vq));
    let h = SHAPE.heads();
    let q = data(h.q * h.dim, 9);
    let (mut grouped, mut dense) = (vec![0f32; q.len()], vec![0f32; q.len()]);
    gqa_decode_rows(&q, kr, vr, rows, h, &mut grouped);
    gqa_decode_rows(&q, q8(&kq), q8(&vq), rows, h, &mut dense);
    assert_eq!(grouped, dense, "grouped rows read as the same values");
    assert!(matches!(
        seq.write_rows(0, 0, &k[..elems], &v[..elems]),
        Err(KvError::WrongType {
            kept: KvDtype::Q8_0,
            asked: KvDtype::F32
        })
    ));
    assert!(matches!(
        seq.keys::<half::f16>(0),
        Err(KvError::WrongType { .. })
    ));
    assert!(matches!(
        seq.write_rows_f32(0, 0, &k[..elems - 32], &v[..elems - 32]),
        Err(KvError::WrongLength { .. })
    ));
    let views = seq.views(0, rows).unwrap();
    assert_eq!(
        (
            views.k.dtype,
            views.k.token_stride,
            views.k.head_stride,
            views.k.group_rows,
            views.k.group_stride
        ),
        (KvDtype::Q8_0, 204, 68, 20, 4096)
    );
    assert_eq!(views.k.row_addr(41), Some(views.k.addr + 2 * 4096 + 204));
    assert_eq!(views.k.bytes(), 15 * 4096);
    // The bytes a swap copies are the pages, as they are: every row in its place, and the
    // spare 16 bytes of each page never written.
    let bytes = seq.buffer_bytes(2, rows).unwrap();
    assert_eq!(bytes.len(), 15 * 4096);
    for (page, blocks) in bytes.chunks_exact(4096).zip(kq.chunks(20 * 204)) {
        assert_eq!(&page[..20 * 204], blocks);
        assert_eq!(page[20 * 204..], [0u8; 16]);
    }
}

/// A head that is not whole blocks of 32 refuses q8_0 with a typed error, before anything is
/// reserved.
#[test]
fn a_head_of_partial_blocks_refuses_q8_0() {
    let host = HostMechanism::new().unwrap();
    let bad = KvShape {
        head_dim: 48,
        q_heads: 3,
        kv_heads: 3,
        ..SHAPE
    };
    match KvSequence::reserve(host.backing(), bad, 4) {
        Err(KvError::Shape(ShapeError::PartialBlock {
            dtype: KvDtype::Q8_0,
            block: 32,
            head_dim: 48,
        })) => {}
        other => panic!("expected a partial-block refusal, got {other:?}"),
    }
    assert!(KvShape {
        k_dtype: KvDtype::F16,
        v_dtype: KvDtype::F16,
        ..bad
    }
    .validate(4096)
    .is_ok());
}

/// K kept in f16 and V in q8_0 (llama.cpp's `-ctk f16 -ctv q8_0`): each part grows by its own
/// rows, prefix blocks of the two sizes attach and share, copy on write takes a block of each,
/// and the kernel counts exactly the pages the sequence says it holds.
#[test]
fn k_and_v_of_different_types_grow_share_and_copy_by_their_own_rows() {
    let host = HostMechanism::new().unwrap();
    let backing = host.backing();
    let mapping = host.shared_mapping().unwrap();
    let g = procmem::granularity();
    let shape = KvShape {
        k_dtype: KvDtype::F16,
        ..SHAPE
    };
    let (tk, tv) = (shape.token_bytes(KvPart::K), shape.token_bytes(KvPart::V));
    assert_eq!((tk, tv), (384, 204));
    let bt = shape.block_tokens(g);
    assert_eq!(
        bt, 160,
        "whole pages in K (15, 32 rows to 3) and in V (8, 20 rows to 1)"
    );
    assert_eq!(
        (
            shape.block_bytes(KvPart::K, g),
            shape.block_bytes(KvPart::V, g)
        ),
        (15 * 4096, 8 * 4096)
    );
    let elems = shape.token_elems();

    // Growth maps each part by its own rows.
    let mut seq = KvSequence::reserve(backing.clone(), shape, 1).unwrap();
    let growth = seq.growth_for(100);
    assert_eq!(
        (growth.k, growth.v),
        (
            (100 * tk).next_multiple_of(g),
            (100 / 20 * 4096u64).next_multiple_of(g)
        )
    );
    assert_eq!(growth.bytes(), 2 * (growth.k + growth.v));
    let pending = seq.map_growth(growth).unwrap();
    assert_eq!(pending.bytes(), growth.bytes());
    seq.publish(pending);
    assert_eq!(
        seq.mapped_tokens(),
        shape.rows(KvPart::V).rows_within(growth.v) as usize,
        "V runs out first"
    );
    let (k, v) = (data(100 * elems, 9), data(100 * elems, 10));
    for layer in 0..shape.layers {
        seq.write_rows_f32(layer, 0, &k, &v).unwrap();
    }
    seq.advance_by(100).unwrap();
    let (kr, vr) = seq.rows_upto(0, 100).unwrap();
    assert_eq!(kr.dtype(), KvDtype::F16);
    assert_eq!(vr, q8(&quantized(&v)));
    let f16s: Vec<f32> = k.iter().map(|x| half::f16::from_f32(*x).to_f32()).collect();
    assert_eq!(kr.to_f32_vec(), f16s);
    assert_eq!(backing.resident_bytes().unwrap(), seq.exclusive_bytes());
    assert_eq!(seq.exclusive_bytes(), growth.bytes());
    drop(seq);

    // One block of the prefix: a K block and a V block per layer, of their own sizes.
    let blocks: Vec<_> = (0..shape.buffers())
        .map(|b| {
            let part = KvPart::of_buffer(b);
            mapping.create_block(shape.block_bytes(part, g)).unwrap()
        })
        .collect();
    let mut writer = KvSequence::reserve(backing.clone(), shape, 1).unwrap();
    writer
        .attach_prefix(mapping, &blocks, &[procmem::MapAccess::ReadWrite], 0)
        .unwrap();
    let (pk, pv) = (data(bt * elems, 11), data(bt * elems, 12));
    for layer in 0..shape.layers {
        writer.write_rows_f32(layer, 0, &pk, &pv).unwrap();
    }
    writer.advance_by(bt).unwrap();
    let mut reader = KvSequence::reserve(backing.clone(), shape, 1).unwrap();
    reader
        .attach_prefix(mapping, &blocks, &[procmem::MapAccess::ReadOnly], bt)
        .unwrap();
    assert_eq!(
        reader.rows_upto(1, bt).unwrap(),
        writer.rows_upto(1, bt).unwrap()
    );
    let shared = shape.block_bytes_all(g);
    assert_eq!(
        backing.resident_bytes().unwrap(),
        shared,
        "one copy for both"
    );
    // Blocks of one size for both parts are refused: V's would not hold the tokens said.
    let same: Vec<_> = (0..shape.buffers())
        .map(|_| {
            mapping
                .create_block(shape.block_bytes(KvPart::V, g))
                .unwrap()
        })
        .collect();
    let mut bad = KvSequence::reserve(backing.clone(), shape, 1).unwrap();
    assert!(matches!(
        bad.attach_prefix(mapping, &same, &[procmem::MapAccess::ReadOnly], bt),
        Err(KvError::BadPrefix)
    ));
    drop((bad, same));
    // Copy on write takes a private copy of the K block and the V block of every layer.
    assert!(matches!(
        reader.write_rows_f32(0, 5, &pk[..elems], &pv[..elems]),
        Err(KvError::SharedBlock(5))
    ));
    assert_eq!(reader.copy_on_write_bytes(5), shared);
    assert_eq!(reader.copy_on_write(5).unwrap(), shared);
    reader
        .write_rows_f32(0, 5, &pk[..elems], &pv[..elems])
        .unwrap();
    assert_eq!(backing.resident_bytes().unwrap(), 2 * shared);
    assert_eq!(
        writer.rows_upto(1, bt).unwrap(),
        reader.rows_upto(1, bt).unwrap(),
        "layer 1 of the copy is the same bytes"
    );
}
