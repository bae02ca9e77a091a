//! Small timing helpers shared by the bench harnesses: medians over rounds, JSON reports.
#![allow(dead_code)]

use std::path::PathBuf;
use std::time::Instant;

/// The comma-separated numbers in environment variable `name` (an empty value is none), or
/// `None` where it is unset. A value that is not a number stops the bench, naming `name`.
pub fn env_list(name: &str) -> Option<Vec<usize>> {
    let list = std::env::var(name).ok()?;
    Some(
        list.split(',')
            .filter(|c| !c.trim().is_empty())
            .map(|c| {
                c.trim()
                    .parse()
                    .unwrap_or_else(|_| panic!("{name}: numbers"))
            })
            .collect(),
    )
}

/// Runs `f` `rounds` times and returns the median of what it reports (nanoseconds per unit).
pub fn median_of<F: FnMut() -> f64>(rounds: usize, mut f: F) -> f64 {
    let mut samples: Vec<f64> = (0..rounds).map(|_| f()).collect();
    samples.sort_by(|a, b| a.total_cmp(b));
    samples[samples.len() / 2]
}

/// The `p` quantile (0 to 1) of `sorted`, nearest rank. Panics on no samples.
pub fn percentile(sorted: &[u64], p: f64) -> u64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Nanoseconds `f` takes per call of `units` units of work.
pub fn ns_per<F: FnOnce()>(units: u64, f: F) -> f64 {
    let start = Instant::now();
    f();
    start.elapsed().as_nanos() as f64 / units as f64
}

/// Writes `value` to `target/reports/<name>.json` and prints it.
pub fn write_report(name: &str, value: &serde_json::Value) {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"));
    let dir = target.join("reports");
    std::fs::create_dir_all(&dir).expect("create target/reports");
    let path = dir.join(format!("{name}.json"));
    let text = serde_json::to_string_pretty(value).expect("serialize report");
    std::fs::write(&path, &text).expect("write report");
    println!("{text}\nwritten to {}", path.display());
}

/// A KV store configuration for `loaded`'s `Engine::start`: its heads, sequences of up to
/// `max_tokens`, K and V in their types, growth in chunks of 16 granules.
pub fn smol_kv_config(
    loaded: &procmem_model::Loaded,
    max_tokens: usize,
    k_dtype: procmem_actors::procmem::kv::KvDtype,
    v_dtype: procmem_actors::procmem::kv::KvDtype,
) -> procmem_actors::kv::KvStoreConfig {
    let shape = loaded.model.kv_shape(k_dtype, v_dtype, max_tokens);
    procmem_actors::kv::KvStoreConfig::new("kv", shape).chunk_granules(16)
}
