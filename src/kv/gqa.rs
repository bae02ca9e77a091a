//! A grouped-query attention decode step over flat `past_key` / `past_value` buffers.
//!
//! The operator knows nothing of blocks or mappings: it reads `tokens × kv_heads × head_dim`
//! floats per buffer, laid out position-major, exactly as an ONNX GroupQueryAttention's
//! past inputs. The same code runs over a virtual buffer and over a `Vec`, so their outputs
//! can be compared bit for bit.

/// One decode step for one layer: `q` is `q_heads × head_dim`, `k` and `v` are
/// `tokens × kv_heads × head_dim`, `out` receives `q_heads × head_dim`. Query head `h`
/// attends with KV head `h / (q_heads / kv_heads)`; scores are scaled by `1/sqrt(head_dim)`
/// and softmax is max-subtracted.
#[allow(clippy::too_many_arguments)]
pub fn gqa_decode(
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
    let mut scores = vec![0f32; tokens];
    for h in 0..q_heads {
        let kvh = h / group;
        let qh = &q[h * head_dim..(h + 1) * head_dim];
        let mut max = f32::NEG_INFINITY;
        for (t, s) in scores.iter_mut().enumerate() {
            let kt = &k[t * stride + kvh * head_dim..t * stride + (kvh + 1) * head_dim];
            *s = dot(qh, kt) * scale;
            max = max.max(*s);
        }
        let mut sum = 0f32;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        let oh = &mut out[h * head_dim..(h + 1) * head_dim];
        oh.fill(0.0);
        for (t, s) in scores.iter().enumerate() {
            let p = s / sum;
            let vt = &v[t * stride + kvh * head_dim..t * stride + (kvh + 1) * head_dim];
            for (o, x) in oh.iter_mut().zip(vt) {
                *o += p * x;
            }
        }
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent accumulators let the compiler vectorise; the order is fixed, so the
    // result is the same for the same inputs wherever they live.
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for i in 0..8 {
            acc[i] += a[c * 8 + i] * b[c * 8 + i];
        }
    }
    let mut sum = acc.iter().sum::<f32>();
    for i in chunks * 8..a.len() {
        sum += a[i] * b[i];
    }
    sum
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
