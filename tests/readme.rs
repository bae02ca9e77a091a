//! The manual's metric table (docs/metrics.md) is what an operator reads: it lists every metric
//! this project emits, as `procmem::metrics` defines it (name, type, labels, meaning).

#[test]
fn the_metrics_page_lists_every_metric_as_defined() {
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/metrics.md"))
        .expect("docs/metrics.md");
    let mut missing = Vec::new();
    for m in procmem::metrics::all() {
        let row = format!(
            "| `{}` | {} | {} | {} |",
            m.name,
            m.kind.prometheus(),
            m.labels.join(", "),
            m.help
        );
        if !page.lines().any(|l| l.trim() == row) {
            missing.push(row);
        }
    }
    assert!(
        missing.is_empty(),
        "docs/metrics.md rows missing or stale:\n{}",
        missing.join("\n")
    );
    let rows = page
        .lines()
        .filter(|l| l.starts_with("| `procmem_"))
        .count();
    assert_eq!(
        rows,
        procmem::metrics::all().count(),
        "a docs/metrics.md row names no metric"
    );
}
