//! `shardc sweep`: Castelló et al.'s five-axis analysis — step time of several strategies
//! along batch size, device FLOP/s, memory bandwidth, link bandwidth or device count.

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use passes::cost::{self, Cluster, Named};
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

#[derive(Args, Debug)]
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
    /// Strategies to compare, comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    pub strategies: Vec<String>,
    /// Devices (for axes other than `devices`; default: all of the cluster).
    #[arg(long, value_parser = parse_devices, allow_negative_numbers = true)]
    pub devices: Option<usize>,
    /// Draw the sweep as an SVG line chart.
    #[arg(long)]
    pub svg: Option<PathBuf>,
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
            Axis::Membw => "memory bandwidth (bytes/s)",
            Axis::Linkbw => "link bandwidth (bytes/s per device)",
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

pub fn run(args: &SweepArgs) -> CliResult {
    guard_outputs(&[("--svg", args.svg.as_ref())], &[Some(&args.model)])?;
    let loaded = load_canonical(&args.model, &args.shapes)?;
    let base = load_cluster(&args.cluster)?;
    let opts = args.model_args.options()?;
    let named: Vec<Named> =
        args.strategies.iter().map(|s| Named::parse(s).map_err(CliError::msg)).collect::<CliResult<_>>()?;
    let mut xs = Vec::new();
    let mut rows: Vec<Vec<Cell>> = Vec::new();
    for vs in &args.values {
        let mut cluster: Cluster = base.clone();
        let mut devices = args.devices.unwrap_or(base.devices());
        let mut graph = loaded.model.graph.clone();
        let x = match args.axis {
            Axis::Batch => {
                let b: f64 = parse_value(vs, 1.0).map_err(CliError::msg)?;
                let spec = passes::RebatchSpec { batch: Some(b as i64), ..Default::default() };
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
        let mut row = Vec::new();
        for (s, nm) in args.strategies.iter().zip(&named) {
            row.push(match cost::price(&graph, &cluster, devices, nm, &opts) {
                Ok(p) if p.breakdown.feasible => Cell::Time(p.breakdown.step_time_s),
                Ok(p) => Cell::Infeasible(p.breakdown.step_time_s),
                Err(e) => Cell::NotApplicable(format!("{s}: {e}")),
            });
        }
        xs.push(x);
        rows.push(row);
    }
    // The best strategy at each point; a strategy within 0.5% of the best counts as tied, and a
    // tie keeps the previous point's best (so near-equal strategies do not flap).
    let mut best: Vec<Option<usize>> = Vec::with_capacity(rows.len());
    for r in &rows {
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
    let crossovers = find_crossovers(&xs, &rows, &best);

    if let Some(path) = &args.svg {
        let svg =
            chart(&args.model.display().to_string(), &base.name, args.axis, &xs, &args.strategies, &rows, &crossovers);
        write_output(&svg, Some(path), &args.model)?;
    }
    let axis_name = format!("{:?}", args.axis).to_lowercase();
    if args.json {
        let doc = json!({
            "model": args.model.display().to_string(),
            "cluster": base.name,
            "axis": axis_name,
            "strategies": args.strategies,
            "points": xs.iter().zip(&rows).zip(&best).map(|((x, r), b)| json!({
                "value": x,
                "step_time_s": r.iter().map(|c| match c { Cell::Time(t) => json!(t), _ => json!(null) }).collect::<Vec<_>>(),
                "feasible": r.iter().map(|c| matches!(c, Cell::Time(_))).collect::<Vec<_>>(),
                "best": b.map(|i| args.strategies[i].clone()),
            })).collect::<Vec<_>>(),
            "crossovers": crossovers.iter().map(|c| json!({ "between": [c.lo, c.hi], "at": c.at, "from": args.strategies[c.from], "to": args.strategies[c.to] })).collect::<Vec<_>>(),
        });
        return write_output(&serde_json::to_string_pretty(&doc).expect("JSON"), None, &args.model);
    }
    let mut t = String::new();
    t.push_str(&format!("sweep of {} on {} along {axis_name}\n", args.model.display(), base.name));
    t.push_str(&format!("{:>12}", axis_name));
    for s in &args.strategies {
        t.push_str(&format!(" {s:>14}"));
    }
    t.push_str("   best\n");
    let mut notes = Vec::new();
    for ((x, r), b) in xs.iter().zip(&rows).zip(&best) {
        t.push_str(&format!("{:>12}", fmt_x(*x)));
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
    for c in &crossovers {
        t.push_str(&format!(
            "crossover    {} overtakes {} at {} {axis_name} (between {} and {})\n",
            args.strategies[c.to],
            args.strategies[c.from],
            fmt_x(c.at),
            fmt_x(c.lo),
            fmt_x(c.hi)
        ));
    }
    if crossovers.is_empty() {
        t.push_str("no crossover: the best strategy is the same along the sweep\n");
    }
    for n in notes {
        t.push_str(&format!("n/a          {n}\n"));
    }
    write_output(&t, None, &args.model)
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

/// A log-log line chart: one line per strategy, crossovers as dashed verticals.
fn chart(
    model: &str,
    cluster: &str,
    axis: Axis,
    xs: &[f64],
    names: &[String],
    rows: &[Vec<Cell>],
    crossovers: &[Crossover],
) -> String {
    let (w, h) = (760.0, 460.0);
    let (l, r, t, b) = (80.0, 180.0, 50.0, 60.0);
    let times: Vec<f64> = rows
        .iter()
        .flat_map(|r| {
            r.iter().filter_map(|c| match c {
                Cell::Time(t) | Cell::Infeasible(t) => Some(*t),
                _ => None,
            })
        })
        .filter(|t| *t > 0.0)
        .collect();
    let (tmin, tmax) = times.iter().fold((f64::INFINITY, 0.0f64), |acc, &t| (acc.0.min(t), acc.1.max(t)));
    let (tmin, tmax) = if times.is_empty() { (1e-3, 1.0) } else { (tmin / 1.3, tmax * 1.3) };
    let (xmin, xmax) = (xs.iter().copied().fold(f64::INFINITY, f64::min), xs.iter().copied().fold(0.0, f64::max));
    let logx = xmax / xmin > 8.0;
    let fx = |x: f64| -> f64 {
        if xmax == xmin {
            return l + (w - l - r) / 2.0;
        }
        let u = if logx { (x.ln() - xmin.ln()) / (xmax.ln() - xmin.ln()) } else { (x - xmin) / (xmax - xmin) };
        l + u * (w - l - r)
    };
    let fy = |y: f64| -> f64 { t + (1.0 - (y.ln() - tmin.ln()) / (tmax.ln() - tmin.ln())) * (h - t - b) };
    let colors = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2"];
    let mut s = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    s.push_str(&format!(r#"<rect width="{w}" height="{h}" fill="white"/>"#));
    s.push_str(&format!(
        r#"<text x="{}" y="24" font-size="15" text-anchor="middle">{} on {} — step time vs {}</text>"#,
        (w - r + l) / 2.0,
        esc(model),
        esc(cluster),
        axis.label()
    ));
    s.push_str(&format!(r#"<line x1="{l}" y1="{}" x2="{}" y2="{}" stroke="black"/><line x1="{l}" y1="{t}" x2="{l}" y2="{}" stroke="black"/>"#, h - b, w - r, h - b, h - b));
    // y ticks at powers of ten and their halves
    let mut e = tmin.log10().floor() as i32;
    while 10f64.powi(e) <= tmax {
        for m in [1.0, 2.0, 5.0] {
            let y = m * 10f64.powi(e);
            if y >= tmin && y <= tmax {
                s.push_str(&format!(r##"<line x1="{}" y1="{py}" x2="{l}" y2="{py}" stroke="black"/><line x1="{l}" y1="{py}" x2="{}" y2="{py}" stroke="#eee"/><text x="{}" y="{}" text-anchor="end">{}</text>"##, l - 5.0, w - r, l - 8.0, fy(y) + 4.0, esc(&secs(y)), py = fy(y)));
            }
        }
        e += 1;
    }
    for &x in xs {
        s.push_str(&format!(r#"<line x1="{px}" y1="{}" x2="{px}" y2="{}" stroke="black"/><text x="{px}" y="{}" text-anchor="middle">{}</text>"#, h - b, h - b + 5.0, h - b + 20.0, fmt_x(x), px = fx(x)));
    }
    s.push_str(&format!(
        r#"<text x="{}" y="{}" text-anchor="middle">{}{}</text>"#,
        (w - r + l) / 2.0,
        h - 15.0,
        axis.label(),
        if logx { ", log scale" } else { "" }
    ));
    for c in crossovers {
        let px = fx(c.at);
        s.push_str(&format!(r##"<line x1="{px}" y1="{t}" x2="{px}" y2="{}" stroke="#555" stroke-dasharray="5,4"/><text x="{}" y="{}" fill="#555">crossover {}</text>"##, h - b, px + 4.0, t + 12.0, fmt_x(c.at)));
    }
    for (k, name) in names.iter().enumerate() {
        let color = colors[k % colors.len()];
        let pts: Vec<(f64, f64, bool)> = xs
            .iter()
            .zip(rows)
            .filter_map(|(&x, r)| match &r[k] {
                Cell::Time(t) => Some((fx(x), fy(*t), true)),
                Cell::Infeasible(t) if *t > 0.0 => Some((fx(x), fy(*t), false)),
                _ => None,
            })
            .collect();
        let line: Vec<String> = pts.iter().filter(|p| p.2).map(|p| format!("{:.1},{:.1}", p.0, p.1)).collect();
        if line.len() > 1 {
            s.push_str(&format!(
                r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"/>"#,
                line.join(" ")
            ));
        }
        for (x, y, ok) in &pts {
            if *ok {
                s.push_str(&format!(r#"<circle cx="{x:.1}" cy="{y:.1}" r="3.5" fill="{color}"/>"#));
            } else {
                s.push_str(&format!(
                    r#"<text x="{x:.1}" y="{:.1}" fill="{color}" text-anchor="middle">×</text>"#,
                    y + 4.0
                ));
            }
        }
        let ly = t + 20.0 + 20.0 * k as f64;
        s.push_str(&format!(r#"<line x1="{}" y1="{ly}" x2="{}" y2="{ly}" stroke="{color}" stroke-width="2"/><text x="{}" y="{}">{}</text>"#, w - r + 15.0, w - r + 40.0, w - r + 46.0, ly + 4.0, esc(name)));
    }
    s.push_str(&format!(
        r##"<text x="{}" y="{}" fill="#555">× does not fit in memory</text>"##,
        w - r + 15.0,
        t + 20.0 + 20.0 * names.len() as f64
    ));
    s.push_str("</svg>\n");
    s
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}
