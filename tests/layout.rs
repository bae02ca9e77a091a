//! The layout stays readable: no source file over 700 lines outside tests, no library
//! function over 80 lines, no import cycle among the modules of any crate at any depth (a
//! module's uses of a sibling, through `crate::`, `super::` or `self::`, doc comments aside,
//! are its edges), at most 20 names at the root of the crate a server embeds, and no public
//! function taking or returning a tuple of three fields or of two bare numbers.

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

/// Every source file of the three crates, test files aside.
fn library_files() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for krate in CRATES {
        rust_files(&root.join(krate), &mut files);
    }
    files.retain(|f| !is_test_file(f));
    files
}

#[test]
fn no_source_file_is_over_700_lines_outside_tests() {
    let mut long = Vec::new();
    for file in library_files() {
        let n = code(&file).len();
        if n > MAX_LINES {
            long.push(format!("{} ({n} lines)", file.display()));
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

const MAX_FN_LINES: usize = 80;

/// The functions of `code` (rustfmt's layout: a body closes with `}` at the indentation of
/// its `fn`), as (name, first line, length in lines from the signature to the closing brace).
fn functions(code: &[String]) -> Vec<(String, usize, usize)> {
    let mut out = Vec::new();
    for (i, line) in code.iter().enumerate() {
        let trimmed = line.trim_start();
        let indent = &line[..line.len() - trimmed.len()];
        let Some(name) = fn_name(trimmed) else {
            continue;
        };
        if line.trim_end().ends_with('}') && line.contains('{') {
            continue; // a one-line body
        }
        // The signature ends at the first line ending in `{` (a body) or `;` (a declaration).
        let Some(open) = (i..code.len()).find(|&j| {
            let l = code[j].trim_end();
            l.ends_with('{') || l.ends_with(';')
        }) else {
            continue;
        };
        if code[open].trim_end().ends_with(';') {
            continue;
        }
        let close = format!("{indent}}}");
        if let Some(end) = (open + 1..code.len()).find(|&j| code[j] == close) {
            out.push((name, i + 1, end - i + 1));
        }
    }
    out
}

/// The name of the function a trimmed line declares, if it declares one.
fn fn_name(trimmed: &str) -> Option<String> {
    let mut words = trimmed.split_whitespace().peekable();
    while let Some(w) = words.peek() {
        let qualifier = w.starts_with("pub") || ["async", "const", "unsafe", "default"].contains(w);
        if !qualifier {
            break;
        }
        words.next();
    }
    (words.next()? == "fn").then_some(())?;
    let name: String = words
        .next()?
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    (!name.is_empty()).then_some(name)
}

#[test]
fn no_library_function_is_over_80_lines() {
    let mut long = Vec::new();
    for file in library_files() {
        for (name, line, n) in functions(&code(&file)) {
            if n > MAX_FN_LINES {
                long.push(format!("{}:{line} {name} ({n} lines)", file.display()));
            }
        }
    }
    assert!(long.is_empty(), "over {MAX_FN_LINES} lines: {long:?}");
}

/// Every source file of the examples and the benches: a newcomer reads them as the
/// project's own code, so the same limit holds there.
fn example_and_bench_files() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in ["examples", "benches"] {
        rust_files(&root.join(dir), &mut files);
    }
    files
}

#[test]
fn no_function_in_the_examples_or_benches_is_over_80_lines() {
    let mut long = Vec::new();
    for file in example_and_bench_files() {
        for (name, line, n) in functions(&code(&file)) {
            if n > MAX_FN_LINES {
                long.push(format!("{}:{line} {name} ({n} lines)", file.display()));
            }
        }
    }
    assert!(long.is_empty(), "over {MAX_FN_LINES} lines: {long:?}");
}

#[test]
fn the_function_finder_measures_bodies_not_declarations() {
    let code: Vec<String> = [
        "pub(crate) async fn long(",
        "    x: u8,",
        ") -> u8 {",
        "    let y = x;",
        "    y",
        "}",
        "trait T {",
        "    fn declared(&self);",
        "    fn short(&self) { }",
        "    fn body(&self) {",
        "        1;",
        "    }",
        "}",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let found = functions(&code);
    assert_eq!(
        found,
        vec![("long".to_string(), 1, 6), ("body".to_string(), 10, 3)]
    );
}

const MAX_ROOT_NAMES: usize = 20;

/// The names `procmem-actors` exports at its root: its `pub mod`s and the items of its
/// top-level `pub use`s (the `pub mod` blocks' own uses are not the root's), and exported
/// macros that are not hidden.
fn root_names(lib: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut lines = lib.lines();
    while let Some(line) = lines.next() {
        if let Some(rest) = line.strip_prefix("pub mod ") {
            names.push(rest.trim_end_matches([';', '{', ' ']).to_string());
        } else if let Some(rest) = line.strip_prefix("pub use ") {
            let mut text = rest.to_string();
            while !text.contains(';') {
                text.push_str(lines.next().unwrap_or(";"));
            }
            let inner = match (text.find('{'), text.rfind('}')) {
                (Some(a), Some(b)) => text[a + 1..b].to_string(),
                _ => text.rsplit("::").next().unwrap_or("").to_string(),
            };
            for item in inner.split(',') {
                let name = item.rsplit(" as ").next().unwrap_or("").trim();
                let name = name.trim_end_matches(';').rsplit("::").next().unwrap_or("");
                if !name.is_empty() {
                    names.push(name.to_string());
                }
            }
        } else if let Some(rest) = line.strip_prefix("macro_rules! ") {
            let name = rest.trim_end_matches([' ', '{']);
            if !name.starts_with("__") {
                names.push(format!("{name}!"));
            }
        }
    }
    names
}

#[test]
fn the_embedded_crate_exports_at_most_20_names_at_its_root() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = std::fs::read_to_string(root.join("actors/src/lib.rs")).unwrap();
    let mut names = root_names(&lib);
    let mut files = Vec::new();
    rust_files(&root.join("actors/src"), &mut files);
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        if text.contains("#[macro_export]") {
            names.extend(root_names(&text).into_iter().filter(|n| n.ends_with('!')));
        }
    }
    assert!(names.contains(&"MemoryManager".to_string()), "{names:?}");
    assert!(names.contains(&"kv".to_string()), "{names:?}");
    assert!(
        names.len() <= MAX_ROOT_NAMES,
        "{} names at the root, over {MAX_ROOT_NAMES}: {names:?}",
        names.len()
    );
}

/// Types a pair of which says nothing of which is which.
const BARE_NUMBERS: [&str; 14] = [
    "u8", "u16", "u32", "u64", "u128", "usize", "i8", "i16", "i32", "i64", "i128", "isize", "f32",
    "f64",
];

/// The signatures of the public functions of `code` (`pub fn`, `pub async fn`, ...; not
/// `pub(crate)`), each on one line, with the line it starts on.
fn public_signatures(code: &[String]) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (i, line) in code.iter().enumerate() {
        let trimmed = line.trim_start();
        if !trimmed.starts_with("pub ") || fn_name(trimmed).is_none() {
            continue;
        }
        let mut signature = String::new();
        for l in &code[i..] {
            // A body or a declaration ends it; what follows `{` is not the signature.
            let end = l.find('{').or_else(|| l.find(';'));
            signature.push_str(l[..end.unwrap_or(l.len())].trim());
            signature.push(' ');
            if end.is_some() {
                break;
            }
        }
        out.push((i + 1, signature));
    }
    out
}

/// `inner` split at its top-level commas (none inside `()`, `<>` or `[]`).
fn fields(inner: &str) -> Vec<&str> {
    let (mut out, mut depth, mut start) = (Vec::new(), 0i32, 0);
    for (i, c) in inner.char_indices() {
        match c {
            '(' | '<' | '[' => depth += 1,
            ')' | '>' | ']' => depth -= 1,
            ',' if depth == 0 => {
                out.push(inner[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(inner[start..].trim());
    out.retain(|f| !f.is_empty());
    out
}

/// The tuple types in a signature with three fields or more, or of two bare numbers: a
/// `(` where a type starts (after `->`, `<`, `,`, `:`, `[`, `&` or `mut`), not a parameter
/// list or a closure's.
fn wide_tuples(signature: &str) -> Vec<String> {
    let bytes = signature.as_bytes();
    let mut out = Vec::new();
    for (at, _) in signature.match_indices('(') {
        let before = signature[..at].trim_end();
        let starts_type = before.ends_with("->")
            || before.ends_with(" mut")
            || before.ends_with(['<', ',', ':', '[', '&']) && !before.ends_with("::");
        if !starts_type {
            continue;
        }
        let mut depth = 0;
        let Some(close) = (at..bytes.len()).find(|&j| {
            match bytes[j] {
                b'(' | b'<' | b'[' => depth += 1,
                b')' | b'>' | b']' => depth -= 1,
                _ => {}
            }
            depth == 0
        }) else {
            continue;
        };
        let inner = &signature[at + 1..close];
        let f = fields(inner);
        if f.len() >= 3 || f.len() == 2 && f.iter().all(|t| BARE_NUMBERS.contains(t)) {
            out.push(format!("({inner})"));
        }
    }
    out
}

#[test]
fn no_public_function_takes_or_returns_a_wide_tuple() {
    let mut wide = Vec::new();
    for file in library_files() {
        for (line, signature) in public_signatures(&code(&file)) {
            for tuple in wide_tuples(&signature) {
                wide.push(format!("{}:{line} {tuple}", file.display()));
            }
        }
    }
    assert!(
        wide.is_empty(),
        "public functions with a tuple of three fields or of two bare numbers (name them): {wide:?}"
    );
}

#[test]
fn the_tuple_finder_sees_tuples_where_types_go_and_nowhere_else() {
    let code: Vec<String> = [
        "pub fn totals(&self, a: u64) -> Option<(u64, u64, u64)> {",
        "pub fn sizes(&self) -> (u64, u64) {",
        "pub fn pairs(&self, by: &[(String, u64)]) -> Vec<(u64, String)> {",
        "pub async fn fill(",
        "    keys: Vec<(Vec<u8>, usize, bool)>,",
        "    f: impl Fn(u64, u64, u64) -> u64,",
        ") -> Result<(), E> {",
        "pub(crate) fn inner(&self) -> (u64, u64) {",
        "pub fn one_line(a: u8, b: u8, c: u8) -> u8 { a }",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let found: Vec<(usize, Vec<String>)> = public_signatures(&code)
        .into_iter()
        .map(|(line, s)| (line, wide_tuples(&s)))
        .filter(|(_, t)| !t.is_empty())
        .collect();
    assert_eq!(
        found,
        vec![
            (1, vec!["(u64, u64, u64)".to_string()]),
            (2, vec!["(u64, u64)".to_string()]),
            (4, vec!["(Vec<u8>, usize, bool)".to_string()]),
        ]
    );
}
