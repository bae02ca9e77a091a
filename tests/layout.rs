//! The layout stays readable: no source file over 700 lines outside tests, and no import
//! cycle among the modules of any crate at any depth (a module's uses of a sibling, through
//! `crate::`, `super::` or `self::`, doc comments aside, are its edges).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const MAX_LINES: usize = 700;
const CRATES: [&str; 3] = ["src", "actors/src", "model/src"];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The file's code before its inline test module, without comment lines.
fn code(path: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(path).unwrap();
    let mut lines = Vec::new();
    let mut previous = "";
    for line in text.lines() {
        if previous.trim() == "#[cfg(test)]" && line.trim_start().starts_with("mod tests") {
            lines.pop();
            break;
        }
        previous = line;
        lines.push(line.to_string());
    }
    lines
}

fn is_test_file(path: &Path) -> bool {
    path.file_stem().is_some_and(|s| s == "tests")
}

#[test]
fn no_source_file_is_over_700_lines_outside_tests() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut long = Vec::new();
    for krate in CRATES {
        let mut files = Vec::new();
        rust_files(&root.join(krate), &mut files);
        for file in files.iter().filter(|f| !is_test_file(f)) {
            let n = code(file).len();
            if n > MAX_LINES {
                long.push(format!("{} ({n} lines)", file.display()));
            }
        }
    }
    assert!(long.is_empty(), "over {MAX_LINES} lines: {long:?}");
}

/// A file's module path in its crate: `governor/credit.rs` is `["governor", "credit"]`.
fn module_path(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let path: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if path == ["lib"] {
        Vec::new()
    } else {
        path
    }
}

/// The paths a line names through `crate::`, `super::` or `self::`, braces expanded one
/// level deep at a time (`use crate::{a::X, b::{c, d}}` names `a::X`, `b::c` and `b::d`), as
/// written: each a list of segments, the first of them the keyword(s).
fn named_paths(line: &str) -> Vec<Vec<String>> {
    fn ident(s: &str) -> (&str, &str) {
        let n = s
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(s.len());
        s.split_at(n)
    }
    /// Segments from `s` on: `a::b::{...}` or `a::b`.
    fn walk(prefix: Vec<String>, s: &str, out: &mut Vec<Vec<String>>) {
        let mut path = prefix;
        let mut rest = s;
        loop {
            if let Some(group) = rest.strip_prefix('{') {
                let mut depth = 0;
                let mut item = 0;
                for (i, c) in group.char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' if depth == 0 => {
                            walk(path.clone(), group[item..i].trim_start(), out);
                            return;
                        }
                        '}' => depth -= 1,
                        ',' if depth == 0 => {
                            walk(path.clone(), group[item..i].trim_start(), out);
                            item = i + 1;
                        }
                        _ => {}
                    }
                }
                return;
            }
            let (name, after) = ident(rest);
            if name.is_empty() {
                break;
            }
            path.push(name.to_string());
            match after.strip_prefix("::") {
                Some(more) => rest = more,
                None => break,
            }
        }
        out.push(path);
    }
    let mut out = Vec::new();
    for keyword in ["crate::", "super::", "self::"] {
        for (at, _) in line.match_indices(keyword) {
            let before = line[..at].chars().next_back();
            if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            let mut prefix = vec![keyword.trim_end_matches(':').to_string()];
            let mut rest = &line[at + keyword.len()..];
            while let Some(more) = rest.strip_prefix("super::") {
                prefix.push("super".into());
                rest = more;
            }
            walk(prefix, rest, &mut out);
        }
    }
    out
}

/// `named`, from the file of module `from`, as a path from the crate's root.
fn resolve(from: &[String], named: &[String]) -> Vec<String> {
    let mut base: Vec<String> = from.to_vec();
    let mut rest = named;
    match named.first().map(String::as_str) {
        Some("crate") => {
            base.clear();
            rest = &named[1..];
        }
        Some("self") => rest = &named[1..],
        _ => {}
    }
    while let Some(("super", more)) = rest.split_first().map(|(a, b)| (a.as_str(), b)) {
        base.pop();
        rest = more;
    }
    base.extend(rest.iter().cloned());
    base
}

/// For every module with submodules (the crate's root included, as `""`), the edges among
/// its children: child `a` uses child `b` when a file in `a` names a path into `b` (doc
/// comments aside).
fn module_graphs(src: &Path) -> BTreeMap<String, BTreeMap<String, BTreeSet<String>>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let modules: BTreeSet<Vec<String>> = files.iter().map(|f| module_path(src, f)).collect();
    let mut graphs: BTreeMap<String, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    for m in &modules {
        if let Some((child, parent)) = m.split_last() {
            graphs
                .entry(parent.join("::"))
                .or_default()
                .entry(child.clone())
                .or_default();
        }
    }
    for file in files.iter().filter(|f| !is_test_file(f)) {
        let from = module_path(src, file);
        for line in code(file) {
            if line.trim_start().starts_with("//") {
                continue;
            }
            for named in named_paths(&line) {
                let to = resolve(&from, &named);
                let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
                if common >= from.len() || common >= to.len() {
                    continue;
                }
                if !modules.contains(&to[..=common]) {
                    continue;
                }
                graphs
                    .entry(from[..common].join("::"))
                    .or_default()
                    .entry(from[common].clone())
                    .or_default()
                    .insert(to[common].clone());
            }
        }
    }
    graphs
}

fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut cycle = path[at..].to_vec();
            cycle.push(node.to_string());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|start| visit(start, graph, &mut Vec::new(), &mut done))
}

#[test]
fn no_import_cycle_among_the_modules_of_any_crate_at_any_depth() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut cycles = Vec::new();
    for krate in CRATES {
        let graphs = module_graphs(&root.join(krate));
        assert!(graphs[""].len() > 5, "{krate}: the scan found its modules");
        for (parent, graph) in &graphs {
            if let Some(cycle) = find_cycle(graph) {
                cycles.push(format!("{krate} {parent}: {}", cycle.join(" -> ")));
            }
        }
    }
    assert!(cycles.is_empty(), "import cycles:\n{}", cycles.join("\n"));
}

#[test]
fn paths_resolve_through_crate_super_and_groups() {
    let from: Vec<String> = ["governor", "credit"].map(String::from).to_vec();
    let resolved: Vec<Vec<String>> =
        named_paths("use super::{handles::GovernorHandle, state::{A, B}}; crate::kv::X")
            .iter()
            .map(|p| resolve(&from, p))
            .collect();
    let want: Vec<Vec<String>> = [
        &["governor", "handles", "GovernorHandle"][..],
        &["governor", "state", "A"],
        &["governor", "state", "B"],
        &["kv", "X"],
    ]
    .iter()
    .map(|p| p.iter().map(|s| s.to_string()).collect())
    .collect();
    let mut got = resolved;
    got.sort();
    assert_eq!(got, want);
    assert_eq!(
        resolve(&from, &named_paths("super::super::ledger::Y")[0]),
        ["ledger", "Y"]
    );
}

#[test]
fn the_cycle_finder_finds_a_cycle() {
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    graph.entry("a".into()).or_default().insert("b".into());
    graph.entry("b".into()).or_default().insert("c".into());
    graph.entry("c".into()).or_default().insert("a".into());
    assert_eq!(
        find_cycle(&graph),
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
    graph.get_mut("c").unwrap().clear();
    assert_eq!(find_cycle(&graph), None);
}
