//! shardc: an automatic-parallelization compiler for DNN training.
//!
//! This facade re-exports the crates that follow the data flow —
//! [`frontend`] (ONNX text → IR), [`ir`] (graph, types, shape inference, reference
//! evaluation), [`passes`] (pass manager, cost model, search) and [`codegen`] (per-device
//! graphs and the wgpu runtime) — and adds what a tool built on them needs first: loading a
//! model file with diagnostics that point into it.
//!
//! ```no_run
//! let loaded = shardc::load_model(std::path::Path::new("model.onnxtxt")).expect("model loads");
//! let mut model = loaded.model;
//! let mut pm = shardc::passes::PassManager::new().with_verify(true);
//! pm.add(shardc::passes::InferShapes::default()).add(shardc::passes::Canonicalize);
//! pm.run(&mut model).expect("passes run");
//! println!("{}", shardc::ir::print::model_to_string(&model));
//! ```
#![forbid(unsafe_code)]

use std::path::Path;

pub use codegen;
pub use frontend;
pub use ir;
pub use passes;

pub mod calibrate;
pub mod error;
pub mod exec;
pub mod footprint;
pub mod launch;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod report;
pub mod session;
pub mod simulate;
pub mod synthetic;
pub mod train;
pub mod written;

/// A model file's text, kept to render diagnostics; for a binary model, the field paths its
/// spans stand for.
#[derive(Clone, Debug)]
pub struct Source {
    /// The name shown in diagnostics (the path as given).
    pub name: String,
    /// The text (lossily decoded when the file is not UTF-8); empty for a binary model.
    pub text: String,
    /// For a binary `.onnx` model: what its spans point at.
    pub locations: Option<std::sync::Arc<frontend::onnx::Locations>>,
}

impl Source {
    /// A text source.
    pub fn text(name: impl Into<String>, text: impl Into<String>) -> Source {
        Source { name: name.into(), text: text.into(), locations: None }
    }

    /// Renders diagnostics against this source: with `file:line:col` and the line for text,
    /// with the field path for a binary model.
    pub fn render(&self, diags: &[frontend::Diagnostic]) -> String {
        match &self.locations {
            Some(l) => frontend::diag::render_binary(diags, &self.name, l),
            None => frontend::render(diags, &self.name, &self.text),
        }
    }

    /// True for a binary model.
    pub fn is_binary(&self) -> bool {
        self.locations.is_some()
    }

    /// Renders pass findings (errors or warnings) against this source: with `file:line:col`
    /// and the line where the finding has a span.
    pub fn render_located(&self, items: &[passes::Located], severity: frontend::Severity) -> String {
        let diags: Vec<frontend::Diagnostic> = items
            .iter()
            .map(|l| {
                let mut d = match severity {
                    frontend::Severity::Error => frontend::Diagnostic::error(l.msg.clone()),
                    frontend::Severity::Warning => frontend::Diagnostic::warning(l.msg.clone()),
                };
                if let Some(s) = l.span {
                    d = d.with_primary(s, "");
                }
                d
            })
            .collect();
        self.render(&diags)
    }
}

/// A loaded model with its source and any warnings.
pub struct Loaded {
    /// The model.
    pub model: ir::Model,
    /// Its text.
    pub source: Source,
    /// Warnings from the frontend.
    pub warnings: Vec<frontend::Diagnostic>,
}

/// Why a model could not be loaded.
#[derive(Debug)]
pub enum LoadError {
    /// The file could not be read.
    Io(String),
    /// The text has errors; render them with [`Source::render`].
    Invalid(Vec<frontend::Diagnostic>, Source),
}

impl LoadError {
    /// The error as text for a terminal.
    pub fn render(&self) -> String {
        match self {
            LoadError::Io(msg) => format!("error: {msg}\n"),
            LoadError::Invalid(diags, source) => source.render(diags),
        }
    }
}

/// Reads and parses a model file: the ONNX text syntax or binary ONNX (`ModelProto`), told
/// apart by content, not by extension.
pub fn load_model(path: &Path) -> Result<Loaded, LoadError> {
    let name = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|e| LoadError::Io(format!("cannot read `{name}`: {e}")))?;
    if frontend::onnx::is_binary(&bytes) {
        return match frontend::parse_binary(&bytes) {
            Ok((p, locations)) => {
                let source = Source { name, text: String::new(), locations: Some(std::sync::Arc::new(locations)) };
                inlined(Loaded { model: p.model, warnings: p.warnings, source })
            }
            Err((diags, locations)) => Err(LoadError::Invalid(
                diags,
                Source { name, text: String::new(), locations: Some(std::sync::Arc::new(locations)) },
            )),
        };
    }
    let text = match frontend::decode(&bytes) {
        Ok(t) => t.to_string(),
        Err(d) => {
            let lossy = String::from_utf8_lossy(&bytes).replace('\0', "\u{FFFD}");
            return Err(LoadError::Invalid(vec![d], Source::text(name, lossy)));
        }
    };
    let source = Source::text(name, text);
    match frontend::parse(&source.text) {
        Ok(p) => inlined(Loaded { model: p.model, warnings: p.warnings, source }),
        Err(diags) => Err(LoadError::Invalid(diags, source)),
    }
}

/// The model with its calls of its own functions replaced by their bodies
/// ([`ir::inline::inline_functions`]); a call that cannot be inlined is an error at the call.
fn inlined(mut loaded: Loaded) -> Result<Loaded, LoadError> {
    match ir::inline::inline_functions(&mut loaded.model) {
        Ok(_) => Ok(loaded),
        Err(errors) => {
            let g = &loaded.model.graph;
            let diags = errors
                .into_iter()
                .map(|(n, msg)| {
                    let d = frontend::Diagnostic::error(msg);
                    match g.span(n) {
                        Some(s) => d.with_primary(s, "this call"),
                        None => d,
                    }
                })
                .collect();
            Err(LoadError::Invalid(diags, loaded.source))
        }
    }
}

/// Verifies a model and checks its shapes (on a copy: the model is not changed). Returns
/// warnings; errors carry node spans for [`Source::render_located`].
pub fn check(model: &ir::Model) -> Result<Vec<passes::Located>, passes::PassError> {
    let mut copy = model.clone();
    let mut pm = passes::PassManager::new();
    pm.add(passes::Verify).add(passes::InferShapes::default());
    pm.run(&mut copy).map(|r| r.warnings)
}

/// Loads a model and checks it, rendering any problem against the file: the full front half
/// of `shardc parse`. On success, the model and the rendered warnings.
pub fn load_and_check(path: &Path) -> Result<(Loaded, String), String> {
    let loaded = load_model(path).map_err(|e| e.render())?;
    let mut warnings = loaded.source.render(&loaded.warnings);
    match check(&loaded.model) {
        Ok(w) => {
            warnings.push_str(&loaded.source.render_located(&w, frontend::Severity::Warning));
            Ok((loaded, warnings))
        }
        Err(e) => Err(loaded.source.render_located(&e.errors, frontend::Severity::Error)),
    }
}
