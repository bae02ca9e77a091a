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

/// The `procmem_` series named in a PromQL expression.
fn series_in(expr: &str) -> Vec<&str> {
    let mut names = Vec::new();
    let mut rest = expr;
    while let Some(at) = rest.find("procmem_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        names.push(&tail[..end]);
        rest = &tail[end..];
    }
    names
}

/// The Grafana dashboard (docs/grafana/procmem.json) asks only for series the server or the
/// node exports: every `procmem_` name in a panel's query is a metric of
/// `procmem::metrics::all()` (a histogram by its `_bucket`, `_sum` or `_count` series), and
/// every label a query groups by or a legend names is one of those metrics' labels (or `le`).
#[test]
fn the_dashboard_queries_only_exported_series() {
    use procmem::metrics::{all, Kind, Metric};
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/docs/grafana/procmem.json"
    ))
    .expect("docs/grafana/procmem.json");
    let dash: serde_json::Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let by_name: std::collections::HashMap<&str, &Metric> = all().map(|m| (m.name, m)).collect();
    let metric_of = |series: &str| -> Option<&Metric> {
        if let Some(m) = by_name.get(series) {
            return (m.kind != Kind::Histogram).then_some(*m);
        }
        ["_bucket", "_sum", "_count"]
            .iter()
            .filter_map(|s| series.strip_suffix(s))
            .filter_map(|base| by_name.get(base))
            .find(|m| m.kind == Kind::Histogram)
            .copied()
    };
    let (mut wrong, mut queries) = (Vec::new(), 0);
    let panels = dash["panels"].as_array().expect("panels");
    for panel in panels.iter().filter(|p| p["type"] != "row") {
        let title = panel["title"].as_str().unwrap_or("?");
        let targets = panel["targets"].as_array().map_or(&[][..], Vec::as_slice);
        assert!(!targets.is_empty(), "panel {title:?} has no query");
        for t in targets {
            let expr = t["expr"].as_str().expect("a PromQL expr");
            queries += 1;
            let metrics: Vec<&Metric> = series_in(expr)
                .into_iter()
                .filter_map(|s| {
                    let m = metric_of(s);
                    if m.is_none() {
                        wrong.push(format!("{title}: {s} is not exported"));
                    }
                    m
                })
                .collect();
            if metrics.is_empty() {
                wrong.push(format!("{title}: {expr:?} names no procmem series"));
            }
            // Labels grouped by (`by (a, b)`) and named in the legend (`{{a}}`).
            let legend = t["legendFormat"].as_str().unwrap_or("");
            let grouped = expr
                .split("by (")
                .skip(1)
                .filter_map(|s| s.split(')').next())
                .flat_map(|s| s.split(','));
            let named = legend
                .split("{{")
                .skip(1)
                .filter_map(|s| s.split("}}").next());
            for label in grouped.chain(named).map(str::trim) {
                let known = label == "le" || metrics.iter().any(|m| m.labels.contains(&label));
                if !known {
                    wrong.push(format!(
                        "{title}: no series of {expr:?} has the label {label}"
                    ));
                }
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    assert!(queries >= 20, "{queries} queries");
}
