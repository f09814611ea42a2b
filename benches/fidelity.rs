//! Prices against real clusters: published measured training throughput of large language
//! models, each configuration priced by the cost model through the configuration grammar (the
//! same path as `shardc cost --strategy`), side by side with the measurement. No constant of
//! the cost model is fitted to these rows; they only check it.
//!
//! Run with `cargo bench --bench fidelity`. Per row: the model, cluster and configuration,
//! the measured and the predicted seconds per iteration, and the error; then the mean
//! absolute percentage error (MAPE) per source and over all rows, the largest error, and for
//! each model a source measured in several configurations, whether the prices order them as
//! the measurements do (Spearman's ρ).
//!
//! The sources, each with what it publishes and what the rows assume where it is silent:
//! - **Korthikanti et al. 2022**, "Reducing Activation Recomputation in Large Transformer
//!   Models" (arXiv 2205.05198), Table 5 (the rows Calculon validates against): Megatron-LM
//!   on DGX A100-80GB (Selene), fp16, sequence 2048, vocabulary 51,200; measured seconds per
//!   iteration of GPT 22B (TP 8, batch 4, micro-batch 4), 175B (TP 8 × PP 8 interleaved 3,
//!   batch 64), 530B (TP 8 × PP 35 interleaved 3, batch 280) and 1T (TP 8 × PP 64, batch
//!   512), micro-batch 1 in the pipelines, each with full recomputation and with selective
//!   recomputation and sequence parallelism; data parallelism 1.
//! - **Narayanan et al. 2021**, "Efficient Large-Scale Language Model Training on GPU
//!   Clusters Using Megatron-LM" (SC'21, arXiv 2104.04473), Table 1 (also the Megatron-LM
//!   README of April 2021): GPT 1.7B–1T on 32–3,072 A100-80GB (Selene), fp16, sequence 2048,
//!   vocabulary 51,200, achieved teraFLOP/s per GPU, converted to seconds per iteration with
//!   the paper's own count, `96·B·s·l·h²·(1 + s/6h + V/16lh)` (full recomputation counted).
//!   Not published per row, assumed for all: full recomputation (the count includes it),
//!   micro-batch 1, the non-interleaved 1F1B schedule, and the data-parallel all-reduce after
//!   the backward pass, not overlapped with it (Megatron-LM's local DDP of 2021).
//! - **Megatron-Core r0.8.0 weak scaling** (the Megatron-LM README's model table, 2024): GPT
//!   1.7B–462B on 48–6,144 H100 SXM, bf16, sequence 4,096, vocabulary 131,072, data parallel
//!   48, achieved teraFLOP/s per GPU, converted with Megatron-Core r0.8.0's own count
//!   (`num_floating_point_operations`: `72·B·s·L·h²·(1 + s/6h + V/12Lh)` for these models).
//!   The README names the distributed optimizer with gradient reduce-scatter and parameter
//!   all-gather overlapped, and tensor-parallel communication overlap (which needs sequence
//!   parallelism): ZeRO-1, overlap, and `sp,tp_overlap` where TP > 1. Assumed for all rows: fused
//!   (flash) attention, no recomputation, micro-batch 1, the non-interleaved 1F1B schedule.
//!
//! The synthetic GPT has an untied embedding and output layer (Megatron-LM ties them at
//! 51,200: one `V × h` table more in memory, the same work); its loss is not priced (the
//! output layer's logits are the output).

use std::time::Instant;

use shardc::passes::autoshard::{self, config::Config};
use shardc::passes::cost::{self, Cluster, Options, Precision};
use shardc::synthetic::Gpt;

/// A source of measurements and how its framework ran.
struct Source {
    name: &'static str,
    /// The data-parallel gradient reduction overlapped with the backward pass.
    overlap_grad_sync: bool,
}

const KORTHIKANTI: Source = Source { name: "Korthikanti 2022", overlap_grad_sync: false };
const NARAYANAN: Source = Source { name: "Narayanan 2021", overlap_grad_sync: false };
const MCORE_H100: Source = Source { name: "Megatron-Core H100", overlap_grad_sync: true };

/// A measured model: a Megatron GPT on a cluster.
struct Model {
    name: &'static str,
    layers: usize,
    hidden: usize,
    heads: usize,
    vocab: usize,
    seq: usize,
    batch: usize,
    /// `a100` or `h100`: the preset's GPUs, in DGX nodes of 8.
    gpu: &'static str,
    devices: usize,
}

impl Model {
    /// The preset of its DGX nodes: `dgx-a100` for one, `a100-cluster-N` for N.
    fn cluster(&self) -> String {
        match self.devices / 8 {
            1 => format!("dgx-{}", self.gpu),
            nodes => format!("{}-cluster-{nodes}", self.gpu),
        }
    }

    /// Narayanan et al.'s count of a GPT iteration (full recomputation counted).
    fn flops_ptdp(&self) -> f64 {
        let (b, s, l, h, v) = self.dims();
        96.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h))
    }

    /// Megatron-Core r0.8.0's count of a GPT iteration (no recomputation counted).
    fn flops_mcore(&self) -> f64 {
        let (b, s, l, h, v) = self.dims();
        72.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * l * h))
    }

    fn dims(&self) -> (f64, f64, f64, f64, f64) {
        (self.batch as f64, self.seq as f64, self.layers as f64, self.hidden as f64, self.vocab as f64)
    }
}

/// The GPUs, sequence length and vocabulary a source's models share.
struct Runs {
    gpu: &'static str,
    seq: usize,
    vocab: usize,
}

/// The A100 sources: sequence 2048, vocabulary 51,200.
const A100: Runs = Runs { gpu: "a100", seq: 2048, vocab: 51200 };
/// Megatron-Core's H100 table: sequence 4,096, vocabulary 131,072.
const H100: Runs = Runs { gpu: "h100", seq: 4096, vocab: 131072 };

/// A Megatron GPT of `layers × hidden` with `heads` as `runs` trained it, on `devices` GPUs.
const fn gpt(
    runs: Runs,
    name: &'static str,
    layers: usize,
    hidden: usize,
    heads: usize,
    batch: usize,
    devices: usize,
) -> Model {
    Model { name, layers, hidden, heads, vocab: runs.vocab, seq: runs.seq, batch, gpu: runs.gpu, devices }
}

// Korthikanti et al. 2022, Table 5.
const K_22B: Model = gpt(A100, "GPT 22B", 48, 6144, 64, 4, 8);
const K_175B: Model = gpt(A100, "GPT 175B", 96, 12288, 96, 64, 64);
const K_530B: Model = gpt(A100, "GPT 530B", 105, 20480, 128, 280, 280);
const K_1T: Model = gpt(A100, "GPT 1T", 128, 25600, 160, 512, 512);

// Narayanan et al. 2021, Table 1.
const N_1_7B: Model = gpt(A100, "GPT 1.7B", 24, 2304, 24, 512, 32);
const N_3_6B: Model = gpt(A100, "GPT 3.6B", 30, 3072, 32, 512, 64);
const N_7_5B: Model = gpt(A100, "GPT 7.5B", 36, 4096, 32, 512, 128);
const N_18B: Model = gpt(A100, "GPT 18B", 40, 6144, 48, 1024, 256);
const N_39B: Model = gpt(A100, "GPT 39B", 48, 8192, 64, 1536, 512);
const N_76B: Model = gpt(A100, "GPT 76B", 60, 10240, 80, 1792, 1024);
const N_145B: Model = gpt(A100, "GPT 145B", 80, 12288, 96, 2304, 1536);
const N_310B: Model = gpt(A100, "GPT 310B", 96, 16384, 128, 2160, 1920);
const N_530B: Model = gpt(A100, "GPT 530B", 105, 20480, 128, 2520, 2520);
const N_1T: Model = gpt(A100, "GPT 1T", 128, 25600, 160, 3072, 3072);

// Megatron-Core r0.8.0 on H100, the README's model table.
const M_1_7B: Model = gpt(H100, "GPT 1.7B", 24, 2048, 16, 192, 48);
const M_7_1B: Model = gpt(H100, "GPT 7.1B", 30, 4096, 32, 192, 96);
const M_16B: Model = gpt(H100, "GPT 16B", 32, 6144, 48, 192, 192);
const M_32B: Model = gpt(H100, "GPT 32B", 48, 7168, 56, 192, 384);
const M_70B: Model = gpt(H100, "GPT 70B", 84, 8192, 64, 384, 768);
const M_119B: Model = gpt(H100, "GPT 119B", 92, 10240, 80, 768, 1536);
const M_177B: Model = gpt(H100, "GPT 177B", 96, 12288, 96, 1152, 2304);
const M_314B: Model = gpt(H100, "GPT 314B", 96, 16384, 128, 1536, 3072);
const M_462B: Model = gpt(H100, "GPT 462B", 112, 18432, 144, 3072, 6144);

/// What a source measured: seconds per iteration, or teraFLOP/s per GPU by its own count.
enum Measured {
    Seconds(f64),
    /// Narayanan et al.'s count.
    PtdpTflops(f64),
    /// Megatron-Core r0.8.0's count.
    McoreTflops(f64),
}

/// A measured run: the source, the model, its configuration and the measurement.
struct Row {
    source: &'static Source,
    model: &'static Model,
    config: &'static str,
    measured: Measured,
}

impl Row {
    /// The measured seconds per iteration.
    fn seconds(&self) -> f64 {
        let gpus = self.model.devices as f64;
        match self.measured {
            Measured::Seconds(s) => s,
            Measured::PtdpTflops(t) => self.model.flops_ptdp() / (t * 1e12 * gpus),
            Measured::McoreTflops(t) => self.model.flops_mcore() / (t * 1e12 * gpus),
        }
    }
}

const fn k(model: &'static Model, config: &'static str, s: f64) -> Row {
    Row { source: &KORTHIKANTI, model, config, measured: Measured::Seconds(s) }
}

const fn n(model: &'static Model, config: &'static str, tflops: f64) -> Row {
    Row { source: &NARAYANAN, model, config, measured: Measured::PtdpTflops(tflops) }
}

const fn m(model: &'static Model, config: &'static str, tflops: f64) -> Row {
    Row { source: &MCORE_H100, model, config, measured: Measured::McoreTflops(tflops) }
}

const ROWS: &[Row] = &[
    k(&K_22B, "tp=8,mbs=4,recompute=full", 1.42),
    k(&K_22B, "tp=8,mbs=4,recompute=selective,sp", 1.10),
    k(&K_175B, "tp=8,pp=8,vp=3,mbs=1,recompute=full", 18.13),
    k(&K_175B, "tp=8,pp=8,vp=3,mbs=1,recompute=selective,sp", 13.75),
    k(&K_530B, "tp=8,pp=35,vp=3,mbs=1,recompute=full", 49.05),
    k(&K_530B, "tp=8,pp=35,vp=3,mbs=1,recompute=selective,sp", 37.83),
    k(&K_1T, "tp=8,pp=64,mbs=1,recompute=full", 94.42),
    k(&K_1T, "tp=8,pp=64,mbs=1,recompute=selective,sp", 71.49),
    n(&N_1_7B, "dp=32,mbs=1,recompute=full", 137.0),
    n(&N_3_6B, "tp=2,dp=32,mbs=1,recompute=full", 138.0),
    n(&N_7_5B, "tp=4,dp=32,mbs=1,recompute=full", 142.0),
    n(&N_18B, "tp=8,dp=32,mbs=1,recompute=full", 135.0),
    n(&N_39B, "tp=8,pp=2,dp=32,mbs=1,recompute=full", 138.0),
    n(&N_76B, "tp=8,pp=4,dp=32,mbs=1,recompute=full", 140.0),
    n(&N_145B, "tp=8,pp=8,dp=24,mbs=1,recompute=full", 148.0),
    n(&N_310B, "tp=8,pp=16,dp=15,mbs=1,recompute=full", 155.0),
    n(&N_530B, "tp=8,pp=35,dp=9,mbs=1,recompute=full", 163.0),
    n(&N_1T, "tp=8,pp=64,dp=6,mbs=1,recompute=full", 163.0),
    m(&M_1_7B, "dp=48,mbs=1,zero=1,flash", 408.8),
    m(&M_7_1B, "tp=2,dp=48,mbs=1,sp,zero=1,flash,tp_overlap", 465.9),
    m(&M_16B, "tp=4,dp=48,mbs=1,sp,zero=1,flash,tp_overlap", 489.1),
    m(&M_32B, "tp=8,dp=48,mbs=1,sp,zero=1,flash,tp_overlap", 459.6),
    m(&M_70B, "tp=8,pp=2,dp=48,mbs=1,sp,zero=1,flash,tp_overlap", 419.7),
    m(&M_119B, "tp=8,pp=4,dp=48,mbs=1,sp,zero=1,flash,tp_overlap", 420.5),
    m(&M_177B, "tp=8,pp=6,dp=48,mbs=1,sp,zero=1,flash,tp_overlap", 432.8),
    m(&M_314B, "tp=8,pp=8,dp=48,mbs=1,sp,zero=1,flash,tp_overlap", 474.4),
    m(&M_462B, "tp=8,pp=16,dp=48,mbs=1,sp,zero=1,flash,tp_overlap", 459.9),
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
    let cluster = Cluster::load(&row.model.cluster()).map_err(|e| e.to_string())?;
    let opts =
        Options { precision: Precision::Fp16, overlap_grad_sync: row.source.overlap_grad_sync, ..Options::default() };
    let cfg = Config::parse(row.config)?;
    let mut rewritten = g.clone();
    cfg.rewrite(&mut rewritten)?;
    let (named, o) = cfg.resolve(row.model.devices, cost::pipeline::graph_batch(&rewritten), &opts)?;
    let priced = autoshard::named::price(&rewritten, &cluster, row.model.devices, &named, &o)?;
    Ok((priced.breakdown.step_time_s, priced.breakdown.feasible))
}

/// Spearman's rank correlation of two equally long lists without ties.
fn spearman(a: &[f64], b: &[f64]) -> f64 {
    let rank = |v: &[f64]| {
        let mut idx: Vec<usize> = (0..v.len()).collect();
        idx.sort_by(|&i, &j| v[i].total_cmp(&v[j]));
        let mut r = vec![0.0; v.len()];
        for (pos, &i) in idx.iter().enumerate() {
            r[i] = pos as f64;
        }
        r
    };
    let (ra, rb) = (rank(a), rank(b));
    let n = a.len() as f64;
    let d2: f64 = ra.iter().zip(&rb).map(|(x, y)| (x - y).powi(2)).sum();
    1.0 - 6.0 * d2 / (n * (n * n - 1.0))
}

fn mape(errors: &[f64]) -> f64 {
    100.0 * errors.iter().map(|e| e.abs()).sum::<f64>() / errors.len().max(1) as f64
}

fn main() {
    // (source, model, measured, predicted) of every priced row.
    let mut priced: Vec<(&str, &str, f64, f64)> = Vec::new();
    // Rows of one model share its graph.
    let mut last: Option<(*const Model, shardc::ir::Model)> = None;
    println!("source | model | devices × cluster | configuration | measured s | predicted s | error");
    for row in ROWS {
        let (t0, m) = (Instant::now(), row.model);
        if last.as_ref().is_none_or(|(p, _)| !std::ptr::eq(*p, m)) {
            let gpt = Gpt {
                layers: m.layers,
                hidden: m.hidden,
                heads: m.heads,
                batch: m.batch,
                seq: m.seq,
                fused_gelu: true,
                vocab: m.vocab,
            };
            last = Some((m, prepare(&gpt.to_text())));
        }
        let g = &last.as_ref().expect("prepared").1.graph;
        let measured = row.seconds();
        let head = format!("{} | {} | {} × {} | {}", row.source.name, m.name, m.devices, m.cluster(), row.config);
        match predicted(row, g) {
            Ok((step, fits)) => {
                let err = step / measured - 1.0;
                priced.push((row.source.name, m.name, measured, step));
                println!(
                    "{head} | {measured:.2} | {step:.2}{} | {:+.1}% ({:.1} s)",
                    if fits { "" } else { " (does not fit)" },
                    100.0 * err,
                    t0.elapsed().as_secs_f64()
                );
            }
            Err(e) => println!("{head} | {measured:.2} | not priced: {e}"),
        }
    }
    summarize(&priced);
}

/// MAPE per source and overall, the largest error, and the order of each model's
/// configurations within a source.
fn summarize(priced: &[(&str, &str, f64, f64)]) {
    let err = |&(_, _, measured, step): &(&str, &str, f64, f64)| step / measured - 1.0;
    let mut sources: Vec<&str> = priced.iter().map(|r| r.0).collect();
    sources.dedup();
    for s in &sources {
        let e: Vec<f64> = priced.iter().filter(|r| r.0 == *s).map(err).collect();
        let (a, b): (Vec<f64>, Vec<f64>) = priced.iter().filter(|r| r.0 == *s).map(|r| (r.2, r.3)).unzip();
        println!("{s}: MAPE {:.1}% over {} rows, Spearman ρ {:.2} over them", mape(&e), e.len(), spearman(&a, &b));
        let mut models: Vec<&str> = priced.iter().filter(|r| r.0 == *s).map(|r| r.1).collect();
        models.dedup();
        for m in models {
            let rows: Vec<_> = priced.iter().filter(|r| r.0 == *s && r.1 == m).collect();
            if rows.len() >= 2 {
                let (a, b): (Vec<f64>, Vec<f64>) = rows.iter().map(|r| (r.2, r.3)).unzip();
                println!("  {m}: {} configurations, Spearman ρ {:.2}", rows.len(), spearman(&a, &b));
            }
        }
    }
    let all: Vec<f64> = priced.iter().map(err).collect();
    let max = all.iter().map(|e| e.abs()).fold(0.0, f64::max);
    println!("overall: MAPE {:.1}%, largest {:.1}% over {} rows", mape(&all), 100.0 * max, all.len());
}
