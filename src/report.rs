//! A plan as pictures: the pipeline (or step) timeline, the model graph coloured by strategy,
//! memory per device against capacity, communication per block, the sweep's lines, and one
//! self-contained HTML page holding them (no network needed to view it). Charts are drawn
//! with `plotters` into inline SVG.

use std::collections::HashMap;

use ir::{Graph, NodeId};
use passes::autoshard::Plan;
use passes::autoshard::explain::Explanation;
use passes::cost::Breakdown;
use plotters::prelude::*;

type DrawResult<T = ()> = Result<T, String>;

fn err<E: std::fmt::Debug>(e: E) -> String {
    format!("drawing failed: {e:?}")
}

/// Seconds as a short human string (`12.3 ms`, `45.6 µs`).
pub fn secs(x: f64) -> String {
    let a = x.abs();
    if a == 0.0 {
        "0".into()
    } else if a >= 1.0 {
        format!("{x:.3} s")
    } else if a >= 1e-3 {
        format!("{:.3} ms", x * 1e3)
    } else {
        format!("{:.1} µs", x * 1e6)
    }
}

/// Bytes in binary units (`1.25 GiB`).
pub fn bytes(x: f64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let (mut v, mut u) = (x.abs(), 0);
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    let v = v.copysign(x);
    if u == 0 { format!("{v:.0} {}", units[u]) } else { format!("{v:.2} {}", units[u]) }
}

/// A rate in SI units with its unit (`24 GB/s`, `19.5 TFLOP/s`).
pub fn si(x: f64, unit: &str) -> String {
    let prefixes = [(1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")];
    for (scale, p) in prefixes {
        if x.abs() >= scale {
            let v = x / scale;
            let digits = if v >= 100.0 || v.fract() == 0.0 {
                0
            } else if v >= 10.0 {
                1
            } else {
                2
            };
            return format!("{v:.digits$} {p}{unit}");
        }
    }
    format!("{x} {unit}")
}

/// Text safe inside HTML or SVG.
pub fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

const FORWARD: RGBColor = RGBColor(0x9c, 0xc3, 0xef);
const BACKWARD: RGBColor = RGBColor(0x2f, 0x6d, 0xb5);
const SYNC: RGBColor = RGBColor(0xe4, 0x8a, 0x3c);
const UPDATE: RGBColor = RGBColor(0x5a, 0xa0, 0x5a);
const GREY: RGBColor = RGBColor(0xbb, 0xbb, 0xbb);

fn palette(i: usize) -> RGBColor {
    let (r, g, b) = Palette99::COLORS[i % Palette99::COLORS.len()];
    RGBColor(r, g, b)
}

/// The legend box of a chart, at `at`.
fn legend<'a, DB: DrawingBackend + 'a, CT: plotters::coord::CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
    at: SeriesLabelPosition,
) -> DrawResult {
    chart
        .configure_series_labels()
        .position(at)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(font(12))
        .draw()
        .map_err(err)
}

/// The label of a horizontal-bar chart's tick at `y`: row `i` (from the top of `n` rows) is
/// drawn between `n − i − 1` and `n − i`, and labelled at its middle; other ticks are blank.
fn row_label(labels: &[String], n: f64, y: f64) -> String {
    let i = (n - y - 0.5).round();
    if (n - y - 0.5 - i).abs() < 1e-6 && i >= 0.0 && y >= 0.0 {
        labels.get(i as usize).cloned().unwrap_or_default()
    } else {
        String::new()
    }
}

fn font(size: u32) -> TextStyle<'static> {
    ("sans-serif", size).into_font().into()
}

/// The plan's step as a timeline. A pipeline: one row per stage, each micro-batch's forward
/// and backward where the schedule puts it (white is the bubble; the legend says when
/// backward includes recomputation). Without pipelining: the step's phases in order
/// (forward, backward, gradient synchronisation not hidden, update) on the row of all devices.
pub fn timeline_svg(plan: &Plan) -> String {
    draw_timeline(plan).unwrap_or_else(|e| {
        format!("<svg xmlns=\"http://www.w3.org/2000/svg\"><text y=\"20\">{}</text></svg>\n", esc(&e))
    })
}

/// A timeline row: its label and its blocks (start, end seconds; series index).
type TimelineRow = (String, Vec<(f64, f64, usize)>);

fn draw_timeline(plan: &Plan) -> DrawResult<String> {
    let pipelined = plan.stages.len() > 1 || plan.micro_batches > 1;
    let b = &plan.breakdown;
    let field = |k: &str| b.get(k).and_then(|v| v.as_f64()).unwrap_or(0.0);
    // Rows of (label, [(start, end, colour, series)]).
    let mut rows: Vec<TimelineRow> = Vec::new();
    let series: [(&str, RGBColor); 4] = [
        (if plan.stages.iter().any(|s| s.recompute) { "backward (with recomputation)" } else { "backward" }, BACKWARD),
        ("forward", FORWARD),
        ("gradient sync (exposed)", SYNC),
        ("optimizer update", UPDATE),
    ];
    let title;
    let span;
    if pipelined {
        let (blocks, s) = passes::autoshard::plan::timeline(plan);
        span = s;
        for (st, stage) in plan.stages.iter().enumerate() {
            let devs = match (stage.devices.first(), stage.devices.last()) {
                (Some(a), Some(z)) if a != z => format!("devices {a}–{z}"),
                (Some(a), _) => format!("device {a}"),
                _ => String::new(),
            };
            let mut cells = Vec::new();
            for blk in blocks.iter().filter(|x| x.stage == st) {
                cells.push((blk.start_s, blk.end_s, if blk.backward { 0 } else { 1 }));
            }
            rows.push((format!("stage {st} ({devs})"), cells));
        }
        title = format!(
            "{} stages × {} micro-batches ({}), {} per step before synchronisation; white = bubble",
            plan.stages.len(),
            plan.micro_batches,
            plan.schedule.map_or("-".into(), |s| s.name()),
            secs(span)
        );
    } else {
        let phases = [
            (field("forward_s"), 1),
            (field("backward_s"), 0),
            (field("exposed_gradient_sync_s"), 2),
            (field("update_s"), 3),
        ];
        let mut t = 0.0;
        let mut cells = Vec::new();
        for (d, k) in phases {
            if d > 0.0 {
                cells.push((t, t + d, k));
                t += d;
            }
        }
        span = t;
        rows.push((format!("all {} devices", plan.devices), cells));
        title = format!(
            "no pipeline: every device runs the whole step, {} (forward, backward, exposed sync, update)",
            secs(span)
        );
    }
    let span_ms = (span * 1e3).max(1e-9);
    let height = 150 + 46 * rows.len() as u32;
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (1100, height)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let n = rows.len() as f64;
        let mut chart = ChartBuilder::on(&root)
            .caption(&title, font(14))
            .margin(12)
            .x_label_area_size(34)
            .y_label_area_size(150)
            .build_cartesian_2d(0f64..span_ms, -1.2f64..n)
            .map_err(err)?;
        let labels: Vec<String> = rows.iter().map(|r| r.0.clone()).collect();
        chart
            .configure_mesh()
            .disable_y_mesh()
            .max_light_lines(2)
            .x_desc("milliseconds")
            .y_labels(rows.len() * 2 + 3)
            .y_label_formatter(&|y| row_label(&labels, n, *y))
            .draw()
            .map_err(err)?;
        for (k, (name, colour)) in series.iter().enumerate() {
            let rects: Vec<Rectangle<(f64, f64)>> = rows
                .iter()
                .enumerate()
                .flat_map(|(r, (_, cells))| {
                    let y = n - r as f64;
                    cells.iter().filter(|c| c.2 == k).map(move |&(a, e, _)| {
                        Rectangle::new([(a * 1e3, y - 0.15), (e * 1e3, y - 0.85)], colour.filled())
                    })
                })
                .collect();
            if rects.is_empty() {
                continue;
            }
            let c = *colour;
            chart
                .draw_series(rects)
                .map_err(err)?
                .label(*name)
                .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], c.filled()));
        }
        legend(&mut chart, SeriesLabelPosition::LowerLeft)?;
        root.present().map_err(err)?;
    }
    Ok(out)
}

/// Colours for the strategies of a plan: the most common get their own, the rest grey.
fn strategy_colours(strategies: &[String]) -> (HashMap<String, RGBColor>, Vec<(String, RGBColor)>) {
    let mut count: HashMap<&str, usize> = HashMap::new();
    for s in strategies {
        *count.entry(s).or_insert(0) += 1;
    }
    let mut by: Vec<(&str, usize)> = count.into_iter().collect();
    by.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    let mut map = HashMap::new();
    let mut legend = Vec::new();
    for (i, (s, _)) in by.iter().enumerate() {
        let c = if i < 10 { palette(i) } else { GREY };
        map.insert(s.to_string(), c);
        if i < 10 {
            legend.push((s.to_string(), c));
        }
    }
    if by.len() > 10 {
        legend.push((format!("{} other strategies", by.len() - 10), GREY));
    }
    (map, legend)
}

/// The model as a layered graph (left to right by depth), each op a box coloured by its
/// strategy, edges between them; a legend of strategies underneath.
pub fn graph_svg(g: &Graph, order: &[NodeId], strategies: &[String]) -> DrawResult<String> {
    let index: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let mut level = vec![0usize; order.len()];
    for (i, &n) in order.iter().enumerate() {
        level[i] = g
            .node(n)
            .inputs()
            .iter()
            .flatten()
            .filter_map(|v| index.get(&v.node))
            .map(|&j| level[j] + 1)
            .max()
            .unwrap_or(0);
    }
    let levels = level.iter().copied().max().map_or(0, |m| m + 1);
    let mut slot = vec![0usize; order.len()];
    let mut used = vec![0usize; levels];
    for i in 0..order.len() {
        slot[i] = used[level[i]];
        used[level[i]] += 1;
    }
    let slots = used.iter().copied().max().unwrap_or(1).max(1);
    let (dx, dy, bw, bh, left, top) = (16i32, 22i32, 11i32, 14i32, 10i32, 30i32);
    let (colours, legend) = strategy_colours(strategies);
    let legend_rows = legend.len().div_ceil(3) as i32;
    let width = (left * 2 + dx * levels as i32).max(900);
    let height = top + dy * slots as i32 + 30 + 18 * legend_rows;
    let pos = |i: usize| (left + dx * level[i] as i32, top + dy * slot[i] as i32);
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (width as u32, height as u32)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        root.draw(&Text::new(
            format!("{} ops by depth (left to right), coloured by strategy", order.len()),
            (left, 8),
            font(13),
        ))
        .map_err(err)?;
        for (i, &n) in order.iter().enumerate() {
            let (x1, y1) = pos(i);
            for v in g.node(n).inputs().iter().flatten() {
                if let Some(&j) = index.get(&v.node) {
                    let (x0, y0) = pos(j);
                    root.draw(&PathElement::new(
                        vec![(x0 + bw, y0 + bh / 2), (x1, y1 + bh / 2)],
                        GREY.mix(0.6).stroke_width(1),
                    ))
                    .map_err(err)?;
                }
            }
        }
        for (i, s) in strategies.iter().enumerate().take(order.len()) {
            let (x, y) = pos(i);
            let c = colours.get(s).copied().unwrap_or(GREY);
            root.draw(&Rectangle::new([(x, y), (x + bw, y + bh)], c.filled())).map_err(err)?;
        }
        let ly = top + dy * slots as i32 + 14;
        for (k, (s, c)) in legend.iter().enumerate() {
            let (x, y) = (left + 300 * (k as i32 % 3), ly + 18 * (k as i32 / 3));
            root.draw(&Rectangle::new([(x, y), (x + 12, y + 12)], c.filled())).map_err(err)?;
            let label: String = s.chars().take(40).collect();
            root.draw(&Text::new(label, (x + 18, y), font(12))).map_err(err)?;
        }
        root.present().map_err(err)?;
    }
    Ok(out)
}

/// Memory per device (bars) against the usable capacity (dashed line).
pub fn memory_svg(per_device: &[u64], capacity: u64) -> DrawResult<String> {
    let gib = |b: f64| b / (1u64 << 30) as f64;
    let n = per_device.len().max(1);
    let top = per_device.iter().copied().max().unwrap_or(0).max(capacity) as f64 * 1.1;
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (900, 360)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption("memory per device against usable capacity", font(14))
            .margin(12)
            .x_label_area_size(34)
            .y_label_area_size(60)
            .build_cartesian_2d(-0.5f64..n as f64 - 0.5, 0f64..gib(top).max(1e-6))
            .map_err(err)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .max_light_lines(2)
            .x_desc("device")
            .y_desc("GiB")
            .x_labels(n.min(16))
            .x_label_formatter(&|x| if (x - x.round()).abs() < 1e-6 { format!("{}", x.round()) } else { String::new() })
            .draw()
            .map_err(err)?;
        chart
            .draw_series(per_device.iter().enumerate().map(|(d, &b)| {
                let c = if b > capacity { RED } else { BACKWARD };
                Rectangle::new([(d as f64 - 0.35, 0.0), (d as f64 + 0.35, gib(b as f64))], c.filled())
            }))
            .map_err(err)?
            .label("predicted memory")
            .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], BACKWARD.filled()));
        // Each bar's amount above it (a bar far below the capacity line is a thin sliver).
        chart
            .draw_series(
                per_device.iter().enumerate().map(|(d, &b)| {
                    Text::new(bytes(b as f64), (d as f64 - 0.3, gib(b as f64) + gib(top) * 0.03), font(11))
                }),
            )
            .map_err(err)?;
        chart
            .draw_series(DashedLineSeries::new(
                vec![(-0.5, gib(capacity as f64)), (n as f64 - 0.5, gib(capacity as f64))],
                8,
                5,
                RED.stroke_width(2),
            ))
            .map_err(err)?
            .label(format!("usable capacity {}", bytes(capacity as f64)))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 14, y)], RED.stroke_width(2)));
        legend(&mut chart, SeriesLabelPosition::UpperRight)?;
        root.present().map_err(err)?;
    }
    Ok(out)
}

/// Communication per block: the plan's and data parallelism's side by side (microseconds).
pub fn communication_svg(blocks: &[(String, f64, Option<f64>)]) -> DrawResult<String> {
    let n = blocks.len().max(1);
    let max = blocks.iter().map(|b| b.1.max(b.2.unwrap_or(0.0))).fold(0.0, f64::max).max(1e-9) * 1e6 * 1.1;
    let height = 90 + 22 * n as u32;
    let labels: Vec<String> = blocks.iter().map(|b| b.0.chars().take(36).collect()).collect();
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (900, height)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let nf = n as f64;
        let mut chart = ChartBuilder::on(&root)
            .caption("communication per block (forward, backward and gradient sync, before overlap)", font(14))
            .margin(12)
            .x_label_area_size(34)
            .y_label_area_size(230)
            .build_cartesian_2d(0f64..max, 0f64..nf)
            .map_err(err)?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .max_light_lines(2)
            .x_desc("µs per step")
            .y_labels(n * 2 + 1)
            .y_label_formatter(&|y| row_label(&labels, nf, *y))
            .draw()
            .map_err(err)?;
        chart
            .draw_series(blocks.iter().enumerate().map(|(i, b)| {
                let y = nf - i as f64;
                Rectangle::new([(0.0, y - 0.12), (b.1 * 1e6, y - 0.48)], BACKWARD.filled())
            }))
            .map_err(err)?
            .label("this plan")
            .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], BACKWARD.filled()));
        if blocks.iter().any(|b| b.2.is_some()) {
            chart
                .draw_series(blocks.iter().enumerate().filter_map(|(i, b)| {
                    let y = nf - i as f64;
                    b.2.map(|d| Rectangle::new([(0.0, y - 0.52), (d * 1e6, y - 0.88)], SYNC.filled()))
                }))
                .map_err(err)?
                .label("data parallelism")
                .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], SYNC.filled()));
        }
        legend(&mut chart, SeriesLabelPosition::LowerRight)?;
        root.present().map_err(err)?;
    }
    Ok(out)
}

/// One line of a sweep chart: a strategy's step time at each x (`None`: not applicable),
/// with whether it fits.
pub struct SweepLine {
    /// The strategy.
    pub name: String,
    /// Per x: (step time, fits).
    pub points: Vec<Option<(f64, bool)>>,
}

/// The sweep as a log-log line chart: one line per strategy (a strategy whose times equal an
/// earlier one's is drawn dashed and said to coincide), points that do not fit as crosses
/// (and their legend only when there is one), crossovers as dashed verticals. `x_fmt`
/// labels the axis values in their unit.
pub fn sweep_svg(
    title: &str,
    x_desc: &str,
    xs: &[f64],
    lines: &[SweepLine],
    crossovers: &[f64],
    x_fmt: &dyn Fn(f64) -> String,
) -> DrawResult<String> {
    let times: Vec<f64> =
        lines.iter().flat_map(|l| l.points.iter().flatten().map(|p| p.0)).filter(|t| *t > 0.0).collect();
    let (tmin, tmax) = times.iter().fold((f64::INFINITY, 0.0f64), |a, &t| (a.0.min(t), a.1.max(t)));
    let (tmin, tmax) = if times.is_empty() { (1e-3, 1.0) } else { (tmin / 1.3, tmax * 1.3) };
    let (xmin, xmax) = xs.iter().fold((f64::INFINITY, 0.0f64), |a, &x| (a.0.min(x), a.1.max(x)));
    let (xmin, xmax) = if xmin >= xmax { (xmin / 2.0, xmax * 2.0) } else { (xmin / 1.15, xmax * 1.15) };
    let any_infeasible = lines.iter().any(|l| l.points.iter().flatten().any(|p| !p.1));
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (860, 480)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, font(15))
            .margin(14)
            .x_label_area_size(40)
            .y_label_area_size(80)
            .build_cartesian_2d((xmin..xmax).log_scale(), (tmin * 1e3..tmax * 1e3).log_scale())
            .map_err(err)?;
        chart
            .configure_mesh()
            .max_light_lines(2)
            .x_desc(format!("{x_desc} (log scale)"))
            .y_desc("step time (ms)")
            .x_label_formatter(&|x| x_fmt(*x))
            .draw()
            .map_err(err)?;
        for &c in crossovers {
            chart
                .draw_series(DashedLineSeries::new(
                    vec![(c, tmin * 1e3), (c, tmax * 1e3)],
                    6,
                    4,
                    RGBColor(0x55, 0x55, 0x55).stroke_width(1),
                ))
                .map_err(err)?;
        }
        for (k, l) in lines.iter().enumerate() {
            let colour = palette(k);
            let pts: Vec<(f64, f64)> =
                xs.iter().zip(&l.points).filter_map(|(&x, p)| p.filter(|p| p.1).map(|p| (x, p.0 * 1e3))).collect();
            let same_as = lines[..k].iter().position(|e| {
                e.points.len() == l.points.len()
                    && e.points.iter().zip(&l.points).all(|(a, b)| match (a, b) {
                        (Some(a), Some(b)) => (a.0 - b.0).abs() <= 1e-9 * a.0.abs().max(1e-30) && a.1 == b.1,
                        (None, None) => true,
                        _ => false,
                    })
            });
            let label = match same_as {
                Some(j) => format!("{} (same as {})", l.name, lines[j].name),
                None => l.name.clone(),
            };
            let style = colour.stroke_width(if same_as.is_some() { 2 } else { 3 });
            if same_as.is_some() {
                chart.draw_series(DashedLineSeries::new(pts.clone(), 7, 7, style)).map_err(err)?
            } else {
                chart.draw_series(LineSeries::new(pts.clone(), style)).map_err(err)?
            }
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], colour.stroke_width(3)));
            chart
                .draw_series(
                    pts.iter().map(|&(x, y)| {
                        Circle::new((x, y), if same_as.is_some() { 6 } else { 3 }, colour.stroke_width(2))
                    }),
                )
                .map_err(err)?;
            let bad: Vec<(f64, f64)> =
                xs.iter().zip(&l.points).filter_map(|(&x, p)| p.filter(|p| !p.1).map(|p| (x, p.0 * 1e3))).collect();
            chart
                .draw_series(bad.into_iter().map(|(x, y)| Cross::new((x, y), 5, colour.stroke_width(2))))
                .map_err(err)?;
        }
        if any_infeasible {
            chart
                .draw_series(std::iter::empty::<Cross<(f64, f64), i32>>())
                .map_err(err)?
                .label("× does not fit in memory")
                .legend(|(x, y)| Cross::new((x + 6, y), 5, BLACK.stroke_width(2)));
        }
        legend(&mut chart, SeriesLabelPosition::UpperRight)?;
        root.present().map_err(err)?;
    }
    Ok(out)
}

/// A self-contained HTML page: `title`, then each section's heading and HTML body. An inline
/// script records script errors and, once loaded, how many charts the page holds
/// (`data-charts` and `data-errors` on `<body>`), which the browser test reads.
pub fn page(title: &str, sections: &[(String, String)]) -> String {
    let mut h = String::new();
    h.push_str("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n");
    h.push_str(&format!("<title>{}</title>\n", esc(title)));
    h.push_str(
        "<style>body{font-family:sans-serif;margin:24px;color:#222;max-width:1200px}\
         h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ccc}\
         pre{background:#f6f6f6;padding:10px;overflow-x:auto}\
         .chart{overflow-x:auto;border:1px solid #eee;margin:6px 0}\
         table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}\
         td.n{text-align:right;font-variant-numeric:tabular-nums}</style>\n",
    );
    h.push_str(
        "<script>window.__errors=[];window.addEventListener('error',function(e){window.__errors.push(String(e.message))});\
         window.addEventListener('load',function(){document.body.setAttribute('data-charts',document.querySelectorAll('svg').length);\
         document.body.setAttribute('data-errors',window.__errors.length);});</script>\n",
    );
    h.push_str("</head><body>\n");
    h.push_str(&format!("<h1>{}</h1>\n", esc(title)));
    for (heading, body) in sections {
        h.push_str(&format!("<h2>{}</h2>\n{body}\n", esc(heading)));
    }
    h.push_str("</body></html>\n");
    h
}

fn chart_div(svg: DrawResult<String>) -> String {
    match svg {
        Ok(s) => format!("<div class=\"chart\">{s}</div>"),
        Err(e) => format!("<p>{}</p>", esc(&e)),
    }
}

fn html_table(head: &[&str], rows: &[Vec<String>], numeric: &[bool]) -> String {
    let mut t = String::from("<table><tr>");
    for h in head {
        t.push_str(&format!("<th>{}</th>", esc(h)));
    }
    t.push_str("</tr>\n");
    for r in rows {
        t.push_str("<tr>");
        for (i, c) in r.iter().enumerate() {
            let class = if numeric.get(i).copied().unwrap_or(false) { " class=\"n\"" } else { "" };
            t.push_str(&format!("<td{class}>{}</td>", esc(c)));
        }
        t.push_str("</tr>\n");
    }
    t.push_str("</table>");
    t
}

/// What the plan page shows.
pub struct PlanPage<'a> {
    /// The model, shapes inferred.
    pub graph: &'a Graph,
    /// The cost model's op order (the breakdowns' rows follow it).
    pub order: &'a [NodeId],
    /// The plan document.
    pub plan: &'a Plan,
    /// Its price, per op.
    pub breakdown: &'a Breakdown,
    /// Data parallelism's, when it applies.
    pub data_parallel: Option<&'a Breakdown>,
    /// The summary printed at the top of `plan`.
    pub summary: &'a str,
    /// `--explain`'s layers, when the plan is priced op by op against data parallelism.
    pub explanation: Option<&'a Explanation>,
    /// Per op of `order`, what it does in the summary's terms (`data 2 × tensor 4`,
    /// `replicated`): the graph's colours; `None` colours by each op's strategy.
    pub kinds: Option<Vec<String>>,
}

/// The plan as one HTML page: summary, the graph coloured by strategy, memory per device,
/// communication per block, the timeline, the explanation.
pub fn plan_html(p: &PlanPage<'_>) -> String {
    let mut sections = vec![("summary".to_string(), format!("<pre>{}</pre>", esc(p.summary)))];
    // The per-op charts need rows that are the order's ops (a pipeline's breakdown prices
    // stages).
    let aligned = p.breakdown.ops.len() == p.order.len()
        && p.order.iter().zip(&p.breakdown.ops).all(|(&n, r)| {
            let node = p.graph.node(n);
            node.label.as_deref().or(node.outputs().first().map(|o| o.name.as_str())) == Some(r.name.as_str())
        });
    if aligned {
        let strategies: Vec<String> = match &p.kinds {
            Some(k) if k.len() == p.order.len() => k.clone(),
            _ => p.breakdown.ops.iter().map(|r| format!("{} {}", r.op, r.strategy)).collect(),
        };
        sections.push(("the model, coloured by strategy".into(), chart_div(graph_svg(p.graph, p.order, &strategies))));
    }
    // Memory per device: each stage's on its devices when the plan pipelines.
    let mut per_device = p.breakdown.memory_per_device_bytes.clone();
    if p.plan.stages.len() > 1 {
        per_device = vec![0; p.plan.devices];
        for st in &p.plan.stages {
            for &d in &st.devices {
                if let Some(x) = per_device.get_mut(d) {
                    *x = st.memory_bytes;
                }
            }
        }
    }
    sections.push(("memory".into(), chart_div(memory_svg(&per_device, p.breakdown.memory_capacity_bytes))));
    if aligned {
        let paths = ir::scope::module_paths(p.graph, p.order);
        let dp = p.data_parallel.filter(|d| d.ops.len() == p.breakdown.ops.len());
        let mut blocks: Vec<(String, f64, Option<f64>)> = Vec::new();
        for (i, r) in p.breakdown.ops.iter().enumerate() {
            let block = paths.get(&p.order[i]).map(|x| ir::scope::block_of(x)).filter(|b| !b.is_empty());
            let block = block.unwrap_or_else(|| "(unnamed)".into());
            let c = r.communication_s + r.grad_sync_s;
            let d = dp.map(|d| d.ops[i].communication_s + d.ops[i].grad_sync_s);
            match blocks.iter_mut().find(|b| b.0 == block) {
                Some(b) => {
                    b.1 += c;
                    b.2 = b.2.zip(d).map(|(x, y)| x + y);
                }
                None => blocks.push((block, c, d)),
            }
        }
        blocks.retain(|b| b.1 > 0.0 || b.2.is_some_and(|d| d > 0.0));
        if blocks.len() > 30 {
            // The 30 blocks that communicate most, in model order.
            let mut by: Vec<usize> = (0..blocks.len()).collect();
            by.sort_by(|&a, &b| {
                let m = |i: usize| blocks[i].1.max(blocks[i].2.unwrap_or(0.0));
                m(b).total_cmp(&m(a))
            });
            let keep: std::collections::HashSet<usize> = by.into_iter().take(30).collect();
            blocks = blocks.into_iter().enumerate().filter(|(i, _)| keep.contains(i)).map(|(_, b)| b).collect();
        }
        sections.push(("communication per block".into(), chart_div(communication_svg(&blocks))));
    }
    sections.push(("timeline".into(), chart_div(draw_timeline(p.plan))));
    if let Some(e) = p.explanation {
        let rows: Vec<Vec<String>> = e
            .layers
            .iter()
            .take(30)
            .map(|l| {
                vec![
                    if l.repeats > 1 { format!("{} (×{})", l.layer, l.repeats) } else { l.layer.clone() },
                    secs(l.time_saved_s),
                    secs(l.communication_saved_s),
                    bytes(l.memory_saved_bytes),
                    l.strategies.join(", "),
                    l.data_parallel.join(", "),
                ]
            })
            .collect();
        let mut body = format!(
            "<p>{} layers differ from data parallelism ({} ops alike); per step the plan saves {} ({} not attributable to single ops: overlap, bubble) and {} of memory per device.</p>",
            e.layers.len(),
            e.same_ops,
            secs(e.step_time_saved_s),
            secs(e.unattributed_s),
            bytes(e.memory_saved_bytes)
        );
        body.push_str(&html_table(
            &["layer", "time saved", "of it communication", "memory saved", "plan", "data parallelism"],
            &rows,
            &[false, true, true, true, false, false],
        ));
        sections.push(("why this plan: where it differs from data parallelism".into(), body));
    }
    if let Some(pl) = &p.plan.pipeline {
        sections.push(("why a pipeline".into(), format!("<p>{}</p>", esc(&pl.reason))));
    }
    page(&format!("shardc plan: {} on {} devices of {}", p.plan.model.path, p.plan.devices, p.plan.cluster), &sections)
}
