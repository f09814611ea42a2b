//! The module graph of the library crates: which top-level modules import which
//! (`crate::m` in code, outside comments and test modules), so that layers depend only
//! downward. `passes` and `codegen` have no import circle (the cost model does not call the
//! search; a program does not know how it is cut for its schedule). `ir` has none either,
//! and its layers are checked: core types ← graph (with ops and attributes) ← arrays and
//! layouts ← op rules ← engines.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Top-level module → the top-level modules it imports, for the crate whose sources are in
/// `src`.
fn module_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut mods: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    for entry in std::fs::read_dir(src).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_string_lossy().to_string();
        if path.is_dir() {
            mods.insert(name, rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") && !["lib", "main", "tests"].contains(&name.as_str()) {
            mods.insert(name, vec![path]);
        }
    }
    let names: BTreeSet<String> = mods.keys().cloned().collect();
    mods.iter()
        .map(|(m, files)| {
            let mut to = BTreeSet::new();
            for f in files {
                imports(&std::fs::read_to_string(f).unwrap(), &names, &mut to);
            }
            to.remove(m);
            (m.clone(), to)
        })
        .collect()
}

/// The `.rs` files under `dir`, test modules (`tests.rs`) left out.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") && path.file_name().unwrap() != "tests.rs" {
            out.push(path);
        }
    }
    out
}

/// Adds to `to` the modules of `names` that `text` names as `crate::m` or in
/// `use crate::{m, …}`, before its test module and outside comments.
fn imports(text: &str, names: &BTreeSet<String>, to: &mut BTreeSet<String>) {
    let code = text.split("#[cfg(test)]").next().unwrap_or_default();
    let code: String = code.lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n");
    for (i, _) in code.match_indices("crate::") {
        let rest = &code[i + "crate::".len()..];
        let words: Vec<&str> = if let Some(group) = rest.strip_prefix('{') {
            let group = &group[..group.find('}').unwrap_or(group.len())];
            group.split(',').map(|w| w.trim().split("::").next().unwrap_or("")).collect()
        } else {
            vec![rest.split(|c: char| !(c.is_alphanumeric() || c == '_')).next().unwrap_or("")]
        };
        to.extend(words.into_iter().filter(|w| names.contains(*w)).map(str::to_string));
    }
}

/// The strongly connected groups of more than one module.
fn circles(g: &BTreeMap<String, BTreeSet<String>>) -> Vec<BTreeSet<String>> {
    let reach = |from: &String| {
        let mut seen: BTreeSet<String> = BTreeSet::new();
        let mut stack = vec![from.clone()];
        while let Some(m) = stack.pop() {
            for t in g.get(&m).into_iter().flatten() {
                if seen.insert(t.clone()) {
                    stack.push(t.clone());
                }
            }
        }
        seen
    };
    let all: BTreeMap<&String, BTreeSet<String>> = g.keys().map(|m| (m, reach(m))).collect();
    let mut out: Vec<BTreeSet<String>> = Vec::new();
    for (m, r) in &all {
        let group: BTreeSet<String> = r.iter().filter(|t| all[*t].contains(*m)).cloned().collect();
        if group.len() > 1 && !out.contains(&group) {
            out.push(group);
        }
    }
    out
}

fn crate_src(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(name).join("src")
}

#[test]
fn passes_and_codegen_have_no_import_circle() {
    for name in ["passes", "codegen"] {
        let g = module_graph(&crate_src(name));
        assert!(g.len() > 5, "{name}: {} modules found", g.len());
        assert_eq!(circles(&g), Vec::<BTreeSet<String>>::new(), "{name}: {g:#?}");
    }
    let passes = module_graph(&crate_src("passes"));
    assert!(!passes["cost"].contains("autoshard"), "the cost model calls the search");
    assert!(passes["autoshard"].contains("cost"), "the search prices with the cost model");
}

#[test]
fn ir_is_in_layers() {
    let g = module_graph(&crate_src("ir"));
    assert_eq!(circles(&g), Vec::<BTreeSet<String>>::new(), "ir: {g:#?}");
    // Each layer imports only the layers below it: the core types, then the graph (with its
    // ops and attributes, one recursive data type), then arrays and layouts, then the ops'
    // rules; the engines (evaluation, inference, costs, layouts of nodes) sit above the rules.
    let below = |m: &str, allowed: &[&str]| {
        let extra: Vec<&String> = g[m].iter().filter(|t| !allowed.contains(&t.as_str())).collect();
        assert!(extra.is_empty(), "ir::{m} imports {extra:?}, above its layer");
    };
    below("types", &[]);
    below("tensor", &["types"]);
    below("graph", &["types", "tensor"]);
    for m in ["array", "layout"] {
        below(m, &["types", "tensor"]);
    }
    below("ops", &["types", "tensor", "graph", "array", "layout"]);
    for engine in ["eval", "infer", "cost", "shard", "dims"] {
        assert!(g[engine].contains("ops"), "ir::{engine} no longer reads the ops' rules: {:?}", g[engine]);
    }
}

#[test]
fn the_checker_sees_a_circle() {
    let g: BTreeMap<String, BTreeSet<String>> = [
        ("a".to_string(), BTreeSet::from(["b".to_string()])),
        ("b".to_string(), BTreeSet::from(["c".to_string()])),
        ("c".to_string(), BTreeSet::from(["a".to_string()])),
        ("d".to_string(), BTreeSet::from(["a".to_string()])),
    ]
    .into();
    assert_eq!(circles(&g), vec![BTreeSet::from(["a", "b", "c"].map(String::from))]);
    let names: BTreeSet<String> = ["eval", "shard", "op"].map(String::from).into();
    let mut to = BTreeSet::new();
    imports("// crate::op\nuse crate::{eval::Array, shard};\n#[cfg(test)]\nuse crate::op;", &names, &mut to);
    assert_eq!(to, BTreeSet::from(["eval", "shard"].map(String::from)));
}

/// The `.rs` files of the library crates and the CLI, test modules and generated code
/// (a file whose first line says it is generated) left out.
fn source_files() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut out: Vec<PathBuf> = ["ir/src", "frontend/src", "passes/src", "codegen/src", "src"]
        .iter()
        .flat_map(|d| rust_files(&root.join(d)))
        .collect();
    out.retain(|p| {
        let text = std::fs::read_to_string(p).unwrap();
        !text.lines().next().is_some_and(|l| l.contains("generated by"))
    });
    out
}

/// Per function of `text`: its name and its length in lines (from `fn` to the closing
/// brace at the same indentation).
fn function_lengths(text: &str) -> Vec<(String, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        let t = l.trim_start();
        let indent = &l[..l.len() - t.len()];
        let rest = ["pub(crate) ", "pub(super) ", "pub ", "const ", "async ", "unsafe "]
            .iter()
            .fold(t, |r, p| r.strip_prefix(p).unwrap_or(r));
        let Some(sig) = rest.strip_prefix("fn ") else { continue };
        if l.trim_end().ends_with(';') {
            continue;
        }
        let name: String = sig.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        if l.trim_end().ends_with('}') {
            out.push((name, 1));
            continue;
        }
        let close = format!("{indent}}}");
        if let Some(end) = lines[i..].iter().position(|x| x.trim_end() == close) {
            out.push((name, end + 1));
        }
    }
    out
}

#[test]
fn files_and_functions_stay_short() {
    let files = source_files();
    assert!(files.len() > 100, "{} files found", files.len());
    for p in &files {
        let text = std::fs::read_to_string(p).unwrap();
        let lines = text.lines().count();
        assert!(lines <= 1200, "{}: {lines} lines (at most 1,200 in a file about one idea)", p.display());
        let limit = if p.components().any(|c| c.as_os_str() == "cli") { 120 } else { 200 };
        for (name, n) in function_lengths(&text) {
            assert!(n <= limit, "{}: fn {name} is {n} lines (at most {limit})", p.display());
        }
    }
}

#[test]
fn the_length_checker_measures_functions() {
    let text = "fn a() {\n    1;\n}\n\npub(crate) fn b(x: u8) -> u8 {\n    fn c() {}\n    x\n}\nfn d();\n";
    let named = |v: &[(&str, usize)]| v.iter().map(|&(n, k)| (n.to_string(), k)).collect::<Vec<_>>();
    assert_eq!(function_lengths(text), named(&[("a", 3), ("b", 4), ("c", 1)]));
    // The longest function of the sources is found (the runtime's driver loop, 199 lines at
    // this writing): the checker reads real code, not just this sample.
    let longest = source_files()
        .iter()
        .flat_map(|p| function_lengths(&std::fs::read_to_string(p).unwrap()))
        .map(|(_, n)| n)
        .max();
    assert!(longest.is_some_and(|n| n > 150), "{longest:?}");
}
