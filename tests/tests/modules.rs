//! The module graph of the library crates: which top-level modules import which
//! (`crate::m` in code, outside comments and test modules), so that layers depend only
//! downward. `passes` and `codegen` have no import circle (the cost model does not call the
//! search; a program does not know how it is cut for its schedule). `ir`'s recursive core —
//! a graph holds ops whose attributes hold graphs, and op rules of control flow call the
//! engines on their bodies — is pinned: the circle may shrink, never grow (`train`, the
//! training graph's interface, is in it because the layout algebra reads gradients and
//! carried state).

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
fn irs_recursive_core_does_not_grow() {
    let g = module_graph(&crate_src("ir"));
    let pinned: BTreeSet<String> =
        ["attr", "cost", "eval", "graph", "infer", "op", "ops", "reshard", "shard", "train"].map(String::from).into();
    let found = circles(&g);
    assert!(found.iter().all(|c| c.is_subset(&pinned)), "a new module joined ir's circle: {found:?}");
    // The layers below the core stay below it.
    for low in ["types", "tensor"] {
        assert!(g[low].iter().all(|t| ["types", "tensor"].contains(&t.as_str())), "{low} imports {:?}", g[low]);
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
