//! What a command says on stderr while it works: progress bars for anything longer than a
//! second (off with `--quiet` or when stderr is not a terminal) and, with `-v`, per-pass
//! timings.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use passes::autoshard::{Progress, SearchEvent};

static QUIET: AtomicBool = AtomicBool::new(false);
/// Warnings are printed: by every command, except by the MPI ranks other than 0 (rank 0 speaks
/// for the job, so `mpirun -np 4` does not print each warning four times).
static WARNINGS: AtomicBool = AtomicBool::new(true);

/// This process is an MPI rank other than 0: its warnings are rank 0's too.
pub fn mute_warnings() {
    WARNINGS.store(false, Ordering::Relaxed);
}

/// Whether this process prints warnings ([`mute_warnings`]).
pub fn warnings_shown() -> bool {
    WARNINGS.load(Ordering::Relaxed)
}
static VERBOSE: AtomicBool = AtomicBool::new(false);

/// Sets `--quiet` and `-v` for the whole command.
pub fn set(quiet: bool, verbose: bool) {
    QUIET.store(quiet, Ordering::Relaxed);
    VERBOSE.store(verbose, Ordering::Relaxed);
}

/// `-v` was given.
pub fn verbose() -> bool {
    VERBOSE.load(Ordering::Relaxed)
}

/// Progress is drawn: not `--quiet`, and stderr is a terminal.
pub fn progress_shown() -> bool {
    !QUIET.load(Ordering::Relaxed) && std::io::stderr().is_terminal()
}

/// With `-v`: each pass's time, and what it changed, on stderr.
pub fn pass_timings(report: &passes::Report) {
    if !verbose() {
        return;
    }
    for t in &report.timings {
        eprintln!(
            "pass {:<16} {:>10.3} ms{}",
            t.pass,
            t.time.as_secs_f64() * 1e3,
            if t.changed == passes::Changed::Yes { "  (changed the graph)" } else { "" }
        );
    }
    let counters: Vec<String> = report.stats.iter().filter(|(_, n)| *n > 0).map(|(k, n)| format!("{k} {n}")).collect();
    if !counters.is_empty() {
        eprintln!("passes did: {}", counters.join(", "));
    }
}

/// With `-v`: the search's own phases per mesh.
pub fn search_timings(t: &passes::autoshard::plan::PlanTimings) {
    if !verbose() {
        return;
    }
    for m in &t.meshes {
        eprintln!(
            "search mesh {:<28} {:>8.3} s  (e-graph {:.3} s, extraction {:.3} s, dynamic program {:.3} s, local search {:.3} s, lower bound {:.3} s)",
            m.mesh, m.total_s, m.egraph_s, m.extraction_s, m.dp_s, m.local_search_s, m.bound_s
        );
    }
    if let Some(p) = t.pipeline_search_s {
        eprintln!("search pipelines {p:>31.3} s");
    }
    eprintln!("search total {:>35.3} s", t.search_s);
}

/// A spinner for the search: the mesh being searched, the best plan so far, pipeline
/// configurations priced and the time left under `--time-limit`. Returns the callback to
/// give the search and the bar to finish (both inert when progress is not shown).
pub fn search_progress(time_limit_s: f64) -> (Progress, Option<ProgressBar>) {
    if !progress_shown() {
        return (Progress::default(), None);
    }
    let bar = ProgressBar::new_spinner();
    bar.set_style(ProgressStyle::with_template("{spinner} {elapsed:>4} searching: {wide_msg}").expect("template"));
    bar.enable_steady_tick(Duration::from_millis(120));
    #[derive(Default)]
    struct State {
        meshes: usize,
        done: usize,
        current: Vec<String>,
        best: Option<f64>,
        pipelines: usize,
        best_pipeline: Option<f64>,
    }
    let state = Arc::new(Mutex::new(State::default()));
    let start = Instant::now();
    let b = bar.clone();
    let progress = Progress::new(move |e| {
        let mut s = state.lock().expect("progress state");
        match e {
            SearchEvent::MeshStarted { mesh, of, .. } => {
                s.meshes = *of;
                s.current.push(mesh.clone());
            }
            SearchEvent::MeshDone { mesh, step_time_s, feasible } => {
                s.done += 1;
                s.current.retain(|m| m != mesh);
                if *feasible && s.best.is_none_or(|b| *step_time_s < b) {
                    s.best = Some(*step_time_s);
                }
            }
            SearchEvent::PipelinePriced { step_time_s, .. } => {
                s.pipelines += 1;
                if step_time_s.is_finite() && s.best_pipeline.is_none_or(|b| *step_time_s < b) {
                    s.best_pipeline = Some(*step_time_s);
                }
            }
        }
        let mut msg = format!("mesh {}/{}", s.done, s.meshes);
        if !s.current.is_empty() {
            msg.push_str(&format!(" ({})", s.current.join(", ")));
        }
        if let Some(best) = s.best {
            msg.push_str(&format!(" · best so far {}", super::cost::secs(best)));
        }
        if s.pipelines > 0 {
            msg.push_str(&format!(" · {} pipeline configurations priced", s.pipelines));
            if let Some(p) = s.best_pipeline {
                msg.push_str(&format!(" (best {})", super::cost::secs(p)));
            }
        }
        let left = (time_limit_s - start.elapsed().as_secs_f64()).max(0.0);
        msg.push_str(&format!(" · at most {left:.0} s left"));
        b.set_message(msg);
    });
    (progress, Some(bar))
}

/// A bar over training or run steps; `None` when progress is not shown.
pub fn step_bar(steps: usize, what: &str) -> Option<ProgressBar> {
    if !progress_shown() || steps == 0 {
        return None;
    }
    let bar = ProgressBar::new(steps as u64);
    bar.set_style(
        ProgressStyle::with_template(&format!("{{spinner}} {what} {{pos}}/{{len}} [{{bar:30}}] {{elapsed}} {{msg}}"))
            .expect("template")
            .progress_chars("=> "),
    );
    bar.enable_steady_tick(Duration::from_millis(120));
    Some(bar)
}

/// A step hook that advances `bar`.
pub fn step_hook(bar: &Option<ProgressBar>) -> codegen::StepHook {
    match bar {
        Some(b) => {
            let b = b.clone();
            codegen::StepHook::new(move |done, _| b.set_position(done as u64))
        }
        None => codegen::StepHook::default(),
    }
}

/// Clears a bar off the terminal.
pub fn finish(bar: Option<ProgressBar>) {
    if let Some(b) = bar {
        b.finish_and_clear();
    }
}
