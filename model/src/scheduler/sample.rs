//! Choosing the next token: greedy, or from the softmax at a temperature, cut to the nucleus.

use rand::rngs::StdRng;
use rand::Rng;

use super::types::Sampling;

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
