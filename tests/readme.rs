//! The README is what an embedder reads first: its metric table lists every metric this
//! project emits, as `procmem::metrics` defines it (name, type, labels, meaning).

#[test]
fn the_readme_lists_every_metric_as_defined() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("README.md");
    let mut missing = Vec::new();
    for m in procmem::metrics::all() {
        let row = format!(
            "| `{}` | {} | {} | {} |",
            m.name,
            m.kind.prometheus(),
            m.labels.join(", "),
            m.help
        );
        if !readme.lines().any(|l| l.trim() == row) {
            missing.push(row);
        }
    }
    assert!(
        missing.is_empty(),
        "README rows missing or stale:\n{}",
        missing.join("\n")
    );
    let rows = readme
        .lines()
        .filter(|l| l.starts_with("| `procmem_"))
        .count();
    assert_eq!(
        rows,
        procmem::metrics::all().count(),
        "a README row names no metric"
    );
}
