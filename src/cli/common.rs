//! What every subcommand shares: loading a model (with re-batching), reporting errors,
//! writing output.

use std::io::Write;
use std::path::{Path, PathBuf};

use clap::Args;
use shardc::{Loaded, Source};

/// An error to print on stderr, already rendered, with the exit code to use.
#[derive(Debug)]
pub struct CliError {
    pub message: String,
    pub code: i32,
}

impl CliError {
    pub fn new(message: impl Into<String>) -> CliError {
        let mut message = message.into();
        if !message.ends_with('\n') {
            message.push('\n');
        }
        CliError { message, code: 1 }
    }

    pub fn msg(message: impl std::fmt::Display) -> CliError {
        CliError::new(format!("error: {message}"))
    }
}

pub type CliResult<T = ()> = Result<T, CliError>;

/// Options that change a model's inputs; every command that reads a model takes them.
#[derive(Args, Clone, Debug, Default)]
pub struct ShapeArgs {
    /// Global batch size: dim 0 of the inputs (baked constants are rewritten).
    #[arg(long, value_name = "B")]
    pub batch: Option<i64>,
    /// New shape of an input, e.g. input_ids=8x1024 (repeatable).
    #[arg(long = "input-shape", value_name = "NAME=D0xD1x..")]
    pub input_shape: Vec<String>,
}

impl ShapeArgs {
    pub fn spec(&self) -> CliResult<passes::RebatchSpec> {
        let mut spec = passes::RebatchSpec { batch: self.batch, input_shapes: Vec::new() };
        for s in &self.input_shape {
            spec.input_shapes.push(passes::rebatch::parse_input_shape(s).map_err(CliError::msg)?);
        }
        if let Some(b) = self.batch
            && b <= 0
        {
            return Err(CliError::msg(format!("--batch must be positive, got {b}")));
        }
        Ok(spec)
    }
}

/// Loads a model, prints frontend warnings, verifies it, applies `--batch`/`--input-shape`
/// and infers shapes.
pub fn load(path: &Path, shapes: &ShapeArgs) -> CliResult<Loaded> {
    load_with(path, shapes, false)
}

/// Like [`load`], then canonicalizes (what the cost model and the planner work on).
pub fn load_canonical(path: &Path, shapes: &ShapeArgs) -> CliResult<Loaded> {
    load_with(path, shapes, true)
}

fn load_with(path: &Path, shapes: &ShapeArgs, canonical: bool) -> CliResult<Loaded> {
    let mut loaded = shardc::load_model(path).map_err(|e| CliError::new(e.render()))?;
    if !loaded.warnings.is_empty() {
        eprint!("{}", loaded.source.render(&loaded.warnings));
    }
    let spec = shapes.spec()?;
    let mut pm = passes::PassManager::new();
    pm.add(passes::Verify);
    if !spec.is_empty() {
        pm.add(passes::Rebatch { spec });
    }
    pm.add(passes::InferShapes::default());
    if canonical {
        pm.add(passes::Canonicalize);
    }
    let report = pm.run(&mut loaded.model).map_err(|e| pass_error(&e, &loaded.source))?;
    warn(&report.warnings, &loaded.source);
    Ok(loaded)
}

/// Renders a pass failure.
pub fn pass_error(e: &passes::PassError, source: &Source) -> CliError {
    let mut items = e.errors.clone();
    items.truncate(20);
    let mut text = source.render_located(&items, frontend::Severity::Error);
    if e.errors.len() > items.len() {
        text.push_str(&format!("... and {} more errors\n", e.errors.len() - items.len()));
    }
    CliError::new(text)
}

/// Prints warnings (at most a few of each kind, so a stale export does not flood the screen).
pub fn warn(items: &[passes::Located], source: &Source) {
    if items.is_empty() {
        return;
    }
    let shown: Vec<_> = items.iter().take(5).cloned().collect();
    eprint!("{}", source.render_located(&shown, frontend::Severity::Warning));
    if items.len() > shown.len() {
        eprintln!("warning: ... and {} more warnings", items.len() - shown.len());
    }
}

/// Writes `text` to `out` (a file) or stdout. Refuses to overwrite the model being read.
pub fn write_output(text: &str, out: Option<&PathBuf>, model: &Path) -> CliResult {
    match out {
        Some(p) => {
            if same_file(p, model) {
                return Err(CliError::msg(format!(
                    "refusing to overwrite the input model `{}`; choose another output path",
                    model.display()
                )));
            }
            // Text ends with a newline, as on stdout.
            let body = if text.is_empty() || text.ends_with('\n') { text.to_string() } else { format!("{text}\n") };
            std::fs::write(p, body).map_err(|e| CliError::msg(format!("cannot write `{}`: {e}", p.display())))
        }
        None => {
            let mut stdout = std::io::stdout().lock();
            let r = stdout
                .write_all(text.as_bytes())
                .and_then(|_| if text.ends_with('\n') { Ok(()) } else { stdout.write_all(b"\n") });
            match r {
                Ok(()) => Ok(()),
                // A closed pipe (`| head`) is not an error of ours.
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
                Err(e) => Err(CliError::msg(format!("cannot write to stdout: {e}"))),
            }
        }
    }
}

/// Whether two paths name the same existing file.
pub fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(x), Ok(y)) => x == y,
        _ => false,
    }
}

/// `1234567` → `1,234,567`.
pub fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Human-readable quantity with an SI prefix: `8.21 G`.
pub fn si(x: f64) -> String {
    let (v, p) = if x >= 1e15 {
        (x / 1e15, "P")
    } else if x >= 1e12 {
        (x / 1e12, "T")
    } else if x >= 1e9 {
        (x / 1e9, "G")
    } else if x >= 1e6 {
        (x / 1e6, "M")
    } else if x >= 1e3 {
        (x / 1e3, "k")
    } else {
        (x, "")
    };
    format!("{v:.3} {p}")
}

/// Bytes with a binary prefix: `97.3 MiB`.
pub fn bytes(x: f64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = x;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 { format!("{v:.0} {}", units[u]) } else { format!("{v:.2} {}", units[u]) }
}

/// The lowered program's consistency check ([`codegen::check`]), its first ten findings as
/// the error.
pub fn check_program(program: &codegen::Program) -> CliResult {
    if let Err(errs) = codegen::check(program) {
        let mut m = String::from("error: the lowered program is inconsistent:\n");
        for e in errs.iter().take(10) {
            m.push_str(&format!("  {e}\n"));
        }
        return Err(CliError::new(m));
    }
    Ok(())
}

/// Reads a plan document (`shardc plan -o`).
pub fn read_plan(path: &Path) -> CliResult<passes::autoshard::Plan> {
    let text =
        std::fs::read_to_string(path).map_err(|e| CliError::msg(format!("cannot read `{}`: {e}", path.display())))?;
    passes::autoshard::Plan::from_json(&text).map_err(|e| CliError::msg(format!("`{}`: {e}", path.display())))
}

/// A warning when the plan at `plan_path` was made for a file other than `model` (their
/// sha256 differ).
pub fn plan_model_warning(plan: &passes::autoshard::Plan, plan_path: &Path, model: &Path) -> Option<String> {
    use sha2::Digest;
    let bytes = std::fs::read(model).ok()?;
    let sha = format!("{:x}", sha2::Sha256::digest(&bytes));
    (!plan.model.sha256.is_empty() && plan.model.sha256 != sha)
        .then(|| format!("warning: `{}` was made for a different file (sha256 differs)", plan_path.display()))
}
