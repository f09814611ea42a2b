//! LLM planning at the sizes people train: Megatron-style GPTs and Llama 3 from the project's
//! synthetic generator (weights absent), each planned as `shardc plan` plans with its default
//! options (rewrites and the memory ladder on, 60 s budget), beside the published hand
//! configuration of the same model on the same cluster priced in the same cost model through
//! the configuration grammar (`tp=8,pp=8,vp=3,…`, docs/memory.md).
//!
//! Run with `cargo bench --bench llm`. `SHARDC_BENCH_ONLY=NAME[,NAME]` runs the named cases
//! (e.g. `gpt-175b`); `SHARDC_BENCH_HAND_ONLY=1` prices the hand configurations without
//! searching (seconds for all of them). Per case it prints the search's wall and process CPU
//! time, the phases the wall-clock safety net cut, the plan (parallel degrees, stages,
//! micro-batches, schedule, recomputation, ZeRO, sequence parallelism), predicted step time,
//! MFU and memory per device, and the same for the hand configuration.
//!
//! Hand configurations: Korthikanti et al. 2022 (Megatron-LM, A100-80GB, fp16, sequence 2048,
//! selective recomputation with sequence parallelism, micro-batch 1): 22B TP8 on 8 at batch 4;
//! 175B TP8 × PP8 interleaved 3 on 64 at batch 64; 530B TP8 × PP35 interleaved 3 on 280 at
//! batch 280; 1T TP8 × PP64 on 512 at batch 512. torchtitan (Liang et al. 2024, H100, bf16,
//! sequence 8192): Llama 3.1 8B FSDP on 8 (local batch 2, selective recomputation by its `op`
//! policy: `recompute=op`) and on 128 (local batch 2, the same); 70B FSDP 32 × TP 8 on 256 (local batch 16, full recomputation); 405B FSDP 8 × TP 8 ×
//! PP 8 interleaved on 512 (global batch 256, full recomputation); 8B at sequence 131,072 on 8
//! as FSDP 2 × context 4 with ring attention (global batch 2, full recomputation; torchtitan's
//! long-context run); Megatron-core's Mixtral 8×7B (its MoE README: 64 H100, TP1 × PP4 × EP8,
//! bf16, sequence 4096, the `alltoall` token dispatcher, dropless, 468 TFLOP/s a GPU in MCore
//! v0.9; the global batch is not published with the figure: 256 here); torchtitan's attention is
//! PyTorch's fused scaled-dot-product kernel (`flash`: priced on the graph with its
//! attentions fused), Korthikanti et al.'s is not.

use std::time::Instant;

/// The allocator the `shardc` binary plans with.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use shardc::passes::autoshard::config::Config;
use shardc::passes::autoshard::{self, SearchOptions};
use shardc::passes::cost::{self, Cluster, Options, Precision};
use shardc::synthetic::{Gpt, Llama};

struct Case {
    name: &'static str,
    model: fn() -> String,
    cluster: &'static str,
    devices: usize,
    hand: &'static str,
}

fn gpt(layers: usize, hidden: usize, heads: usize, batch: usize) -> String {
    Gpt { layers, hidden, heads, batch, seq: 2048, fused_gelu: true, vocab: 0 }.to_text()
}

const CASES: &[Case] = &[
    Case {
        name: "gpt-22b",
        model: || gpt(48, 6144, 64, 4),
        cluster: "dgx-a100",
        devices: 8,
        hand: "tp=8,mbs=1,recompute=selective,sp",
    },
    Case {
        name: "gpt-175b",
        model: || gpt(96, 12288, 96, 64),
        cluster: "a100-cluster-8",
        devices: 64,
        hand: "tp=8,pp=8,vp=3,mbs=1,recompute=selective,sp",
    },
    Case {
        name: "gpt-530b",
        model: || gpt(105, 20480, 128, 280),
        cluster: "a100-cluster-35",
        devices: 280,
        hand: "tp=8,pp=35,vp=3,mbs=1,recompute=selective,sp",
    },
    Case {
        name: "gpt-1t",
        model: || gpt(128, 25600, 160, 512),
        cluster: "a100-cluster-64",
        devices: 512,
        hand: "tp=8,pp=64,mbs=1,recompute=selective,sp",
    },
    Case {
        name: "llama3-8b-8",
        model: || Llama::llama3_8b(16, 8192).to_text(),
        cluster: "dgx-h100",
        devices: 8,
        hand: "dp=8,zero=3,mbs=2,recompute=op,flash",
    },
    Case {
        name: "llama3-8b-128",
        model: || Llama::llama3_8b(256, 8192).to_text(),
        cluster: "h100-cluster-16",
        devices: 128,
        hand: "dp=128,zero=3,mbs=2,recompute=op,flash",
    },
    Case {
        name: "llama3-70b-256",
        model: || Llama::llama3_70b(512, 8192).to_text(),
        cluster: "h100-cluster-32",
        devices: 256,
        hand: "dp=32,tp=8,zero=3,mbs=16,recompute=full,sp,flash",
    },
    Case {
        name: "llama3-8b-131k-8",
        model: || Llama::llama3_8b(2, 131_072).to_text(),
        cluster: "dgx-h100",
        devices: 8,
        hand: "dp=2,cp=4,cp_comm=p2p,recompute=full,zero=3,flash",
    },
    Case {
        name: "mixtral-8x7b-64",
        model: || Llama::mixtral_8x7b(256, 4096).to_text(),
        cluster: "h100-cluster-8",
        devices: 64,
        hand: "dp=16,pp=4,ep=8,mbs=1,ep_comm=a2a,flash",
    },
    Case {
        name: "llama3-405b-512",
        model: || Llama::llama3_405b(256, 8192).to_text(),
        cluster: "h100-cluster-64",
        devices: 512,
        hand: "dp=8,tp=8,pp=8,vp=2,zero=3,mbs=1,recompute=full,sp,flash",
    },
];

/// The model, shapes inferred and canonicalized as `shardc plan` prepares it.
fn prepare(text: &str) -> shardc::ir::Model {
    let mut m = shardc::frontend::parse(text).expect("parses").model;
    let mut pm = shardc::passes::PassManager::new();
    pm.add(shardc::passes::InferShapes::default()).add(shardc::passes::Canonicalize).add(shardc::passes::Algebra);
    pm.run(&mut m).expect("passes run");
    m
}

/// Seconds of CPU this process has used (user + system), from /proc.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command's closing parenthesis: utime and stime are the 12th and 13th.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    // (field 3, the state, is the first after it).
    let f: Vec<&str> = rest.split_whitespace().collect();
    let tick = |i: usize| f.get(i).and_then(|x| x.parse::<f64>().ok()).unwrap_or(0.0);
    (tick(11) + tick(12)) / 100.0
}

/// A plan's line: degrees, memory options, step, MFU, memory per device.
fn line(summary: &autoshard::plan::PlanSummary, opts: &Options, b: &cost::Breakdown) -> String {
    format!(
        "{}{} | step {:.3} s | MFU {} | {:.2} GiB{}",
        summary.text,
        match opts.memory_fields().as_str() {
            "none" => String::new(),
            m => format!(" [{m}]"),
        },
        b.step_time_s,
        summary.mfu.map_or("?".into(), |m| format!("{:.1}%", 100.0 * m)),
        b.memory.total() / 1073741824.0,
        if b.feasible { "" } else { " (does not fit)" }
    )
}

fn hand(case: &Case, g: &shardc::ir::Graph, cluster: &Cluster, opts: &Options) -> Result<(f64, String), String> {
    let cfg = Config::parse(case.hand)?;
    let mut rewritten = g.clone();
    cfg.rewrite(&mut rewritten)?;
    let g = &rewritten;
    let (named, o) = cfg.resolve(case.devices, cost::pipeline::graph_batch(g), opts)?;
    let priced = autoshard::named::price(g, cluster, case.devices, &named, &o)?;
    let cm = cost::CostModel::new(g, cluster, priced.mesh.clone(), o.clone());
    let pipe = priced.pipeline.as_ref().map(|p| (p.stages.len(), p.micro_batches, p.schedule.name()));
    let step = priced.breakdown.step_time_s;
    let s = autoshard::plan::PlanSummary::new(&cm, &priced.assignment, cluster, &o, case.devices, step, pipe);
    let fits = if priced.breakdown.feasible { step } else { f64::INFINITY };
    Ok((fits, line(&s, &o, &priced.breakdown)))
}

fn searched(case: &Case, g: &shardc::ir::Graph, cluster: &Cluster, opts: &Options) -> (f64, String) {
    let so = SearchOptions { rewrites: true, memory_ladder: true, ..Default::default() };
    let mut h = g.clone();
    let (t0, c0) = (Instant::now(), cpu_seconds());
    let r = autoshard::search_rewriting(&mut h, cluster, case.devices, opts, &so);
    let (wall, cpu) = (t0.elapsed().as_secs_f64(), cpu_seconds() - c0);
    let r = match r {
        Ok(r) => r,
        Err(e) => return (f64::INFINITY, format!("search {wall:.1} s (cpu {cpu:.1} s): {e}")),
    };
    let o = r.options.clone().unwrap_or_else(|| opts.clone());
    let cm = cost::CostModel::new(&h, cluster, r.mesh.clone(), o.clone());
    let pipe = r.pipeline.as_ref().map(|p| (p.stages.len(), p.micro_batches, p.schedule.name()));
    let step = r.breakdown.step_time_s;
    let s = autoshard::plan::PlanSummary::new(&cm, &r.assignment, cluster, &o, case.devices, step, pipe);
    let cut = if r.budget_cut.is_empty() { "not cut".to_string() } else { format!("cut: {}", r.budget_cut.join(", ")) };
    let fits = if r.breakdown.feasible { step } else { f64::INFINITY };
    (fits, format!("search {wall:.1} s (cpu {cpu:.1} s, {cut}): {}", line(&s, &o, &r.breakdown)))
}

fn main() {
    let only: Option<Vec<String>> =
        std::env::var("SHARDC_BENCH_ONLY").ok().map(|s| s.split(',').map(|x| x.trim().to_string()).collect());
    let hand_only = std::env::var("SHARDC_BENCH_HAND_ONLY").is_ok_and(|v| v == "1");
    for case in CASES.iter().filter(|c| only.as_ref().is_none_or(|o| o.iter().any(|x| x == c.name))) {
        let cluster = Cluster::load(case.cluster).expect("preset");
        let opts = Options { precision: Precision::Fp16, ..Options::default() };
        let t0 = Instant::now();
        let m = prepare(&(case.model)());
        let g = &m.graph;
        let prep = t0.elapsed().as_secs_f64();
        println!(
            "{} on {} × {} ({} ops, prepared in {prep:.1} s)",
            case.name,
            case.devices,
            cluster.device.name,
            g.op_nodes().map_or(0, |o| o.len())
        );
        let (hand_step, hand_line) = match hand(case, g, &cluster, &opts) {
            Ok(x) => x,
            Err(e) => (f64::INFINITY, format!("not priced: {e}")),
        };
        println!("  hand   {}: {hand_line}", case.hand);
        if hand_only {
            continue;
        }
        let (step, search_line) = searched(case, g, &cluster, &opts);
        println!("  plan   {search_line}");
        let verdict = match (step.is_finite(), hand_step.is_finite()) {
            (true, true) => format!("plan / hand step {:.3}", step / hand_step),
            (true, false) => "the plan fits, the hand configuration does not".into(),
            (false, true) => "the hand configuration fits, the plan does not".into(),
            (false, false) => "neither fits".into(),
        };
        println!("  {verdict}");
    }
}
