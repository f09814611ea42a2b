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

/// Largest device count a command accepts (a mesh of more is not a plan anyone can run).
pub const MAX_DEVICES: usize = 1 << 20;

/// `--devices`: a whole number from 1 to [`MAX_DEVICES`].
pub fn parse_devices(s: &str) -> Result<usize, String> {
    count_in(s, 1, MAX_DEVICES as u64).map(|n| n as usize)
}

/// `--pipeline`: `off`, `auto` or a stage count.
pub fn parse_pipeline(s: &str) -> Result<String, String> {
    shardc::passes::autoshard::PipelineMode::parse(s).map(|_| s.to_string())
}

/// A count of at least 1 (steps, micro-batches, node limits), at most 2^32.
pub fn parse_count(s: &str) -> Result<usize, String> {
    count_in(s, 1, 1 << 32).map(|n| n as usize)
}

/// A device index or seed: a whole number from 0.
pub fn parse_index(s: &str) -> Result<usize, String> {
    count_in(s, 0, u32::MAX as u64).map(|n| n as usize)
}

fn count_in(s: &str, lo: u64, hi: u64) -> Result<u64, String> {
    let n: i128 = s.trim().parse().map_err(|_| format!("`{s}` is not a whole number"))?;
    if n < lo as i128 || n > hi as i128 {
        return Err(format!("must be from {lo} to {hi}, got {s}"));
    }
    Ok(n as u64)
}

/// A finite number ≥ 0 (tolerances, weight decay).
pub fn parse_nonneg(s: &str) -> Result<f64, String> {
    let x: f64 = s.trim().parse().map_err(|_| format!("`{s}` is not a number"))?;
    if !x.is_finite() || x < 0.0 {
        return Err(format!("must be a finite number ≥ 0, got {s}"));
    }
    Ok(x)
}

/// A finite number > 0 (learning rates).
pub fn parse_positive(s: &str) -> Result<f64, String> {
    let x = parse_nonneg(s)?;
    if x == 0.0 {
        return Err(format!("must be greater than 0, got {s}"));
    }
    Ok(x)
}

/// A fraction in [0, 1) (momentum).
pub fn parse_fraction(s: &str) -> Result<f64, String> {
    let x = parse_nonneg(s)?;
    if x >= 1.0 {
        return Err(format!("must be at least 0 and below 1, got {s}"));
    }
    Ok(x)
}

/// A factor in (0, 1] (gradient compression).
pub fn parse_factor(s: &str) -> Result<f64, String> {
    let x = parse_positive(s)?;
    if x > 1.0 {
        return Err(format!("must be above 0 and at most 1, got {s}"));
    }
    Ok(x)
}

/// The largest time limit accepted, seconds (a year): the search's limit is a safety net,
/// and this always fits a `Duration`.
pub const MAX_TIME_LIMIT: f64 = 365.0 * 86400.0;

/// Seconds of a time limit: above 0, at most [`MAX_TIME_LIMIT`].
pub fn parse_seconds(s: &str) -> Result<f64, String> {
    let x = parse_positive(s)?;
    if x > MAX_TIME_LIMIT {
        return Err(format!("must be at most a year ({MAX_TIME_LIMIT:e} s), got {s}"));
    }
    Ok(x)
}

/// `--batch`: from 1 to 2^62.
pub fn parse_batch(s: &str) -> Result<i64, String> {
    count_in(s, 1, 1 << 62).map(|n| n as i64)
}

/// Options that change a model's inputs; every command that reads a model takes them.
#[derive(Args, Clone, Debug, Default)]
pub struct ShapeArgs {
    /// Global batch size: dim 0 of the inputs (baked constants are rewritten).
    #[arg(long, value_name = "B", value_parser = parse_batch, allow_negative_numbers = true)]
    pub batch: Option<i64>,
    /// New shape of an input, e.g. input_ids=8x1024 (repeatable).
    #[arg(long = "input-shape", value_name = "NAME=D0xD1x..")]
    pub input_shape: Vec<String>,
    /// Value of a symbolic dim of the inputs, e.g. batch=8 (repeatable).
    #[arg(long = "dim", value_name = "NAME=VALUE")]
    pub dim: Vec<String>,
}

impl ShapeArgs {
    /// The input shapes a plan was made for (`--input-shape` for each input it records).
    pub fn of_plan(plan: &passes::autoshard::Plan) -> ShapeArgs {
        ShapeArgs {
            batch: None,
            dim: Vec::new(),
            input_shape: plan
                .model
                .input_shapes
                .iter()
                .map(|(k, v)| format!("{k}={}", v.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("x")))
                .collect(),
        }
    }

    /// True when none of `--batch`, `--input-shape` and `--dim` was given.
    pub fn is_empty(&self) -> bool {
        self.batch.is_none() && self.input_shape.is_empty() && self.dim.is_empty()
    }

    /// What to change in the model at `model`: constants held as external data are read from
    /// the files beside it where they must change with the new dims.
    pub fn spec(&self, model: &Path) -> CliResult<passes::RebatchSpec> {
        let dir = model.parent().unwrap_or(Path::new(""));
        let external = passes::ExternalData::Read(shardc::exec::external_reader(dir));
        let mut spec = passes::RebatchSpec { batch: self.batch, external, ..Default::default() };
        for s in &self.input_shape {
            spec.input_shapes.push(passes::rebatch::parse_input_shape(s).map_err(CliError::msg)?);
        }
        for s in &self.dim {
            spec.dims.push(passes::rebatch::parse_dim(s).map_err(|e| CliError::msg(format!("--dim {e}")))?);
        }
        if let Some(b) = self.batch
            && b <= 0
        {
            return Err(CliError::msg(format!("--batch must be positive, got {b}")));
        }
        Ok(spec)
    }
}

/// Loads a model, prints frontend warnings, verifies it, applies `--batch`/`--input-shape`/
/// `--dim` and infers shapes.
pub fn load(path: &Path, shapes: &ShapeArgs) -> CliResult<Loaded> {
    load_with(path, shapes, false, false)
}

/// Like [`load`], and refuses what cannot be computed ([`passes::RequireStatic`]: unsupported
/// ops, unknown dims, shapes that depend on the data), for commands that train.
pub fn load_computable(path: &Path, shapes: &ShapeArgs) -> CliResult<Loaded> {
    load_with(path, shapes, false, true)
}

/// Like [`load`], then canonicalizes (what the cost model and the planner work on) and
/// refuses what cannot be computed.
pub fn load_canonical(path: &Path, shapes: &ShapeArgs) -> CliResult<Loaded> {
    load_with(path, shapes, true, true)
}

/// Loads the model at `path` to run on the input values at `inputs` ([`exec::given_inputs`]):
/// its inputs take the values' shapes, inputs that shape inference needs as constants are bound
/// ([`exec::prepare_with_values`]), then it is canonicalized and refused if it cannot be
/// computed.
pub fn load_with_values(
    path: &Path,
    inputs: &Path,
) -> CliResult<(Loaded, std::collections::HashMap<String, ir::eval::Array>)> {
    let mut loaded = read_model(path)?;
    note_input(inputs);
    let given = shardc::exec::given_inputs(&loaded.model.graph, inputs).map_err(CliError::msg)?;
    shardc::exec::prepare_with_values(&mut loaded.model, &given)
        .map_err(|e| CliError::msg(format!("the model does not take these inputs: {e}")))?;
    let mut pm = passes::PassManager::new();
    pm.add(passes::RequireStatic);
    let report = pm.run(&mut loaded.model).map_err(|e| pass_error(&e, &loaded.source))?;
    super::ui::pass_timings(&report);
    warn(&report.warnings, &loaded.source);
    Ok((loaded, given))
}

/// Reads the model at `path` (recording it and its external data as inputs) and prints the
/// frontend's warnings.
fn read_model(path: &Path) -> CliResult<Loaded> {
    note_input(path);
    let loaded = shardc::load_model(path).map_err(|e| CliError::new(e.render()))?;
    note_external_data(&loaded.model.graph, path);
    if !loaded.warnings.is_empty() && super::ui::warnings_shown() {
        eprint!("{}", loaded.source.render(&loaded.warnings));
    }
    Ok(loaded)
}

fn load_with(path: &Path, shapes: &ShapeArgs, canonical: bool, computable: bool) -> CliResult<Loaded> {
    let mut loaded = read_model(path)?;
    let spec = shapes.spec(path)?;
    let mut pm = passes::PassManager::new();
    pm.add(passes::Verify);
    if !spec.is_empty() {
        pm.add(passes::Rebatch { spec });
    }
    pm.add(passes::InferShapes::default());
    if canonical {
        pm.add(passes::Canonicalize);
        pm.add(passes::Algebra);
    }
    if computable {
        pm.add(passes::RequireStatic);
    }
    let report = pm.run(&mut loaded.model).map_err(|e| pass_error(&e, &loaded.source))?;
    super::ui::pass_timings(&report);
    warn(&report.warnings, &loaded.source);
    Ok(loaded)
}

/// Records the external data files `g`'s initializers name (beside the model at `path`)
/// as inputs.
pub fn note_external_data(g: &ir::Graph, path: &Path) {
    let dir = path.parent().unwrap_or(Path::new(""));
    for n in g.node_ids() {
        if let ir::Op::Initializer(t) | ir::Op::Input { default: Some(t) } = &g.node(n).op
            && let ir::TensorData::External(entries) = &t.data
        {
            // A fused weight names each part's file.
            for (_, loc) in entries.iter().filter(|(k, _)| k == "location") {
                note_input(&dir.join(loc));
            }
        }
    }
}

/// What to say of weights drawn from the seed because their external data file is absent: a
/// warning on stderr and a note for the report, or an error under `--require-weights`.
pub fn seeded_weights(
    weights: &shardc::exec::Weights,
    seed: u64,
    require: bool,
    extra: &str,
) -> CliResult<Option<String>> {
    if weights.seeded == 0 {
        return Ok(None);
    }
    let what = format!("{} tensors have external data whose file is not there", weights.seeded);
    if require {
        return Err(CliError::msg(format!("{what} (--require-weights); put the data files beside the model")));
    }
    if super::ui::warnings_shown() {
        eprintln!("warning: {what}; their values are drawn from --seed {seed} (--require-weights refuses instead)");
    }
    Ok(Some(format!("weights: {what}; drawn from --seed {seed}{extra}")))
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
    if items.is_empty() || !super::ui::warnings_shown() {
        return;
    }
    let shown: Vec<_> = items.iter().take(5).cloned().collect();
    eprint!("{}", source.render_located(&shown, frontend::Severity::Warning));
    if items.len() > shown.len() {
        eprintln!("warning: ... and {} more warnings", items.len() - shown.len());
    }
}

/// Files this command reads (the model, its external data, a plan, inputs, a cluster
/// file): no output may be written over any of them.
static INPUTS: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

/// Records `path` as an input of this command ([`write_output`] refuses to write over it).
pub fn note_input(path: &Path) {
    if let Ok(mut v) = INPUTS.lock()
        && !v.iter().any(|p| p == path)
    {
        v.push(path.to_path_buf());
    }
}

/// The inputs recorded so far.
fn inputs() -> Vec<PathBuf> {
    INPUTS.lock().map(|v| v.clone()).unwrap_or_default()
}

/// Checks output paths before any work: none may be a file this command reads (by file
/// identity: hard links, symlinks and other spellings of an input are refused), and each
/// must be writable where it is (its directory exists). `inputs` are recorded as with
/// [`note_input`].
pub fn guard_outputs(outputs: &[(&str, Option<&PathBuf>)], inputs_read: &[Option<&Path>]) -> CliResult {
    for p in inputs_read.iter().flatten() {
        note_input(p);
    }
    for (flag, out) in outputs {
        let Some(out) = out else { continue };
        refuse_input(out, Some(flag))?;
        let dir = match out.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        if !dir.is_dir() {
            return Err(CliError::msg(format!(
                "{flag} `{}`: the directory `{}` does not exist",
                out.display(),
                dir.display()
            )));
        }
        writable(flag, out, &dir)?;
    }
    Ok(())
}

/// An error, before any work, when `out` could not be written: a directory, a socket, or a
/// place where no file can be made (a read-only file system or directory). A regular file is
/// written beside its target and renamed, so making a file there is what is tried (and the
/// file removed).
fn writable(flag: &str, out: &Path, dir: &Path) -> CliResult {
    let fail = |why: String| CliError::msg(format!("{flag} `{}`: {why}", out.display()));
    let probe = |dir: &Path| {
        let p = dir.join(format!(".shardc-probe-{}", std::process::id()));
        match std::fs::OpenOptions::new().write(true).create_new(true).open(&p) {
            Ok(_) => {
                let _ = std::fs::remove_file(&p);
                Ok(())
            }
            Err(e) => Err(fail(format!("cannot write in `{}`: {e}", dir.display()))),
        }
    };
    match output_kind(out) {
        // Written in place when the time comes (opening a FIFO now would wait for a reader).
        Ok(OutputKind::Special(_)) => Ok(()),
        Ok(OutputKind::File { .. }) => probe(dir),
        // A directory takes one file per device (`lower -o DIR`); where one file is written,
        // writing says it is a directory.
        Err(e) if e.kind() == std::io::ErrorKind::IsADirectory => probe(out),
        Err(e) => Err(fail(e.to_string())),
    }
}

/// An error when `out` is one of the inputs.
fn refuse_input(out: &Path, flag: Option<&str>) -> CliResult {
    for p in inputs() {
        if same_file(out, &p) {
            let via = flag.map(|f| format!(" ({f})")).unwrap_or_default();
            return Err(CliError::msg(format!(
                "refusing to write{via} over `{}`, which this command reads{}; choose another output path",
                p.display(),
                if out == p { String::new() } else { format!(" (`{}` is the same file)", out.display()) }
            )));
        }
    }
    Ok(())
}

/// Writes `text` to `out` (a file) or stdout. Refuses to write over the model being read or
/// any other input of the command (by file identity). The file is written beside its
/// destination and renamed into place, so an interrupted write never leaves a truncated
/// file; replacing an existing file is said on stderr.
pub fn write_output(text: &str, out: Option<&PathBuf>, model: &Path) -> CliResult {
    // Text ends with a newline, as on stdout.
    let body = if text.is_empty() || text.ends_with('\n') { text.to_string() } else { format!("{text}\n") };
    write_output_bytes(body.as_bytes(), out, model)
}

/// Writes bytes (a binary model, or text that already ends as it should) to `out` or stdout,
/// as [`write_output`] does. `-o -` is stdout.
pub fn write_output_bytes(bytes: &[u8], out: Option<&PathBuf>, model: &Path) -> CliResult {
    match out {
        Some(p) if p.as_os_str() != "-" => {
            if !model.as_os_str().is_empty() {
                note_input(model);
            }
            refuse_input(p, None)?;
            let replaced =
                write_file(p, bytes).map_err(|e| CliError::msg(format!("cannot write `{}`: {e}", p.display())))?;
            if replaced {
                eprintln!("wrote {} (replaced the previous file)", p.display());
            }
            Ok(())
        }
        _ => {
            let mut stdout = std::io::stdout().lock();
            match stdout.write_all(bytes).and_then(|()| stdout.flush()) {
                Ok(()) => Ok(()),
                // A closed pipe (`| head`) is not an error of ours.
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
                Err(e) => Err(CliError::msg(format!("cannot write to stdout: {e}"))),
            }
        }
    }
}

/// What is at an output path (through a symlink, its target).
enum OutputKind {
    /// Nothing yet, or a regular file: written beside it and renamed over it.
    File { target: PathBuf, existed: bool },
    /// A character device, FIFO or block device: written to in place, never replaced.
    Special(PathBuf),
}

fn output_kind(path: &Path) -> std::io::Result<OutputKind> {
    use std::io::{Error, ErrorKind};
    let target = match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => std::fs::canonicalize(path)?,
        _ => path.to_path_buf(),
    };
    let meta = match std::fs::metadata(&target) {
        Ok(m) => m,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(OutputKind::File { target, existed: false }),
        Err(e) => return Err(e),
    };
    let kind = meta.file_type();
    if kind.is_dir() {
        return Err(Error::new(ErrorKind::IsADirectory, "it is a directory"));
    }
    if kind.is_file() {
        return Ok(OutputKind::File { target, existed: true });
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if kind.is_socket() {
            return Err(Error::new(ErrorKind::InvalidInput, "it is a socket, not a file or device"));
        }
    }
    Ok(OutputKind::Special(target))
}

/// Writes `bytes` to `path`: a regular file (or a new path) through a temporary file beside it
/// renamed into place, so an interrupted write never leaves a truncated file; a device or FIFO
/// in place (it is never replaced by a file); a directory or socket is an error. Returns
/// whether a file was replaced.
pub fn write_file(path: &Path, bytes: &[u8]) -> std::io::Result<bool> {
    let (target, existed) = match output_kind(path)? {
        OutputKind::Special(target) => {
            let mut f = std::fs::OpenOptions::new().write(true).open(&target)?;
            f.write_all(bytes)?;
            f.flush()?;
            return Ok(false);
        }
        OutputKind::File { target, existed } => (target, existed),
    };
    let name = target.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = target.with_file_name(format!(".{name}.shardc-{}.tmp", std::process::id()));
    // Interrupted now, the handler removes the partial file.
    let _guard = super::signals::writing(&tmp);
    let written = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        let (first, rest) = bytes.split_at(bytes.len() / 2);
        f.write_all(first)?;
        pause_for_tests();
        f.write_all(rest)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &target)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written.map(|()| existed)
}

/// The tests' way to interrupt a write in its middle: `SHARDC_TEST_PAUSE_WRITE_MS` holds a
/// half-written output that long (tests/cli.rs sends SIGINT and SIGTERM then).
fn pause_for_tests() {
    if let Some(ms) = std::env::var("SHARDC_TEST_PAUSE_WRITE_MS").ok().and_then(|v| v.parse().ok()) {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
}

/// Whether two paths name the same existing file: the same device and inode (so hard links
/// and symlinks count), or the same canonical path where the OS has no inodes.
pub fn same_file(a: &Path, b: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        match (std::fs::metadata(a), std::fs::metadata(b)) {
            (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
            _ => false,
        }
    }
    #[cfg(not(unix))]
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

pub use shardc::report::bytes;

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

/// "verified: …" for a program the prover proves (`what` the graph's results are: "the
/// training step's", "the model's"), else the refutation as an error.
pub fn proved(g: &ir::Graph, program: &codegen::Program, what: &str) -> CliResult<String> {
    let t0 = std::time::Instant::now();
    match codegen::verify(g, program) {
        Ok(p) => Ok(format!(
            "verified: {} values on {} devices compute {what} {} result{} ({:.2} s)",
            p.values,
            p.devices,
            p.results,
            if p.results == 1 { "" } else { "s" },
            t0.elapsed().as_secs_f64()
        )),
        Err(e) => Err(CliError::msg(e.to_string())),
    }
}

/// [`proved`] for a forward program of `g`: with micro-batches, each device's program runs one
/// micro-batch, so it is proved against `g` re-batched to one micro-batch.
pub fn proved_forward(g: &ir::Graph, program: &codegen::Program) -> CliResult<String> {
    let m = program.micro_batches.max(1);
    let micro = shardc::exec::proof_graph(g, program).map_err(|e| CliError::msg(format!("--verify: {e}")))?;
    match m {
        1 => proved(&micro, program, "the model's"),
        m => proved(&micro, program, &format!("one micro-batch (of {m}) of the model's")),
    }
}

/// Reads a plan document (`shardc plan -o`).
pub fn read_plan(path: &Path) -> CliResult<passes::autoshard::Plan> {
    note_input(path);
    let text =
        std::fs::read_to_string(path).map_err(|e| CliError::msg(format!("cannot read `{}`: {e}", path.display())))?;
    passes::autoshard::Plan::from_json(&text).map_err(|e| CliError::msg(format!("`{}`: {e}", path.display())))
}

/// Makes on `g` the algebraic rewrites `plan` was searched with and applied
/// ([`shardc::session::train::apply_plan_rewrites`]).
pub fn apply_plan_rewrites(g: &mut ir::Graph, plan: &passes::autoshard::Plan) -> CliResult<()> {
    shardc::session::train::apply_plan_rewrites(g, plan).map_err(CliError::msg)
}

/// Checks that the plan at `plan_path` was made for `model` (their sha256 agree). When it
/// was made for another file, that is an error, unless `force`: then a note, and the plan
/// still has to fit the model op by op and tensor by tensor ([`passes::autoshard::Plan::differences`]).
pub fn check_plan_model(
    plan: &passes::autoshard::Plan,
    plan_path: &Path,
    model: &Path,
    force: bool,
) -> CliResult<Option<String>> {
    use sha2::Digest;
    let bytes = std::fs::read(model).map_err(|e| CliError::msg(format!("cannot read `{}`: {e}", model.display())))?;
    let sha = format!("{:x}", sha2::Sha256::digest(&bytes));
    if plan.model.sha256 == sha {
        return Ok(None);
    }
    let what = if plan.model.sha256.is_empty() {
        "records no sha256 of its model".to_string()
    } else {
        format!(
            "was made for another file (`{}`, sha256 {}…; `{}` has {}…)",
            plan.model.path,
            plan.model.sha256.chars().take(12).collect::<String>(),
            model.display(),
            &sha[..12]
        )
    };
    if force {
        Ok(Some(format!(
            "`{}` {what}; applied anyway (--force): its ops match the model's by name and shape",
            plan_path.display()
        )))
    } else {
        Err(CliError::msg(format!(
            "`{}` {what}; plan this model again, or pass --force to apply the plan to a re-exported model whose ops all match by name and shape",
            plan_path.display()
        )))
    }
}

/// The check before a run allocates: the bytes the host and each device will hold
/// ([`shardc::footprint`]: the constants of `held` and of the device programs, the inputs,
/// activations at the programs' peaks, the single-device reference when one runs) against
/// what there is (the host's available memory; on a GPU, the largest buffer the adapter
/// allows). Over it, an error with the numbers and what to reduce; else the promise.
pub fn preflight(
    program: &codegen::Program,
    held: &[(&str, &ir::Graph)],
    global: &ir::Graph,
    reference: Option<shardc::footprint::Reference<'_>>,
    backend: codegen::Backend,
) -> CliResult<shardc::footprint::Footprint> {
    let too_large = || CliError::msg("a tensor of this run is too large to count; reduce --batch or --input-shape");
    let gpu = match backend {
        codegen::Backend::Wgpu => codegen::runtime::gpu_limits().ok(),
        codegen::Backend::Cpu => None,
    };
    if let Some(l) = &gpu {
        for d in &program.devices {
            let most = d.largest_tensor_bytes().ok_or_else(too_large)?;
            if most > l.max_buffer_bytes {
                return Err(CliError::msg(format!(
                    "device {} would hold a tensor of {}, more than one buffer of {} may ({}); \
                     reduce --batch or --input-shape, or split the tensor over more --devices",
                    d.device,
                    bytes(most as f64),
                    l.name,
                    bytes(l.max_buffer_bytes as f64)
                )));
            }
        }
    }
    let on_host = gpu.as_ref().is_none_or(|l| l.host_memory);
    let mut promise = shardc::footprint::footprint(program, held, global, on_host, reference).ok_or_else(too_large)?;
    // The process as it stands, then what each GPU device's driver will add (measured by
    // opening one after it).
    let (gpus, per_gpu) = match backend {
        codegen::Backend::Wgpu => (program.devices.len(), codegen::runtime::gpu_device_host_bytes().ok().flatten()),
        codegen::Backend::Cpu => (0, None),
    };
    promise.measure_process(gpus, per_gpu);
    let need = promise.to_come();
    if let Some(avail) = codegen::runtime::host_memory_available()
        && need > avail
    {
        return Err(CliError::msg(format!(
            "this run needs about {} more of host memory ({} in all: {}) but {} is available; reduce --batch or --input-shape{}",
            bytes(need as f64),
            bytes(promise.total() as f64),
            promise.describe(|b| bytes(b as f64)),
            bytes(avail as f64),
            if reference.is_some() { ", or leave out --check" } else { "" }
        )));
    }
    Ok(promise)
}

/// The process's memory against its promise, for `--json`: the peak resident set, the
/// promised total and its parts.
pub fn host_memory_json(promise: &shardc::footprint::Footprint) -> serde_json::Value {
    serde_json::json!({
        "peak_rss_bytes": shardc::footprint::peak_rss_bytes(),
        "promised_bytes": promise.total(),
        "promise": promise.parts.iter().map(|(w, b)| serde_json::json!({"what": w, "bytes": b})).collect::<Vec<_>>(),
    })
}

/// The report's `host memory` line: the process's peak resident set against the promise.
pub fn host_memory_line(promise: &shardc::footprint::Footprint) -> String {
    let peak = shardc::footprint::peak_rss_bytes()
        .map_or_else(|| "peak not measured".to_string(), |b| format!("{} peak", bytes(b as f64)));
    format!(
        "host memory  {peak}; {} promised ({})\n",
        bytes(promise.total() as f64),
        promise.describe(|b| bytes(b as f64))
    )
}
