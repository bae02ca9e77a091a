//! What the examples share: command-line parsing.
#![allow(dead_code)]

pub mod node;
pub mod real_model;
pub mod synthetic;

/// A byte count: a number with an optional `B`, `KiB`, `MiB`, `GiB` or `TiB` suffix.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = [
        ("TiB", 1u64 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
        ("B", 1),
    ]
    .iter()
    .find_map(|(suffix, m)| s.strip_suffix(suffix).map(|n| (n.trim(), *m)))
    .unwrap_or((s, 1));
    let n: f64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a byte count (try 64MiB)"))?;
    if !(n.is_finite() && n >= 0.0) {
        return Err(format!("'{s}' is not a byte count"));
    }
    Ok((n * mult as f64) as u64)
}
