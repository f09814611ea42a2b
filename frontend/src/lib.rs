//! shardc's frontend: the ONNX textual syntax (what `onnx.printer.to_text` writes) to
//! `ir::Model`.
//!
//! Three stages, as in naga's WGSL frontend: [`parse`](parse::parse_model) turns text into a
//! syntax tree with spans (pest is used only there), [`lower`](lower::lower) resolves names
//! and attribute kinds into the IR and copies spans into the graph, and [`diag`] renders
//! problems as `file:line:col` with the source line and a caret. Library code never prints.
//!
//! ```
//! let text = "<ir_version: 8, opset_import: [\"\" : 17]>\n\
//!             g (float[2] x) => (float[2] y) { y = Relu (x) }";
//! let parsed = shardc_frontend::parse(text).expect("valid");
//! assert_eq!(parsed.model.graph.op_count(), 1);
//! ```

#![forbid(unsafe_code)]
#![deny(clippy::print_stdout, clippy::print_stderr)]
#![warn(missing_docs)]

// pest is used without its `std` feature (its per-rule stack probe cost a tenth of the parse;
// `parse::check_nesting` bounds the recursion instead); the parser it generates names `alloc`.
extern crate alloc;

pub mod ast;
pub mod diag;
pub mod lower;
pub mod onnx;
pub mod parse;

pub use diag::{Diagnostic, Severity, render};

/// A parsed model with the warnings lowering produced.
pub struct Parsed {
    /// The model.
    pub model: ir::Model,
    /// Warnings (for example ops kept opaque).
    pub warnings: Vec<Diagnostic>,
}

/// Parses and lowers model text. On failure, every error found.
pub fn parse(source: &str) -> Result<Parsed, Vec<Diagnostic>> {
    let without_comments: String =
        source.lines().map(|l| l.split('#').next().unwrap_or("")).collect::<Vec<_>>().join("\n");
    if without_comments.trim().is_empty() {
        return Err(vec![
            Diagnostic::error("the input holds no model: expected an optional `<…>` header, then a graph")
                .with_primary(ir::Span::new(0, source.len()), "nothing here"),
        ]);
    }
    let ast = parse::parse_model(source).map_err(|d| vec![d])?;
    let lowered = lower::lower(&ast)?;
    Ok(Parsed { model: lowered.model, warnings: lowered.warnings })
}

/// Reads a binary ONNX model (`ModelProto`). On failure, every problem found, with the field
/// paths the diagnostics' spans index ([`diag::render_binary`] renders them); on success, the
/// same paths for later diagnostics about the graph (a node's span is its path).
pub fn parse_binary(bytes: &[u8]) -> Result<(Parsed, onnx::Locations), (Vec<Diagnostic>, onnx::Locations)> {
    let read = onnx::read(bytes)?;
    let warnings = read.warnings;
    match lower::lower_with(&read.ast, read.values) {
        Ok(l) => {
            let mut all = warnings;
            all.extend(l.warnings);
            Ok((Parsed { model: l.model, warnings: all }, read.locations))
        }
        Err(e) => Err((e, read.locations)),
    }
}

/// Checks that a file's bytes are text, returning it; a binary file (such as a binary `.onnx`
/// protobuf) gets a diagnostic that says how to convert it.
pub fn decode(bytes: &[u8]) -> Result<&str, Diagnostic> {
    let binary_hint = "shardc reads the ONNX text syntax and binary ONNX (a protobuf ModelProto, which starts \
        with a field tag); this file starts like text but holds bytes text cannot";
    match std::str::from_utf8(bytes) {
        Ok(s) => {
            if let Some(pos) = s.find('\0') {
                return Err(Diagnostic::error("this is a binary file, not ONNX text (it contains a NUL byte)")
                    .with_primary(ir::Span::new(pos, pos + 1), "NUL byte")
                    .with_note(binary_hint));
            }
            Ok(s)
        }
        Err(e) => {
            let pos = e.valid_up_to();
            Err(Diagnostic::error("this is not UTF-8 text (a binary file?)")
                .with_primary(ir::Span::new(pos, pos + 1), "invalid UTF-8 byte")
                .with_note(binary_hint))
        }
    }
}
