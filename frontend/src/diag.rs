//! Diagnostics: messages with labelled source spans, rendered with codespan-reporting as
//! `file:line:col`, the source line and a caret.
//!
//! Library code only builds [`Diagnostic`]s; the CLI decides when to render them.

use codespan_reporting::diagnostic as cs;
use codespan_reporting::files::SimpleFile;
use codespan_reporting::term::{self, Chars, Config};
use ir::Span;

/// How bad a diagnostic is.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Severity {
    /// The input is rejected.
    Error,
    /// The input is accepted, but something deserves attention.
    Warning,
}

/// A labelled span.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Label {
    /// Where.
    pub span: Span,
    /// What to say there.
    pub message: String,
    /// The main location (a caret) or a related one.
    pub primary: bool,
}

/// A message about the input, with locations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Diagnostic {
    /// Error or warning.
    pub severity: Severity,
    /// The headline.
    pub message: String,
    /// Source locations.
    pub labels: Vec<Label>,
    /// Extra lines (`= note: …`), e.g. what would fix it.
    pub notes: Vec<String>,
}

impl Diagnostic {
    /// An error.
    pub fn error(message: impl Into<String>) -> Diagnostic {
        Diagnostic { severity: Severity::Error, message: message.into(), labels: Vec::new(), notes: Vec::new() }
    }

    /// A warning.
    pub fn warning(message: impl Into<String>) -> Diagnostic {
        Diagnostic { severity: Severity::Warning, message: message.into(), labels: Vec::new(), notes: Vec::new() }
    }

    /// Adds the main location.
    pub fn with_primary(mut self, span: Span, message: impl Into<String>) -> Diagnostic {
        self.labels.push(Label { span, message: message.into(), primary: true });
        self
    }

    /// Adds a related location.
    pub fn with_secondary(mut self, span: Span, message: impl Into<String>) -> Diagnostic {
        self.labels.push(Label { span, message: message.into(), primary: false });
        self
    }

    /// Adds a note.
    pub fn with_note(mut self, note: impl Into<String>) -> Diagnostic {
        self.notes.push(note.into());
        self
    }

    /// True for errors.
    pub fn is_error(&self) -> bool {
        self.severity == Severity::Error
    }
}

/// Renders diagnostics against the source they refer to, one after another, in plain text
/// (`error: …`, ` --> file:line:col`, the line and carets).
pub fn render(diags: &[Diagnostic], file_name: &str, source: &str) -> String {
    let file = SimpleFile::new(file_name, source);
    let config = Config { chars: Chars::ascii(), ..Config::default() };
    let mut out = String::new();
    for d in diags {
        let sev = match d.severity {
            Severity::Error => cs::Severity::Error,
            Severity::Warning => cs::Severity::Warning,
        };
        let labels = d
            .labels
            .iter()
            .map(|l| {
                let range = clamp(l.span, source);
                let label = if l.primary { cs::Label::primary((), range) } else { cs::Label::secondary((), range) };
                label.with_message(l.message.clone())
            })
            .collect();
        let diag =
            cs::Diagnostic::new(sev).with_message(d.message.clone()).with_labels(labels).with_notes(d.notes.clone());
        match term::emit_into_string(&config, &file, &diag) {
            Ok(s) => out.push_str(&s),
            Err(_) => {
                out.push_str(&format!("{}: {}\n", if d.is_error() { "error" } else { "warning" }, d.message));
            }
        }
    }
    out
}

/// Keeps a span inside the source and on character boundaries.
fn clamp(span: Span, source: &str) -> std::ops::Range<usize> {
    let mut start = (span.start as usize).min(source.len());
    let mut end = (span.end as usize).clamp(start, source.len());
    while !source.is_char_boundary(start) {
        start -= 1;
    }
    while !source.is_char_boundary(end) {
        end += 1;
    }
    start..end
}

/// The 1-based line and column of a byte offset.
pub fn line_col(source: &str, offset: usize) -> (usize, usize) {
    let mut offset = offset.min(source.len());
    while !source.is_char_boundary(offset) {
        offset -= 1;
    }
    let before = &source[..offset];
    let line = before.matches('\n').count() + 1;
    let col = before.rfind('\n').map_or(offset, |nl| offset - nl - 1) + 1;
    (line, col)
}
