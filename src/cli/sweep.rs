//! `shardc sweep`: Castelló et al.'s five-axis analysis — step time of several strategies
//! along batch size, device FLOP/s, memory bandwidth, link bandwidth or device count.

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use passes::autoshard::{self, Named};
use passes::cost::Cluster;
use serde_json::json;

use super::common::*;
use super::cost::{ModelArgs, load_cluster, secs};

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum Axis {
    Batch,
    Flops,
    Membw,
    Linkbw,
    Devices,
}

#[derive(Args, Clone, Debug)]
pub struct SweepArgs {
    /// The model (ONNX textual syntax).
    pub model: PathBuf,
    /// A preset or a TOML file.
    #[arg(long)]
    pub cluster: String,
    /// The axis to sweep.
    #[arg(long, value_enum)]
    pub axis: Axis,
    /// Values along the axis, comma-separated. Numbers (`1e12`, `64`) or multipliers of the
    /// cluster's value (`0.5x,1x,2x`) for flops, membw and linkbw.
    #[arg(long, value_delimiter = ',', required = true)]
    pub values: Vec<String>,
    /// Strategies to compare: names, comma-separated (`data,megatron`), and configurations of
    /// key=value fields (docs/memory.md), each set off by `;` (`data;tp=2,dp=4,sp;tp=8,zero=1`).
    #[arg(long, required = true)]
    pub strategies: Vec<String>,
    /// Devices (for axes other than `devices`; default: all of the cluster).
    #[arg(long, value_parser = parse_devices, allow_negative_numbers = true)]
    pub devices: Option<usize>,
    /// Draw the sweep as an SVG line chart.
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// Write the chart and the table as a self-contained HTML page.
    #[arg(long, value_name = "FILE")]
    pub html: Option<PathBuf>,
    /// Print one JSON document.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub shapes: ShapeArgs,
    #[command(flatten)]
    pub model_args: ModelArgs,
}

/// A step time, or why there is none.
#[derive(Clone, Debug)]
enum Cell {
    Time(f64),
    Infeasible(f64),
    NotApplicable(String),
}

impl Axis {
    fn label(self) -> &'static str {
        match self {
            Axis::Batch => "batch size",
            Axis::Flops => "peak FLOP/s per device",
            Axis::Membw => "memory bandwidth",
            Axis::Linkbw => "link bandwidth per device",
            Axis::Devices => "devices",
        }
    }
}

impl Cell {
    fn time(&self) -> Option<f64> {
        match self {
            Cell::Time(t) => Some(*t),
            _ => None,
        }
    }
}

fn parse_value(s: &str, base: f64) -> Result<f64, String> {
    let v = match s.strip_suffix('x') {
        Some(m) => m.trim().parse::<f64>().map(|m| m * base),
        None => s.trim().parse::<f64>(),
    }
    .map_err(|_| format!("`{s}` is not a number or a multiplier like 2x"))?;
    if v > 0.0 && v.is_finite() { Ok(v) } else { Err(format!("`{s}` must be positive")) }
}

/// The sweep's point `vs` along its axis: the axis value, and the cluster, device count and
/// graph priced there.
fn point(
    args: &SweepArgs,
    base: &Cluster,
    loaded: &shardc::Loaded,
    vs: &str,
) -> CliResult<(f64, Cluster, usize, ir::Graph)> {
    let mut cluster: Cluster = base.clone();
    let mut devices = args.devices.unwrap_or(base.devices());
    let mut graph = loaded.model.graph.clone();
    let x = match args.axis {
        Axis::Batch => {
            let b: f64 = parse_value(vs, 1.0).map_err(CliError::msg)?;
            // Priced only: external constants change shape, their values never read.
            let external = passes::ExternalData::ShapesOnly;
            let spec = passes::RebatchSpec { batch: Some(b as i64), external, ..Default::default() };
            passes::rebatch::rebatch(&mut graph, &spec).map_err(|e| pass_error(&e, &loaded.source))?;
            b
        }
        Axis::Devices => {
            let d = parse_value(vs, 1.0).map_err(CliError::msg)?;
            devices = d as usize;
            if devices > cluster.devices() {
                // Grow the machine by whole nodes, as a cluster of the same nodes would.
                let nodes = devices.div_ceil(cluster.devices_per_node);
                if cluster.inter.is_none() {
                    return Err(CliError::msg(format!(
                        "{} has {} devices and no inter-node link to grow it to {devices}",
                        cluster.name,
                        cluster.devices()
                    )));
                }
                cluster.nodes = nodes;
            }
            d
        }
        Axis::Flops => {
            let f = parse_value(vs, base.device.peak_flops.fp32).map_err(CliError::msg)?;
            let k = f / base.device.peak_flops.fp32;
            cluster.device.peak_flops.fp32 = f;
            cluster.device.peak_flops.tf32 = base.device.peak_flops.tf32.map(|x| x * k);
            cluster.device.peak_flops.fp16 = base.device.peak_flops.fp16.map(|x| x * k);
            f
        }
        Axis::Membw => {
            let m = parse_value(vs, base.device.mem_bandwidth).map_err(CliError::msg)?;
            cluster.device.mem_bandwidth = m;
            m
        }
        Axis::Linkbw => {
            let l = parse_value(vs, base.intra.bandwidth).map_err(CliError::msg)?;
            let k = l / base.intra.bandwidth;
            cluster.intra.bandwidth = l;
            if let Some(i) = &mut cluster.inter {
                i.bandwidth *= k;
            }
            l
        }
    };
    Ok((x, cluster, devices, graph))
}

/// The best strategy at each point; a strategy within 0.5% of the best counts as tied, and a
/// tie keeps the previous point's best (so near-equal strategies do not flap).
fn bests(rows: &[Vec<Cell>]) -> Vec<Option<usize>> {
    let mut best: Vec<Option<usize>> = Vec::with_capacity(rows.len());
    for r in rows {
        let min = r.iter().filter_map(Cell::time).fold(f64::INFINITY, f64::min);
        let tied: Vec<usize> = (0..r.len()).filter(|&i| r[i].time().is_some_and(|t| t <= min * 1.005)).collect();
        let prev = best.last().copied().flatten();
        best.push(match prev {
            Some(p) if tied.contains(&p) => Some(p),
            _ => r
                .iter()
                .enumerate()
                .filter_map(|(i, c)| c.time().map(|t| (i, t)))
                .min_by(|a, b| a.1.total_cmp(&b.1))
                .map(|(i, _)| i),
        });
    }
    best
}

/// A priced sweep: the axis values, a row of cells per value (a column per strategy), the
/// best strategy at each and where the best changes.
struct Swept {
    xs: Vec<f64>,
    rows: Vec<Vec<Cell>>,
    best: Vec<Option<usize>>,
    crossovers: Vec<Crossover>,
}

impl Swept {
    /// The sweep as JSON: every point's step times and best strategy, and the crossovers.
    fn json(&self, args: &SweepArgs, base: &Cluster) -> serde_json::Value {
        let Swept { xs, rows, best, crossovers } = self;
        let axis_name = format!("{:?}", args.axis).to_lowercase();
        json!({
            "model": args.model.display().to_string(),
            "cluster": base.name,
            "axis": axis_name,
            "strategies": args.strategies,
            "points": xs.iter().zip(rows).zip(best).map(|((x, r), b)| json!({
                "value": x,
                "step_time_s": r.iter().map(|c| match c { Cell::Time(t) => json!(t), _ => json!(null) }).collect::<Vec<_>>(),
                "feasible": r.iter().map(|c| matches!(c, Cell::Time(_))).collect::<Vec<_>>(),
                "best": b.map(|i| args.strategies[i].clone()),
            })).collect::<Vec<_>>(),
            "crossovers": crossovers.iter().map(|c| json!({ "between": [c.lo, c.hi], "at": c.at, "from": args.strategies[c.from], "to": args.strategies[c.to] })).collect::<Vec<_>>(),
        })
    }

    /// The sweep as a table: a row per point, a column per strategy, then the crossovers.
    fn text(&self, args: &SweepArgs, base: &Cluster) -> String {
        let Swept { xs, rows, best, crossovers } = self;
        let axis_name = format!("{:?}", args.axis).to_lowercase();
        let mut t = String::new();
        t.push_str(&format!("sweep of {} on {} along {axis_name}\n", args.model.display(), base.name));
        t.push_str(&format!("{:>12}", axis_name));
        for s in &args.strategies {
            t.push_str(&format!(" {s:>14}"));
        }
        t.push_str("   best\n");
        let mut notes = Vec::new();
        for ((x, r), b) in xs.iter().zip(rows).zip(best) {
            t.push_str(&format!("{:>12}", fmt_value(args.axis, *x)));
            for c in r {
                let cell = match c {
                    Cell::Time(v) => secs(*v),
                    Cell::Infeasible(_) => "no fit".into(),
                    Cell::NotApplicable(e) => {
                        if !notes.contains(e) {
                            notes.push(e.clone());
                        }
                        "n/a".into()
                    }
                };
                t.push_str(&format!(" {cell:>14}"));
            }
            t.push_str(&format!("   {}\n", b.map_or("-".into(), |i| args.strategies[i].clone())));
        }
        for c in crossovers {
            t.push_str(&format!(
                "crossover    {} overtakes {} at {} {axis_name} (between {} and {})\n",
                args.strategies[c.to],
                args.strategies[c.from],
                fmt_value(args.axis, c.at),
                fmt_value(args.axis, c.lo),
                fmt_value(args.axis, c.hi)
            ));
        }
        if crossovers.is_empty() {
            t.push_str("no crossover: the best strategy is the same along the sweep\n");
        }
        for n in notes {
            t.push_str(&format!("n/a          {n}\n"));
        }
        t
    }
}

/// The strategies `--strategies` lists: split at `;`, and a piece without `=` (names only)
/// also at `,`.
fn strategy_list(given: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    for piece in given.iter().flat_map(|g| g.split(';')).map(str::trim).filter(|p| !p.is_empty()) {
        if piece.contains('=') {
            out.push(piece.to_string());
        } else {
            out.extend(piece.split(',').map(str::trim).filter(|n| !n.is_empty()).map(String::from));
        }
    }
    out
}

/// A strategy of the sweep priced at one point as `cost --strategy` prices it
/// ([`super::cost::strategy_and_options`]: a configuration resolved on `devices`, the graph
/// rewritten as it asks).
fn price_at(
    graph: &ir::Graph,
    cluster: &passes::cost::Cluster,
    devices: usize,
    s: &str,
    opts: &passes::cost::Options,
) -> Result<passes::autoshard::named::Priced, String> {
    if !autoshard::config::is_config(s) {
        return autoshard::named::price(graph, cluster, devices, &Named::parse(s)?, opts);
    }
    // The configuration may rewrite the graph (`flash`): a copy of it.
    let mut g = graph.clone();
    let (named, o) = super::cost::configuration(s, devices, &mut g, opts.clone())?;
    autoshard::named::price(&g, cluster, devices, &named, &o)
}

pub fn run(args: &SweepArgs) -> CliResult {
    let args = &SweepArgs { strategies: strategy_list(&args.strategies), ..args.clone() };
    guard_outputs(&[("--svg", args.svg.as_ref()), ("--html", args.html.as_ref())], &[Some(&args.model)])?;
    let mut loaded = load_canonical(&args.model, &args.shapes)?;
    args.model_args.freeze(&mut loaded.model.graph)?;
    let base = load_cluster(&args.cluster)?;
    let opts = args.model_args.options()?;
    for s in &args.strategies {
        if autoshard::config::is_config(s) {
            autoshard::config::Config::parse(s).map_err(|e| CliError::msg(format!("--strategies `{s}`: {e}")))?;
        } else {
            Named::parse(s).map_err(CliError::msg)?;
        }
    }
    let mut xs = Vec::new();
    let mut rows: Vec<Vec<Cell>> = Vec::new();
    for vs in &args.values {
        let (x, cluster, devices, graph) = point(args, &base, &loaded, vs)?;
        let mut row = Vec::new();
        for s in &args.strategies {
            row.push(match price_at(&graph, &cluster, devices, s, &opts) {
                Ok(p) if p.breakdown.feasible => Cell::Time(p.breakdown.step_time_s),
                Ok(p) => Cell::Infeasible(p.breakdown.step_time_s),
                Err(e) => Cell::NotApplicable(format!("{s}: {e}")),
            });
        }
        xs.push(x);
        rows.push(row);
    }
    let best = bests(&rows);
    let crossovers = find_crossovers(&xs, &rows, &best);
    let swept = Swept { xs, rows, best, crossovers };

    let model_name =
        args.model.file_name().map_or_else(|| args.model.display().to_string(), |f| f.to_string_lossy().into());
    let title = format!("{model_name} on {}: step time vs {}", base.name, args.axis.label());
    let lines: Vec<shardc::report::SweepLine> = args
        .strategies
        .iter()
        .enumerate()
        .map(|(k, name)| shardc::report::SweepLine {
            name: name.clone(),
            points: swept
                .rows
                .iter()
                .map(|r| match &r[k] {
                    Cell::Time(t) => Some((*t, true)),
                    Cell::Infeasible(t) if *t > 0.0 => Some((*t, false)),
                    _ => None,
                })
                .collect(),
        })
        .collect();
    let at: Vec<f64> = swept.crossovers.iter().map(|c| c.at).collect();
    let axis = args.axis;
    let svg = || {
        shardc::report::sweep_svg(&title, axis.label(), &swept.xs, &lines, &at, &|x| fmt_value(axis, x))
            .map_err(CliError::msg)
    };
    if let Some(path) = &args.svg {
        write_output(&svg()?, Some(path), &args.model)?;
    }
    if args.json {
        let doc = swept.json(args, &base);
        return write_output(&serde_json::to_string_pretty(&doc).expect("JSON"), None, &args.model);
    }
    let t = swept.text(args, &base);
    if let Some(path) = &args.html {
        let sections = vec![
            ("step time".to_string(), format!("<div class=\"chart\">{}</div>", svg()?)),
            ("table".to_string(), format!("<pre>{}</pre>", shardc::report::esc(&t))),
        ];
        write_output(&shardc::report::page(&title, &sections), Some(path), &args.model)?;
    }
    write_output(&t, None, &args.model)
}

/// A value of the axis in its unit: `24 GB/s`, `19.5 TFLOP/s`, `64`.
fn fmt_value(axis: Axis, x: f64) -> String {
    match axis {
        Axis::Flops => shardc::report::si(x, "FLOP/s"),
        Axis::Membw | Axis::Linkbw => shardc::report::si(x, "B/s"),
        Axis::Batch | Axis::Devices => fmt_x(x),
    }
}

fn fmt_x(x: f64) -> String {
    if x >= 1e6 {
        format!("{x:.3e}")
    } else if x.fract() == 0.0 {
        format!("{x:.0}")
    } else {
        format!("{x:.3}")
    }
}

struct Crossover {
    lo: f64,
    hi: f64,
    at: f64,
    from: usize,
    to: usize,
}

/// Where the best strategy changes: the point between two sweep values where the two
/// strategies' times cross (interpolated in log-log space).
fn find_crossovers(xs: &[f64], rows: &[Vec<Cell>], best: &[Option<usize>]) -> Vec<Crossover> {
    let mut out = Vec::new();
    for i in 1..xs.len() {
        let (Some(a), Some(b)) = (best[i - 1], best[i]) else { continue };
        if a == b {
            continue;
        }
        let at = match (rows[i - 1][a].time(), rows[i - 1][b].time(), rows[i][a].time(), rows[i][b].time()) {
            (Some(a0), Some(b0), Some(a1), Some(b1)) => {
                let d0 = (a0 / b0).ln();
                let d1 = (a1 / b1).ln();
                let f = if (d0 - d1).abs() > 1e-12 { d0 / (d0 - d1) } else { 0.5 };
                (xs[i - 1].ln() + f.clamp(0.0, 1.0) * (xs[i].ln() - xs[i - 1].ln())).exp()
            }
            _ => (xs[i - 1] * xs[i]).sqrt(),
        };
        out.push(Crossover { lo: xs[i - 1], hi: xs[i], at, from: a, to: b });
    }
    out
}
