//! docs/architecture.md traces one decode step file by file; this holds that trace to the
//! code: every `path` (`function`, ...) it names is a file that exists and defines each
//! function named, so a step moved to another file fails here until the trace follows.

use std::path::Path;

/// The trace's lines: from "**One decode step, file by file**" to the next blank line after
/// its list.
fn trace(doc: &str) -> String {
    let start = doc
        .find("**One decode step, file by file**")
        .expect("the trace is in docs/architecture.md");
    let rest = &doc[start..];
    let end = rest.find("\n\nThe KV part").unwrap_or(rest.len());
    rest[..end].to_string()
}

/// Each `` `path.rs` (`f`, `g`) `` of the text (paths with a slash), with the functions named
/// in the parentheses right after it. A name with `::` is `Type::function`: its last part
/// is looked for.
fn claims(text: &str) -> Vec<(String, Vec<String>)> {
    let flat = text.replace('\n', " ");
    let mut out = Vec::new();
    let mut rest = flat.as_str();
    while let Some(open) = rest.find('`') {
        let after = &rest[open + 1..];
        let Some(close) = after.find('`') else { break };
        let quoted = &after[..close];
        rest = &after[close + 1..];
        if !(quoted.ends_with(".rs") && quoted.contains('/')) {
            continue;
        }
        let mut functions = Vec::new();
        let tail = rest.trim_start();
        if let Some(inner) = tail.strip_prefix('(') {
            let inner = &inner[..inner.find(')').unwrap_or(inner.len())];
            // Each part that starts with a name in backquotes names a function.
            for part in inner.split(',') {
                let Some(code) = part.trim().strip_prefix('`') else {
                    continue;
                };
                let name = &code[..code.find('`').unwrap_or(0)];
                if !name.is_empty()
                    && name
                        .chars()
                        .all(|c| c.is_alphanumeric() || c == '_' || c == ':')
                {
                    let last = name.rsplit("::").next().unwrap_or(name);
                    functions.push(last.to_string());
                }
            }
        }
        out.push((quoted.to_string(), functions));
    }
    out
}

#[test]
fn the_decode_step_trace_names_files_and_functions_that_exist() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join("docs/architecture.md")).unwrap();
    let found = claims(&trace(&doc));
    assert!(found.len() >= 10, "the trace names its files: {found:?}");
    let mut wrong = Vec::new();
    for (file, functions) in &found {
        let Ok(code) = std::fs::read_to_string(root.join(file)) else {
            wrong.push(format!("{file}: no such file"));
            continue;
        };
        for f in functions {
            // A function, or a type a name like `StepKv` stands for.
            let defined = [
                format!("fn {f}("),
                format!("fn {f}<"),
                format!("struct {f}"),
                format!("enum {f}"),
            ];
            if !defined.iter().any(|d| code.contains(d.as_str())) {
                wrong.push(format!("{file}: no `{f}`"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "docs/architecture.md's step trace: {wrong:?}"
    );
}

#[test]
fn the_claim_reader_takes_paths_and_the_functions_after_them() {
    let text = "2. `model/src/step.rs` (`run`: prepare) then `a/b.rs` (`T::f`,\n`g`) and `c.rs`.";
    assert_eq!(
        claims(text),
        vec![
            ("model/src/step.rs".to_string(), vec!["run".to_string()]),
            ("a/b.rs".to_string(), vec!["f".to_string(), "g".to_string()]),
        ]
    );
}
