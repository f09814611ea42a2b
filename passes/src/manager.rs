//! The pass manager: runs passes in order, times them, verifies between them when asked and
//! keeps text dumps of the model after the passes named in `dump_after`.

use std::time::{Duration, Instant};

use ir::{Graph, Model, NodeId, Span};

/// Whether a pass changed the graph.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Changed {
    /// The graph was modified.
    Yes,
    /// The graph is as it was.
    No,
}

/// A finding tied, where possible, to a node and its source text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Located {
    /// The node.
    pub node: Option<NodeId>,
    /// Its source span.
    pub span: Option<Span>,
    /// What happened.
    pub msg: String,
}

impl Located {
    /// A finding at node `n` of `g`.
    pub fn at(g: &Graph, n: NodeId, msg: impl Into<String>) -> Located {
        Located { node: Some(n), span: g.span(n), msg: msg.into() }
    }

    /// A finding about the whole graph.
    pub fn global(msg: impl Into<String>) -> Located {
        Located { node: None, span: None, msg: msg.into() }
    }
}

/// A pass failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("pass `{pass}` failed: {}", .errors.first().map(|e| e.msg.as_str()).unwrap_or("no details"))]
pub struct PassError {
    /// The pass.
    pub pass: String,
    /// What went wrong, first the most relevant.
    pub errors: Vec<Located>,
}

impl PassError {
    /// One error of `pass`.
    pub fn new(pass: &str, err: Located) -> PassError {
        PassError { pass: pass.to_string(), errors: vec![err] }
    }

    /// Shape inference's errors, as `pass`'s.
    pub fn shapes(pass: &str, errs: Vec<ir::infer::ShapeError>) -> PassError {
        PassError { pass: pass.to_string(), errors: errs.into_iter().map(Located::from).collect() }
    }
}

impl From<ir::infer::ShapeError> for Located {
    fn from(e: ir::infer::ShapeError) -> Located {
        Located { node: e.node, span: e.span, msg: e.msg }
    }
}

/// Counters passes may bump (nodes removed, constants folded, …), reported by name.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Stats {
    counters: indexmap::IndexMap<String, u64>,
}

impl Stats {
    /// Adds `n` to a counter.
    pub fn add(&mut self, name: &str, n: u64) {
        *self.counters.entry(name.to_string()).or_insert(0) += n;
    }

    /// The counters in first-bumped order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, u64)> {
        self.counters.iter().map(|(k, v)| (k.as_str(), *v))
    }

    /// One counter's value.
    pub fn get(&self, name: &str) -> u64 {
        self.counters.get(name).copied().unwrap_or(0)
    }
}

/// What a pass sees besides the graph.
pub struct PassCx<'a> {
    /// Warnings to show the user.
    pub warnings: &'a mut Vec<Located>,
    /// Counters.
    pub stats: &'a mut Stats,
    /// The model's `metadata_props` (a pass may record model-level facts there, such as
    /// the device mesh of a sharding plan).
    pub metadata: &'a mut Option<Vec<(String, String)>>,
}

/// A transformation or check of a graph.
pub trait Pass {
    /// Kebab-case, stable: used by `--passes`, `--dump-after` and timing reports.
    fn name(&self) -> &'static str;
    /// Runs on `g`.
    fn run(&mut self, g: &mut Graph, cx: &mut PassCx<'_>) -> Result<Changed, PassError>;
}

/// Timing of one pass.
#[derive(Clone, Debug)]
pub struct Timing {
    /// The pass.
    pub pass: &'static str,
    /// How long it took.
    pub time: Duration,
    /// Whether it changed the graph.
    pub changed: Changed,
}

/// What a run of the manager produced besides the transformed model.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// One entry per pass run.
    pub timings: Vec<Timing>,
    /// `(pass, model text)` after each pass named in `dump_after`.
    pub dumps: Vec<(String, String)>,
    /// Warnings from all passes.
    pub warnings: Vec<Located>,
    /// Counters from all passes.
    pub stats: Stats,
}

/// Runs passes in order.
#[derive(Default)]
pub struct PassManager {
    passes: Vec<Box<dyn Pass>>,
    verify_each: bool,
    dump_after: Vec<String>,
}

impl PassManager {
    /// An empty pipeline.
    pub fn new() -> PassManager {
        PassManager::default()
    }

    /// Appends a pass.
    pub fn add(&mut self, pass: impl Pass + 'static) -> &mut PassManager {
        self.passes.push(Box::new(pass));
        self
    }

    /// Appends a boxed pass.
    pub fn add_boxed(&mut self, pass: Box<dyn Pass>) -> &mut PassManager {
        self.passes.push(pass);
        self
    }

    /// Runs the verifier after every pass (cranelift's `verify_if`).
    pub fn with_verify(mut self, on: bool) -> PassManager {
        self.verify_each = on;
        self
    }

    /// Keeps a text dump of the model after each named pass (`all` for every pass).
    pub fn with_dump_after(mut self, names: Vec<String>) -> PassManager {
        self.dump_after = names;
        self
    }

    /// The names of the passes, in order.
    pub fn names(&self) -> Vec<&'static str> {
        self.passes.iter().map(|p| p.name()).collect()
    }

    /// Runs every pass on the model's main graph.
    pub fn run(&mut self, model: &mut Model) -> Result<Report, PassError> {
        let mut report = Report::default();
        for pass in &mut self.passes {
            let name = pass.name();
            let start = Instant::now();
            let mut cx = PassCx {
                warnings: &mut report.warnings,
                stats: &mut report.stats,
                metadata: &mut model.metadata_props,
            };
            let changed = pass.run(&mut model.graph, &mut cx).map_err(|mut e| {
                if e.pass.is_empty() {
                    e.pass = name.to_string();
                }
                e
            })?;
            report.timings.push(Timing { pass: name, time: start.elapsed(), changed });
            if self.verify_each
                && let Err(errs) = ir::verify(&model.graph)
            {
                return Err(PassError {
                    pass: name.to_string(),
                    errors: errs
                        .0
                        .into_iter()
                        .map(|e| Located {
                            node: e.at,
                            span: e.at.and_then(|n| if model.graph.contains(n) { model.graph.span(n) } else { None }),
                            msg: format!("after `{name}`: {}", e.msg),
                        })
                        .collect(),
                });
            }
            if self.dump_after.iter().any(|d| d == name || d == "all") {
                report.dumps.push((name.to_string(), ir::print::model_to_string(model)));
            }
        }
        Ok(report)
    }
}
