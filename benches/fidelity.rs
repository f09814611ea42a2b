//! Prices against real clusters: published measured step times of large-model training,
//! each configuration priced by the cost model through the configuration grammar (the same
//! path as `shardc cost --strategy`), side by side with the measurement. No constant of the
//! cost model is fitted to these rows; they only check it.
//!
//! Run with `cargo bench --bench fidelity`. Per row: the model, cluster and configuration,
//! the measured and the predicted step, and the error; then the mean absolute and the largest
//! error over all rows.
//!
//! Rows: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
//! Models" (arXiv 2205.05198), Megatron-LM on DGX A100-80GB (Selene), fp16, sequence 2048,
//! the iteration times of their Table of end-to-end results: GPT 22B (TP 8, batch 4,
//! micro-batch 4), 175B (TP 8 × PP 8 interleaved 3, batch 64), 530B (TP 8 × PP 35
//! interleaved 3, batch 280) and 1T (TP 8 × PP 64, batch 512), micro-batch 1 for the
//! pipelines, each with full recomputation (no sequence parallelism) and with selective
//! recomputation and sequence parallelism. (The same rows Calculon, an analytical model like
//! this one, validates against.) The synthetic GPT has no embedding or output layer; the
//! measured runs do (a vocabulary of 51,200: about 1–4% of the work at these sizes).

use std::time::Instant;

use shardc::passes::cost::{self, Cluster, Options, Precision, config::Config};
use shardc::synthetic::Gpt;

/// A measured model: a Megatron GPT at sequence 2048 on a cluster.
struct Model {
    name: &'static str,
    layers: usize,
    hidden: usize,
    heads: usize,
    batch: usize,
    cluster: &'static str,
    devices: usize,
}

const GPT_22B: Model =
    Model { name: "GPT 22B", layers: 48, hidden: 6144, heads: 64, batch: 4, cluster: "dgx-a100", devices: 8 };
const GPT_175B: Model =
    Model { name: "GPT 175B", layers: 96, hidden: 12288, heads: 96, batch: 64, cluster: "a100-cluster-8", devices: 64 };
const GPT_530B: Model = Model {
    name: "GPT 530B",
    layers: 105,
    hidden: 20480,
    heads: 128,
    batch: 280,
    cluster: "a100-cluster-35",
    devices: 280,
};
const GPT_1T: Model = Model {
    name: "GPT 1T",
    layers: 128,
    hidden: 25600,
    heads: 160,
    batch: 512,
    cluster: "a100-cluster-64",
    devices: 512,
};

/// A measured run: the model, its configuration and the seconds per iteration measured.
struct Row {
    model: &'static Model,
    config: &'static str,
    measured: f64,
}

const ROWS: &[Row] = &[
    Row { model: &GPT_22B, config: "tp=8,mbs=4,recompute=full", measured: 1.42 },
    Row { model: &GPT_22B, config: "tp=8,mbs=4,recompute=selective,sp", measured: 1.10 },
    Row { model: &GPT_175B, config: "tp=8,pp=8,vp=3,mbs=1,recompute=full", measured: 18.13 },
    Row { model: &GPT_175B, config: "tp=8,pp=8,vp=3,mbs=1,recompute=selective,sp", measured: 13.75 },
    Row { model: &GPT_530B, config: "tp=8,pp=35,vp=3,mbs=1,recompute=full", measured: 49.05 },
    Row { model: &GPT_530B, config: "tp=8,pp=35,vp=3,mbs=1,recompute=selective,sp", measured: 37.83 },
    Row { model: &GPT_1T, config: "tp=8,pp=64,mbs=1,recompute=full", measured: 94.42 },
    Row { model: &GPT_1T, config: "tp=8,pp=64,mbs=1,recompute=selective,sp", measured: 71.49 },
];

/// The model, shapes inferred and canonicalized as `shardc cost` prepares it.
fn prepare(text: &str) -> shardc::ir::Model {
    let mut m = shardc::frontend::parse(text).expect("parses").model;
    let mut pm = shardc::passes::PassManager::new();
    pm.add(shardc::passes::InferShapes::default()).add(shardc::passes::Canonicalize).add(shardc::passes::Algebra);
    pm.run(&mut m).expect("passes run");
    m
}

/// The predicted step of `row`'s configuration, seconds, and whether it fits.
fn predicted(row: &Row, g: &shardc::ir::Graph) -> Result<(f64, bool), String> {
    let cluster = Cluster::load(row.model.cluster).map_err(|e| e.to_string())?;
    let opts = Options { precision: Precision::Fp16, ..Options::default() };
    let cfg = Config::parse(row.config)?;
    let mut rewritten = g.clone();
    cfg.rewrite(&mut rewritten)?;
    let (named, o) = cfg.resolve(row.model.devices, cost::pipeline::graph_batch(&rewritten), &opts)?;
    let priced = cost::price(&rewritten, &cluster, row.model.devices, &named, &o)?;
    Ok((priced.breakdown.step_time_s, priced.breakdown.feasible))
}

fn main() {
    let mut errors = Vec::new();
    // Rows of one model share its graph.
    let mut last: Option<(&str, shardc::ir::Model)> = None;
    println!("model | cluster | configuration | measured s | predicted s | error");
    for row in ROWS {
        let (t0, m) = (Instant::now(), row.model);
        if last.as_ref().is_none_or(|(name, _)| *name != m.name) {
            let gpt =
                Gpt { layers: m.layers, hidden: m.hidden, heads: m.heads, batch: m.batch, seq: 2048, fused_gelu: true };
            last = Some((m.name, prepare(&gpt.to_text())));
        }
        let g = &last.as_ref().expect("prepared").1.graph;
        match predicted(row, g) {
            Ok((step, fits)) => {
                let err = step / row.measured - 1.0;
                errors.push(err);
                println!(
                    "{} | {} × {} | {} | {:.2} | {:.2}{} | {:+.1}% ({:.1} s)",
                    m.name,
                    m.devices,
                    m.cluster,
                    row.config,
                    row.measured,
                    step,
                    if fits { "" } else { " (does not fit)" },
                    100.0 * err,
                    t0.elapsed().as_secs_f64()
                );
            }
            Err(e) => println!("{} | {} | {} | {:.2} | not priced: {e}", m.name, m.cluster, row.config, row.measured),
        }
    }
    if !errors.is_empty() {
        let mean = errors.iter().map(|e| e.abs()).sum::<f64>() / errors.len() as f64;
        let max = errors.iter().map(|e| e.abs()).fold(0.0, f64::max);
        println!("mean absolute error {:.1}%, largest {:.1}% over {} rows", 100.0 * mean, 100.0 * max, errors.len());
    }
}
