//! Diagnostics: messages with labelled source spans, rendered with codespan-reporting as
//! `file:line:col`, the source line and a caret.
//!
//! Library code only builds [`Diagnostic`]s; the CLI decides when to render them.

use std::ops::Range;

use codespan_reporting::diagnostic as cs;
use codespan_reporting::files::{self, Files};
use codespan_reporting::term::{self, Chars, Config};
use ir::Span;

/// Lines longer than this are shown as a window around the labelled part.
const MAX_LINE: usize = 160;
/// Context kept on each side of a label in a cropped line.
const CONTEXT: usize = 60;
const ELLIPSIS: &str = "...";

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
/// (`error: …`, ` --> file:line:col`, the line and carets). Very long lines (a model's
/// initializer list is one line) are shown as a window around the label; line and column
/// numbers are those of the original text.
pub fn render(diags: &[Diagnostic], file_name: &str, source: &str) -> String {
    let config = Config { chars: Chars::ascii(), ..Config::default() };
    let mut out = String::new();
    for d in diags {
        let sev = match d.severity {
            Severity::Error => cs::Severity::Error,
            Severity::Warning => cs::Severity::Warning,
        };
        let spans: Vec<Range<usize>> = d.labels.iter().map(|l| clamp(l.span, source)).collect();
        let file = Cropped::new(file_name, source, &spans);
        let labels = d
            .labels
            .iter()
            .zip(&spans)
            .map(|(l, r)| {
                let range = file.map_range(r.clone());
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

/// A source with long lines cropped around given spans; reports original line and column
/// numbers.
struct Cropped<'a> {
    name: &'a str,
    original: &'a str,
    text: String,
    /// Start of each line in `text`.
    starts: Vec<usize>,
    /// Per line: (start in `text`, start in original, cropped window start in original,
    /// bytes of the leading ellipsis).
    map: Vec<(usize, usize, usize, usize)>,
}

impl<'a> Cropped<'a> {
    fn new(name: &'a str, original: &'a str, spans: &[Range<usize>]) -> Cropped<'a> {
        let mut text = String::with_capacity(original.len().min(1 << 16));
        let mut starts = Vec::new();
        let mut map = Vec::new();
        let mut pos = 0;
        for line in original.split_inclusive('\n') {
            let (line_start, line_end) = (pos, pos + line.len());
            pos = line_end;
            let body = line.strip_suffix('\n').unwrap_or(line);
            starts.push(text.len());
            if body.len() <= MAX_LINE {
                map.push((text.len(), line_start, line_start, 0));
                text.push_str(line);
                continue;
            }
            // A window around the first span on this line, else its beginning.
            let hit = spans.iter().find(|r| r.start >= line_start && r.start <= line_start + body.len());
            let (mut a, mut b) = match hit {
                Some(r) => (
                    r.start.saturating_sub(CONTEXT).max(line_start),
                    (r.end.min(line_start + body.len()) + CONTEXT).min(line_start + body.len()),
                ),
                None => (line_start, line_start + MAX_LINE),
            };
            while !original.is_char_boundary(a) {
                a -= 1;
            }
            while !original.is_char_boundary(b) {
                b += 1;
            }
            let lead = if a > line_start { ELLIPSIS.len() } else { 0 };
            map.push((text.len(), line_start, a, lead));
            if lead > 0 {
                text.push_str(ELLIPSIS);
            }
            text.push_str(&original[a..b]);
            if b < line_start + body.len() {
                text.push_str(ELLIPSIS);
            }
            if line.ends_with('\n') {
                text.push('\n');
            }
        }
        if starts.is_empty() || original.ends_with('\n') {
            starts.push(text.len());
            map.push((text.len(), original.len(), original.len(), 0));
        }
        Cropped { name, original, text, starts, map }
    }

    fn line_of_original(&self, p: usize) -> usize {
        match self.map.binary_search_by(|m| m.1.cmp(&p)) {
            Ok(i) => i,
            Err(i) => i.saturating_sub(1),
        }
    }

    /// Maps a byte range of the original text into the cropped text.
    fn map_range(&self, r: Range<usize>) -> Range<usize> {
        let f = |p: usize| {
            let i = self.line_of_original(p);
            let (cs, _, window, lead) = self.map[i];
            let line_len = self.starts.get(i + 1).copied().unwrap_or(self.text.len()) - cs;
            let off = if p < window { 0 } else { lead + (p - window) };
            cs + off.min(line_len)
        };
        let start = f(r.start);
        start..f(r.end).max(start)
    }

    /// Maps a byte of the cropped text back to the original.
    fn unmap(&self, p: usize) -> usize {
        let i = match self.starts.binary_search(&p) {
            Ok(i) => i,
            Err(i) => i.saturating_sub(1),
        };
        let (cs, _, window, lead) = self.map[i];
        window + (p - cs).saturating_sub(lead)
    }
}

impl<'a> Files<'a> for Cropped<'a> {
    type FileId = ();
    type Name = &'a str;
    type Source = &'a str;

    fn name(&'a self, _: ()) -> Result<&'a str, files::Error> {
        Ok(self.name)
    }

    fn source(&'a self, _: ()) -> Result<&'a str, files::Error> {
        Ok(&self.text)
    }

    fn line_index(&'a self, _: (), byte_index: usize) -> Result<usize, files::Error> {
        Ok(match self.starts.binary_search(&byte_index) {
            Ok(i) => i,
            Err(i) => i.saturating_sub(1),
        })
    }

    fn line_range(&'a self, _: (), line_index: usize) -> Result<Range<usize>, files::Error> {
        let start = *self
            .starts
            .get(line_index)
            .ok_or(files::Error::LineTooLarge { given: line_index, max: self.starts.len() })?;
        let end = self.starts.get(line_index + 1).copied().unwrap_or(self.text.len());
        Ok(start..end)
    }

    fn column_number(&'a self, _: (), line_index: usize, byte_index: usize) -> Result<usize, files::Error> {
        let orig = self.unmap(byte_index);
        let line_start = self.map.get(line_index).map_or(0, |m| m.1);
        let orig = orig.clamp(line_start, self.original.len());
        Ok(self.original[line_start..orig].chars().count() + 1)
    }
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

/// Renders diagnostics about a binary model, where a span is a field path ([`Locations`]):
/// `error: …`, then ` --> file: graph.node[3] (Conv `conv1`): label` for each label.
///
/// [`Locations`]: crate::onnx::Locations
pub fn render_binary(diags: &[Diagnostic], file_name: &str, locations: &crate::onnx::Locations) -> String {
    let mut out = String::new();
    for d in diags {
        out.push_str(if d.is_error() { "error: " } else { "warning: " });
        out.push_str(&d.message);
        out.push('\n');
        for l in &d.labels {
            let path = locations.path(l.span).unwrap_or("(unknown field)");
            let arrow = if l.primary { "-->" } else { "..." };
            out.push_str(&format!("  {arrow} {file_name}: {path}"));
            if !l.message.is_empty() {
                out.push_str(": ");
                out.push_str(&l.message);
            }
            out.push('\n');
        }
        for n in &d.notes {
            out.push_str(&format!("  = note: {n}\n"));
        }
        out.push('\n');
    }
    out
}
