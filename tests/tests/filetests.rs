//! File tests for the middle of the pipeline: `tests/filetests/{verify,canonicalize,rebatch,shard,lower,check}/
//! *.onnxtxt`. Each file is a model (for `check`, one graph per device) whose comments say what
//! to do and what must come out:
//!
//! - `# test: KIND key=value…` (first directive): `verify`; `canonicalize`; `rebatch batch=B`; `shard
//!   devices=N strategy=S [cluster=C]`; `lower devices=N (strategy=S | pipeline=K)
//!   [cluster=C]`; `check` (sections opened by `# device K` lines, one graph each).
//! - `# check: TEXT`: a later line of the output contains TEXT; `# nextln: TEXT`: the line after
//!   the last match does; `# not: TEXT`: no line between the last match and the next one does.
//! - `# error: TEXT` at the end of a line: an error located on that line says TEXT; on a line
//!   of its own: an error anywhere (or nowhere in particular) does. Every error must be expected.
//!
//! `BLESS=1 cargo test -p shardc-tests --test filetests` rewrites each passing-or-failing file's
//! `# check:` lines as its whole current output (error files are left alone).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use codegen::Program;
use ir::print::node_to_string;
use libtest_mimic::{Arguments, Failed, Trial};
use passes::cost::{Cluster, CostModel, Options};
use shardc_tests::{one_stage_program, repo_root};

/// A located error: the 1-based line of the file it points at, if any.
type Finding = (Option<usize>, String);

/// What a test produced: its output text, or its errors.
type Outcome = Result<String, Vec<Finding>>;

struct Header {
    kind: String,
    args: HashMap<String, String>,
}

fn header(text: &str) -> Result<Header, String> {
    let line = text.lines().find_map(|l| l.trim_start().strip_prefix("# test:")).ok_or("no `# test: KIND` line")?;
    let mut words = line.split_whitespace();
    let kind = words.next().ok_or("`# test:` names no kind")?.to_string();
    let mut args = HashMap::new();
    for w in words {
        let (k, v) = w.split_once('=').ok_or_else(|| format!("`{w}`: expected key=value"))?;
        args.insert(k.to_string(), v.to_string());
    }
    Ok(Header { kind, args })
}

impl Header {
    fn get(&self, key: &str) -> Result<&str, String> {
        self.args.get(key).map(String::as_str).ok_or_else(|| format!("`# test: {}` needs {key}=…", self.kind))
    }

    fn num(&self, key: &str) -> Result<usize, String> {
        self.get(key)?.parse().map_err(|_| format!("{key}: not a number"))
    }

    fn cluster(&self) -> Result<Cluster, String> {
        let name = self.args.get("cluster").map_or("dgx-a100", String::as_str);
        Cluster::preset(name).ok_or_else(|| format!("no cluster preset `{name}`"))
    }
}

/// The 1-based line of byte `offset` of `text`, plus `first - 1`.
fn line_of(text: &str, offset: usize, first: usize) -> usize {
    first + text[..offset.min(text.len())].bytes().filter(|&b| b == b'\n').count()
}

/// Parses, verifies and infers `text` (a model starting at line `first` of the file).
fn front(text: &str, first: usize, extra: Option<passes::RebatchSpec>) -> Result<ir::Model, Vec<Finding>> {
    let parsed = frontend::parse(text).map_err(|diags| {
        diags
            .iter()
            .map(|d| {
                let at = d.labels.iter().find(|l| l.primary).or(d.labels.first());
                (at.map(|l| line_of(text, l.span.start as usize, first)), d.message.clone())
            })
            .collect::<Vec<_>>()
    })?;
    let mut m = parsed.model;
    let mut pm = passes::PassManager::new();
    pm.add(passes::Verify);
    if let Some(spec) = extra {
        pm.add(passes::Rebatch { spec });
    }
    pm.add(passes::InferShapes::default());
    pm.run(&mut m).map_err(|e| {
        e.errors
            .iter()
            .map(|l| (l.span.map(|s| line_of(text, s.start as usize, first)), l.msg.clone()))
            .collect::<Vec<_>>()
    })?;
    Ok(m)
}

/// The printed graph, tensor values longer than a few numbers elided (`{…}`).
fn printed(g: &ir::Graph) -> String {
    let text = ir::print::graph_to_string(g);
    let mut out = String::with_capacity(text.len());
    let mut rest = text.as_str();
    while let Some(open) = rest.find('{') {
        let close = rest[open..].find('}').map(|c| open + c);
        match close {
            Some(close) if close - open > 40 && !rest[open + 1..close].contains('\n') => {
                out.push_str(&rest[..open]);
                out.push_str("{…}");
                rest = &rest[close + 1..];
            }
            _ => {
                out.push_str(&rest[..=open]);
                rest = &rest[open + 1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// The graph's inputs and weights with their (local) types, then one line per op node.
fn listing(g: &ir::Graph) -> String {
    let typed = |ids: &[ir::NodeId]| -> String {
        let v: Vec<String> = ids
            .iter()
            .map(|&n| {
                let v = ir::Value::new(n, 0);
                let t = g
                    .tensor_type(v)
                    .map_or("?".to_string(), |t| ir::print::type_to_string(&ir::Type::Tensor(t.clone())));
                format!("{} {t}", g.value_name(v))
            })
            .collect();
        v.join(", ")
    };
    let mut out = format!("inputs {}\n", typed(g.inputs()));
    if !g.initializers().is_empty() {
        out.push_str(&format!("weights {}\n", typed(g.initializers())));
    }
    for n in g.op_nodes().unwrap_or_default() {
        out.push_str(node_to_string(g, n).trim());
        out.push('\n');
    }
    out
}

fn run_kind(h: &Header, text: &str) -> Result<Outcome, String> {
    let fail = |f: Vec<Finding>| Ok(Err(f));
    match h.kind.as_str() {
        "verify" => Ok(front(text, 1, None).map(|m| printed(&m.graph))),
        "canonicalize" => {
            let mut m = match front(text, 1, None) {
                Ok(m) => m,
                Err(f) => return fail(f),
            };
            let mut pm = passes::PassManager::new();
            pm.add(passes::Canonicalize);
            pm.run(&mut m).map_err(|e| e.to_string())?;
            Ok(Ok(printed(&m.graph)))
        }
        "rebatch" => {
            let spec = passes::RebatchSpec { batch: Some(h.num("batch")? as i64), ..Default::default() };
            Ok(front(text, 1, Some(spec)).map(|m| printed(&m.graph)))
        }
        "shard" | "lower" => {
            let mut m = match front(text, 1, None) {
                Ok(m) => m,
                Err(f) => return fail(f),
            };
            let mut pm = passes::PassManager::new();
            pm.add(passes::Canonicalize);
            pm.run(&mut m).map_err(|e| e.to_string())?;
            let g = &m.graph;
            let devices = h.num("devices")?;
            let cluster = h.cluster()?;
            if let Ok(k) = h.num("pipeline") {
                let so = passes::autoshard::SearchOptions {
                    pipeline: passes::autoshard::PipelineMode::Stages(k),
                    ..Default::default()
                };
                let r = passes::autoshard::search(g, &cluster, devices, &Options::default(), &so)
                    .map_err(|e| e.to_string())?;
                let p = shardc::exec::program_for_search(g, &r, devices).map_err(|e| e.to_string())?;
                return Ok(Ok(program_listing(&p)?));
            }
            let r = shardc::exec::named_result(g, &cluster, devices, h.get("strategy")?, &Options::default())?;
            if h.kind == "lower" {
                return Ok(Ok(program_listing(
                    &shardc::exec::program_for_search(g, &r, devices).map_err(|e| e.to_string())?,
                )?));
            }
            let cm = CostModel::new(g, &cluster, r.mesh.clone(), Options::default());
            let axes: Vec<String> = r.mesh.axes.iter().map(|a| format!("{}={}", a.name, a.size)).collect();
            let mut out = format!("mesh {}\n", axes.join(" "));
            for n in g.op_nodes().unwrap_or_default() {
                let s = r.assignment.strategies.get(&n).cloned().unwrap_or_default();
                out.push_str(&format!("{}: {}\n", g.describe(n), cm.describe_strategy(n, &s)));
            }
            Ok(Ok(out))
        }
        "check" => Ok(check_sections(text)),
        k => Err(format!("unknown test kind `{k}`")),
    }
}

/// Each device's program, checked first.
fn program_listing(p: &Program) -> Result<String, String> {
    codegen::check(p).map_err(|e| e.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))?;
    let mut out = String::new();
    for d in &p.devices {
        out.push_str(&format!("device {} (stage {}):\n", d.device, d.stage));
        out.push_str(&listing(&d.graph));
    }
    Ok(out)
}

/// `check` files: one graph per `# device K` section, run through the checker as one program
/// of one stage whose mesh has an axis per device.
fn check_sections(text: &str) -> Outcome {
    let mut sections: Vec<(usize, String)> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("# device") {
            sections.push((i + 2, String::new()));
        } else if let Some((_, s)) = sections.last_mut() {
            s.push_str(line);
            s.push('\n');
        }
    }
    if sections.is_empty() {
        return Err(vec![(None, "a check file needs `# device K` sections".into())]);
    }
    let mut graphs = Vec::new();
    for (first, body) in &sections {
        graphs.push(front(body, *first, None)?.graph);
    }
    let p = one_stage_program(graphs);
    match codegen::check(&p) {
        Ok(()) => Ok(String::from("consistent\n")),
        Err(errs) => Err(errs
            .into_iter()
            .map(|e| {
                let line = e.device.zip(e.node).and_then(|(d, n)| {
                    let (first, body) = &sections[d];
                    p.devices[d].graph.span(n).map(|s| line_of(body, s.start as usize, *first))
                });
                (line, e.message)
            })
            .collect()),
    }
}

/// The directive lines: `(kind, text)` for check/nextln/not, in file order.
fn directives(text: &str) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    for line in text.lines() {
        let t = line.trim_start();
        for kind in ["check", "nextln", "not"] {
            if let Some(rest) = t.strip_prefix(&format!("# {kind}:")) {
                out.push((kind, rest.trim().to_string()));
            }
        }
    }
    out
}

/// Expected errors: `(line, text)`, the line `None` for a whole-line `# error:`.
fn expected_errors(text: &str) -> Vec<(Option<usize>, String)> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let Some(at) = line.find("# error:") else { continue };
        let msg = line[at + "# error:".len()..].trim().to_string();
        let whole = line[..at].trim().is_empty();
        out.push((if whole { None } else { Some(i + 1) }, msg));
    }
    out
}

/// Matches the output against the check/nextln/not directives.
fn filecheck(output: &str, dirs: &[(&'static str, String)]) -> Result<(), String> {
    let lines: Vec<&str> = output.lines().collect();
    let mut cursor = 0usize; // first line a `check` may match
    let mut last: Option<usize> = None;
    let mut nots: Vec<&str> = Vec::new();
    for (kind, pat) in dirs {
        match *kind {
            "not" => nots.push(pat),
            "check" | "nextln" => {
                let found = if *kind == "nextln" {
                    let at = last.map_or(0, |l| l + 1);
                    lines.get(at).filter(|l| l.contains(pat.as_str())).map(|_| at)
                } else {
                    (cursor..lines.len()).find(|&i| lines[i].contains(pat.as_str()))
                };
                let Some(at) = found else {
                    let after = last.map_or("the start".to_string(), |l| format!("line {} `{}`", l + 1, lines[l]));
                    return Err(format!("`# {kind}: {pat}` not matched after {after}\n--- output ---\n{output}"));
                };
                for n in nots.drain(..) {
                    if let Some(i) = (cursor..at).find(|&i| lines[i].contains(n)) {
                        return Err(format!("`# not: {n}` matched output line {} `{}`", i + 1, lines[i]));
                    }
                }
                last = Some(at);
                cursor = at + 1;
            }
            _ => unreachable!(),
        }
    }
    for n in nots {
        if let Some(i) = (cursor..lines.len()).find(|&i| lines[i].contains(n)) {
            return Err(format!("`# not: {n}` matched output line {} `{}`", i + 1, lines[i]));
        }
    }
    Ok(())
}

/// Every error expected and every expectation met.
fn match_errors(got: &[Finding], want: &[(Option<usize>, String)]) -> Result<(), String> {
    let show = |f: &Finding| format!("line {}: {}", f.0.map_or("?".into(), |l| l.to_string()), f.1);
    let mut used = vec![false; got.len()];
    for (line, pat) in want {
        let hit = got
            .iter()
            .enumerate()
            .find(|(i, (l, m))| !used[*i] && m.contains(pat.as_str()) && (line.is_none() || l == line));
        match hit {
            Some((i, _)) => used[i] = true,
            None => {
                let all: Vec<String> = got.iter().map(show).collect();
                let at = line.map_or("anywhere".into(), |l| format!("on line {l}"));
                return Err(format!("expected an error {at} saying `{pat}`; the errors:\n{}", all.join("\n")));
            }
        }
    }
    let extra: Vec<String> = got.iter().zip(&used).filter(|(_, u)| !**u).map(|(f, _)| show(f)).collect();
    if !extra.is_empty() {
        return Err(format!("unexpected errors:\n{}", extra.join("\n")));
    }
    Ok(())
}

/// Rewrites `path`'s check lines as `output` (after the model, at the end of the file).
fn bless(path: &Path, text: &str, output: &str) -> std::io::Result<()> {
    let mut kept: Vec<&str> = text
        .lines()
        .filter(|l| {
            let t = l.trim_start();
            !(t.starts_with("# check:") || t.starts_with("# nextln:") || t.starts_with("# not:"))
        })
        .collect();
    while kept.last().is_some_and(|l| l.trim().is_empty()) {
        kept.pop();
    }
    let mut s = kept.join("\n");
    s.push('\n');
    for (i, l) in output.lines().filter(|l| !l.trim().is_empty()).enumerate() {
        s.push_str(&format!("# {}: {}\n", if i == 0 { "check" } else { "nextln" }, l.trim()));
    }
    std::fs::write(path, s)
}

fn run_file(path: &Path) -> Result<(), String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let h = header(&text)?;
    let outcome = run_kind(&h, &text)?;
    let want_errors = expected_errors(&text);
    match outcome {
        Err(found) => match_errors(&found, &want_errors),
        Ok(output) => {
            if !want_errors.is_empty() {
                return Err(format!("expected errors, got none; the output:\n{output}"));
            }
            if std::env::var_os("BLESS").is_some() {
                return bless(path, &text, &output).map_err(|e| e.to_string());
            }
            let dirs = directives(&text);
            if dirs.is_empty() {
                return Err("no `# check:` lines (BLESS=1 writes them)".into());
            }
            filecheck(&output, &dirs)
        }
    }
}

fn files() -> Vec<PathBuf> {
    let root = repo_root().join("tests/filetests");
    let mut out = Vec::new();
    for kind in ["verify", "canonicalize", "rebatch", "shard", "lower", "check"] {
        let Ok(rd) = std::fs::read_dir(root.join(kind)) else { continue };
        let mut v: Vec<PathBuf> =
            rd.flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "onnxtxt")).collect();
        v.sort();
        out.extend(v);
    }
    out
}

fn main() {
    let args = Arguments::from_args();
    let root = repo_root().join("tests/filetests");
    let trials: Vec<Trial> = files()
        .into_iter()
        .map(|p| {
            let name = p.strip_prefix(&root).unwrap_or(&p).display().to_string();
            Trial::test(name, move || run_file(&p).map_err(Failed::from))
        })
        .collect();
    assert!(trials.len() >= 20, "the file tests are missing ({} found)", trials.len());
    libtest_mimic::run(&args, trials).exit();
}
