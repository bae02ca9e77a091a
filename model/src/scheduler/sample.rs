//! Choosing the next token: greedy, or from the softmax at a temperature, cut to the nucleus.

use rand::rngs::StdRng;
use rand::Rng;

use super::types::{Penalties, Sampling, TokenLogprobs};

/// `logits` changed by `p` after the completion produced `generated`: each token's bias
/// added, the presence penalty subtracted once from every token produced, the frequency
/// penalty once per time it was.
pub fn adjust(logits: &mut [f32], p: &Penalties, generated: &[u32]) {
    for &(token, bias) in &p.logit_bias {
        if let Some(l) = logits.get_mut(token as usize) {
            *l += bias;
        }
    }
    if p.presence == 0.0 && p.frequency == 0.0 {
        return;
    }
    let mut counts = std::collections::HashMap::<u32, u32>::new();
    for &t in generated {
        *counts.entry(t).or_default() += 1;
    }
    for (token, n) in counts {
        if let Some(l) = logits.get_mut(token as usize) {
            *l -= p.presence + p.frequency * n as f32;
        }
    }
}

/// The log-probability of `token` under a softmax of `logits`, and the `top` most likely
/// tokens' (the lower id first on a tie), computed in f64.
pub fn logprobs(logits: &[f32], token: u32, top: usize) -> TokenLogprobs {
    let max = logits
        .iter()
        .copied()
        .filter(|l| l.is_finite())
        .fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits
        .iter()
        .filter(|l| l.is_finite())
        .map(|&l| (l as f64 - max).exp())
        .sum();
    let norm = max + sum.ln();
    let lp = |l: f32| {
        if l.is_finite() {
            (l as f64 - norm) as f32
        } else {
            f32::NEG_INFINITY
        }
    };
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(top + 1);
    if top > 0 {
        for (i, &l) in logits.iter().enumerate() {
            let v = lp(l);
            if best.len() < top || best.last().is_some_and(|b| v > b.1) {
                let at = best.partition_point(|b| b.1 >= v);
                best.insert(at, (i as u32, v));
                best.truncate(top);
            }
        }
    }
    TokenLogprobs {
        logprob: logits
            .get(token as usize)
            .map_or(f32::NEG_INFINITY, |&l| lp(l)),
        top: best,
    }
}

/// The next token of `logits` under `s`, drawing from `rng` unless greedy.
pub fn sample(logits: &[f32], s: &Sampling, rng: &mut StdRng) -> u32 {
    if s.temperature <= 0.0 || logits.is_empty() {
        return argmax(logits);
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut probs: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, ((l - max) / s.temperature).exp()))
        .filter(|(_, p)| *p > 0.0)
        .collect();
    let total: f32 = probs.iter().map(|p| p.1).sum();
    if !(total.is_finite() && total > 0.0) {
        return argmax(logits);
    }
    if s.top_p < 1.0 {
        probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut kept = 0.0;
        let keep = probs
            .iter()
            .position(|p| {
                kept += p.1 / total;
                kept >= s.top_p
            })
            .map_or(probs.len(), |i| i + 1);
        probs.truncate(keep);
    }
    let total: f32 = probs.iter().map(|p| p.1).sum();
    let mut at = rng.random::<f32>() * total;
    for &(token, p) in &probs {
        if at < p {
            return token;
        }
        at -= p;
    }
    probs.last().map_or(0, |p| p.0)
}

/// The index of the largest logit (the first, on a tie).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in logits.iter().enumerate() {
        if *v > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn greedy_takes_the_largest_and_a_seed_repeats_itself() {
        let logits = [0.1, 3.0, 2.9, -1.0];
        let mut rng = StdRng::seed_from_u64(1);
        assert_eq!(sample(&logits, &Sampling::default(), &mut rng), 1);
        let hot = Sampling {
            temperature: 1.0,
            top_p: 1.0,
            seed: 7,
        };
        let draw = |seed| {
            let mut rng = StdRng::seed_from_u64(seed);
            (0..64)
                .map(|_| sample(&logits, &hot, &mut rng))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        let seen = draw(7);
        assert!(seen.contains(&1) && seen.contains(&2), "{seen:?}");
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        // Token 0 alone holds more than 90% of the mass.
        let logits = [10.0, 1.0, 1.0, 1.0];
        let s = Sampling {
            temperature: 1.0,
            top_p: 0.9,
            seed: 0,
        };
        let mut rng = StdRng::seed_from_u64(3);
        assert!((0..200).all(|_| sample(&logits, &s, &mut rng) == 0));
    }

    #[test]
    fn penalties_and_bias_move_the_logits_they_name() {
        let mut l = vec![1.0, 1.0, 1.0, 1.0];
        let p = Penalties {
            presence: 0.5,
            frequency: 0.25,
            logit_bias: vec![(3, 2.0), (99, 5.0)],
        };
        adjust(&mut l, &p, &[0, 0, 1]);
        assert_eq!(l, vec![1.0 - 0.5 - 0.5, 1.0 - 0.5 - 0.25, 1.0, 3.0]);
    }

    #[test]
    fn logprobs_are_a_log_softmax_with_the_top_in_order() {
        let l = [2.0f32, 1.0, 3.0, f32::NEG_INFINITY];
        let got = logprobs(&l, 1, 2);
        let z: f64 = l.iter().map(|&v| (v as f64).exp()).sum();
        assert!((got.logprob as f64 - (1.0 - z.ln())).abs() < 1e-6);
        assert_eq!(got.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![2, 0]);
        assert!((got.top[0].1 as f64 - (3.0 - z.ln())).abs() < 1e-6);
        assert_eq!(logprobs(&l, 3, 0).logprob, f32::NEG_INFINITY);
        assert!(logprobs(&l, 3, 0).top.is_empty());
    }

    #[test]
    fn odd_logits_do_not_panic() {
        let mut rng = StdRng::seed_from_u64(3);
        let s = Sampling {
            temperature: 0.5,
            top_p: 0.5,
            seed: 0,
        };
        for logits in [
            vec![],
            vec![f32::NAN, 1.0],
            vec![f32::INFINITY, 1.0],
            vec![f32::NEG_INFINITY; 3],
            vec![f32::MAX, f32::MIN],
        ] {
            let t = sample(&logits, &s, &mut rng);
            assert!(logits.is_empty() || (t as usize) < logits.len());
        }
    }
}
