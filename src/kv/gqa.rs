//! A grouped-query attention decode step over flat `past_key` / `past_value` buffers.
//!
//! The operator knows nothing of blocks or mappings: it reads `tokens × kv_heads × head_dim`
//! floats per buffer, laid out position-major, exactly as an ONNX GroupQueryAttention's
//! past inputs. The same code runs over a virtual buffer and over a `Vec`, so their outputs
//! can be compared bit for bit. K and V may be kept as `f32` or `f16` ([`KvElement`]); the
//! query and the output are `f32`, and `f16` rows are widened to `f32` as they are read.

use super::elem::KvElement;
use super::shape::KvDtype;

/// One decode step for one layer: `q` is `q_heads × head_dim`, `k` and `v` are
/// `tokens × kv_heads × head_dim`, `out` receives `q_heads × head_dim`. Query head `h`
/// attends with KV head `h / (q_heads / kv_heads)`; scores are scaled by `1/sqrt(head_dim)`
/// and softmax is max-subtracted.
#[allow(clippy::too_many_arguments)]
pub fn gqa_decode<T: KvElement>(
    q: &[f32],
    k: &[T],
    v: &[T],
    tokens: usize,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    out: &mut [f32],
) {
    if T::DTYPE == KvDtype::F16 {
        return gqa_widening(q, k, v, tokens, q_heads, kv_heads, head_dim, out);
    }
    // `T` is `f32` here: the cast is the identity.
    let (k, v): (&[f32], &[f32]) = (bytemuck::cast_slice(k), bytemuck::cast_slice(v));
    gqa_body(q, k, v, tokens, q_heads, kv_heads, head_dim, out)
}

/// The operator, compiled for the baseline and again with AVX2 enabled (eight lanes instead
/// of four), the version chosen once at run time by what the CPU supports (the `multiversion`
/// crate does the detection and the dispatch). The order of operations is the same in both,
/// so a given machine always produces the same bits.
#[multiversion::multiversion(targets("x86_64+avx2"))]
#[allow(clippy::too_many_arguments)]
fn gqa_body(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    tokens: usize,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    out: &mut [f32],
) {
    assert_eq!(q.len(), q_heads * head_dim, "q is q_heads x head_dim");
    assert!(k.len() >= tokens * kv_heads * head_dim && v.len() >= tokens * kv_heads * head_dim);
    assert_eq!(out.len(), q_heads * head_dim);
    let group = q_heads / kv_heads;
    let stride = kv_heads * head_dim;
    let scale = 1.0 / (head_dim as f32).sqrt();
    // Rows are read in address order, each token's K (then V) row once for every head:
    // the buffer streams through the cache like any flat array, whatever backs its pages.
    let mut scores = vec![0f32; q_heads * tokens];
    for t in 0..tokens {
        let row = &k[t * stride..][..stride];
        for h in 0..q_heads {
            let kh = &row[(h / group) * head_dim..][..head_dim];
            scores[h * tokens + t] = dot(&q[h * head_dim..][..head_dim], kh) * scale;
        }
    }
    softmax_rows(&mut scores, tokens, q_heads);
    out.fill(0.0);
    for t in 0..tokens {
        let row = &v[t * stride..][..stride];
        for h in 0..q_heads {
            let vh = &row[(h / group) * head_dim..][..head_dim];
            axpy(
                &mut out[h * head_dim..][..head_dim],
                scores[h * tokens + t],
                vh,
            );
        }
    }
}

/// The operator over 16-bit KV: each row is widened to `f32` once, then used as the `f32`
/// operator uses it (same order of operations).
#[allow(clippy::too_many_arguments)]
fn gqa_widening<T: KvElement>(
    q: &[f32],
    k: &[T],
    v: &[T],
    tokens: usize,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    out: &mut [f32],
) {
    assert_eq!(q.len(), q_heads * head_dim, "q is q_heads x head_dim");
    assert!(k.len() >= tokens * kv_heads * head_dim && v.len() >= tokens * kv_heads * head_dim);
    assert_eq!(out.len(), q_heads * head_dim);
    let group = q_heads / kv_heads;
    let stride = kv_heads * head_dim;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let mut row = vec![0f32; stride];
    let widen = |dst: &mut [f32], src: &[T]| {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = s.to_f32();
        }
    };
    let mut scores = vec![0f32; q_heads * tokens];
    for t in 0..tokens {
        widen(&mut row, &k[t * stride..][..stride]);
        for h in 0..q_heads {
            let kh = &row[(h / group) * head_dim..][..head_dim];
            scores[h * tokens + t] = dot(&q[h * head_dim..][..head_dim], kh) * scale;
        }
    }
    softmax_rows(&mut scores, tokens, q_heads);
    out.fill(0.0);
    for t in 0..tokens {
        widen(&mut row, &v[t * stride..][..stride]);
        for h in 0..q_heads {
            let vh = &row[(h / group) * head_dim..][..head_dim];
            axpy(
                &mut out[h * head_dim..][..head_dim],
                scores[h * tokens + t],
                vh,
            );
        }
    }
}

/// Max-subtracted softmax over each of `heads` rows of `tokens` scores.
#[inline(always)]
fn softmax_rows(scores: &mut [f32], tokens: usize, heads: usize) {
    for s in scores.chunks_exact_mut(tokens.max(1)).take(heads) {
        let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for x in s.iter_mut() {
            *x = (*x - max).exp();
            sum += *x;
        }
        let inv = 1.0 / sum;
        for x in s.iter_mut() {
            *x *= inv;
        }
    }
}

#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Thirty-two independent accumulators (four vector registers) break the add chain so the
    // compiler's vector code is not latency-bound; the order is fixed, so the result is the
    // same for the same inputs wherever they live.
    let mut acc = [0f32; 32];
    let (ac, bc) = (a.chunks_exact(32), b.chunks_exact(32));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        let x: &[f32; 32] = x.try_into().expect("chunks of 32");
        let y: &[f32; 32] = y.try_into().expect("chunks of 32");
        for i in 0..32 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut width = 16;
    while width > 0 {
        for i in 0..width {
            acc[i] += acc[i + width];
        }
        width /= 2;
    }
    acc[0] + tail
}

#[inline(always)]
fn axpy(out: &mut [f32], p: f32, x: &[f32]) {
    for (o, x) in out.iter_mut().zip(x) {
        *o += p * x;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attends_to_the_matching_key() {
        // Two tokens, one KV head, two query heads grouped on it.
        let (q_heads, kv_heads, d) = (2, 1, 2);
        let k = [100.0, 0.0, 0.0, 100.0];
        let v = [1.0, 2.0, 3.0, 4.0];
        let q = [1.0, 0.0, 0.0, 1.0];
        let mut out = [0f32; 4];
        gqa_decode(&q, &k, &v, 2, q_heads, kv_heads, d, &mut out);
        assert!(
            (out[0] - 1.0).abs() < 1e-3 && (out[1] - 2.0).abs() < 1e-3,
            "{out:?}"
        );
        assert!(
            (out[2] - 3.0).abs() < 1e-3 && (out[3] - 4.0).abs() < 1e-3,
            "{out:?}"
        );
    }

    #[test]
    fn f16_kv_gives_the_f32_result_of_its_widened_values() {
        // Values exactly representable in f16: the two paths see the same numbers.
        let (q_heads, kv_heads, d, tokens) = (4, 2, 8, 5);
        let k32: Vec<f32> = (0..tokens * kv_heads * d)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) / 8.0)
            .collect();
        let v32: Vec<f32> = (0..tokens * kv_heads * d)
            .map(|i| ((i * 5 % 11) as f32 - 5.0) / 4.0)
            .collect();
        let k16: Vec<half::f16> = k32.iter().map(|x| half::f16::from_f32(*x)).collect();
        let v16: Vec<half::f16> = v32.iter().map(|x| half::f16::from_f32(*x)).collect();
        let q: Vec<f32> = (0..q_heads * d).map(|i| (i as f32).sin()).collect();
        let (mut a, mut b) = (vec![0f32; q_heads * d], vec![0f32; q_heads * d]);
        gqa_decode(&q, &k32, &v32, tokens, q_heads, kv_heads, d, &mut a);
        gqa_decode(&q, &k16, &v16, tokens, q_heads, kv_heads, d, &mut b);
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 1e-6 * x.abs().max(1.0), "{a:?} vs {b:?}");
        }
    }

    #[test]
    fn one_token_returns_its_value() {
        let mut out = [0f32; 4];
        gqa_decode(
            &[0.3, -1.0, 2.0, 0.5],
            &[1.0, 1.0],
            &[7.0, -7.0],
            1,
            2,
            1,
            2,
            &mut out,
        );
        assert_eq!(out, [7.0, -7.0, 7.0, -7.0]);
    }
}
