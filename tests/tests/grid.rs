//! The configuration grid of the search (`autoshard::grid`): its plan is the price `shardc
//! cost` gives the same configuration (one function prices both), it is no slower than any
//! configuration of the space it walks, it saves memory only when it must, and the search
//! takes it when it is the fastest plan.

use passes::autoshard::config::Config;
use passes::autoshard::{self, PipelineMode, SearchOptions, budget::SafetyNet, grid};
use passes::cost::{self, Breakdown, Cluster, Options, Precision};

/// A GPT of 36 small blocks (over 1,000 ops: the size the grid runs from).
fn gpt(batch: usize) -> ir::Graph {
    let text = shardc::synthetic::Gpt { layers: 36, hidden: 64, heads: 4, batch, seq: 32, fused_gelu: true, vocab: 0 }
        .to_text();
    let mut m = frontend::parse(&text).unwrap_or_else(|d| panic!("{}", frontend::render(&d, "gpt", &text))).model;
    let mut pm = passes::PassManager::new();
    pm.add(passes::InferShapes::default()).add(passes::Canonicalize).add(passes::Algebra);
    pm.run(&mut m).unwrap();
    m.graph
}

fn opts() -> Options {
    Options { precision: Precision::Fp16, ..Options::default() }
}

/// `config` priced as `shardc cost --strategy config` prices it.
fn cost_of(g: &ir::Graph, c: &Cluster, devices: usize, config: &str) -> Breakdown {
    let (named, o) = Config::parse(config)
        .and_then(|cfg| cfg.resolve(devices, cost::pipeline::graph_batch(g), &opts()))
        .unwrap_or_else(|e| panic!("{config}: {e}"));
    autoshard::named::price(g, c, devices, &named, &o).unwrap_or_else(|e| panic!("{config}: {e}")).breakdown
}

fn walk(g: &ir::Graph, c: &Cluster, devices: usize, rungs: bool) -> grid::GridPlan {
    let net = SafetyNet::new(std::time::Duration::from_secs(600), 1.0);
    grid::search_grid(g, c, devices, &opts(), None, 36, rungs, &net).expect("a configuration")
}

#[test]
fn the_grids_plan_is_the_price_of_its_configuration_and_beats_the_configurations_it_walks() {
    let g = gpt(16);
    let c = Cluster::preset("a100-cluster-2").unwrap();
    let best = walk(&g, &c, 16, true);
    assert!(best.breakdown.feasible);
    let again = cost_of(&g, &c, 16, &best.config);
    let rel = (again.step_time_s / best.breakdown.step_time_s - 1.0).abs();
    assert!(rel < 1e-9, "{}: grid {} s, cost {} s", best.config, best.breakdown.step_time_s, again.step_time_s);
    for hand in ["dp=16", "dp=8,tp=2", "tp=8,dp=2", "tp=4,pp=2,mbs=1", "tp=2,pp=4,vp=2,mbs=1", "dp=4,pp=4,mbs=1"] {
        let h = cost_of(&g, &c, 16, hand);
        if h.feasible {
            assert!(
                best.breakdown.step_time_s <= h.step_time_s * (1.0 + 1e-9),
                "{hand}: {} s beats the grid's {} ({} s)",
                h.step_time_s,
                best.config,
                best.breakdown.step_time_s
            );
        }
    }
    assert!(best.priced >= 6, "{} configurations priced", best.priced);
}

/// The configuration without its memory savings (ZeRO, recomputation, sequence parallelism).
fn bare(config: &str) -> String {
    config
        .split(',')
        .filter(|f| !f.starts_with("zero") && !f.starts_with("recompute") && *f != "sp")
        .collect::<Vec<_>>()
        .join(",")
}

#[test]
fn the_grid_saves_memory_where_nothing_fits_without_or_where_it_is_faster() {
    let g = gpt(16);
    let roomy = Cluster::preset("a100-cluster-2").unwrap();
    let plain = walk(&g, &roomy, 16, true);
    if plain.options.memory_fields() != "none" {
        // Taken for speed: the same configuration without it is slower.
        let without = cost_of(&g, &roomy, 16, &bare(&plain.config));
        assert!(without.step_time_s >= plain.breakdown.step_time_s, "{}", plain.config);
    }
    // A device that holds a third of what the plan above needs: it must save memory.
    let mut tight = roomy.clone();
    tight.device.mem_capacity = plain.breakdown.memory.total() / tight.device.mem_usable / 3.0;
    let net = SafetyNet::new(std::time::Duration::from_secs(600), 1.0);
    let saving = grid::search_grid(&g, &tight, 16, &opts(), None, 36, true, &net).expect("a configuration that fits");
    assert!(saving.breakdown.feasible);
    assert_ne!(saving.options.memory_fields(), "none", "{}", saving.config);
    let again = cost_of(&g, &tight, 16, &saving.config);
    assert!((again.step_time_s / saving.breakdown.step_time_s - 1.0).abs() < 1e-9, "{}", saving.config);
    // The same configuration without its memory saving does not fit there, or is slower.
    let without = cost_of(&g, &tight, 16, &bare(&saving.config));
    assert!(!without.feasible || without.step_time_s >= saving.breakdown.step_time_s, "{}", saving.config);
    // Without memory saving (what `train` and `run` lower), no rung is taken.
    let lowered = walk(&g, &roomy, 16, false);
    assert_eq!(lowered.options.memory_fields(), "none");
    assert!(!lowered.config.contains("vp="), "{}", lowered.config);
}

#[test]
fn the_search_takes_the_grids_plan_when_it_is_fastest() {
    let g = gpt(16);
    let c = Cluster::preset("a100-cluster-2").unwrap();
    let best = walk(&g, &c, 16, true);
    let so = SearchOptions { pipeline: PipelineMode::Auto, memory_ladder: true, ..Default::default() };
    let r = autoshard::search(&g, &c, 16, &opts(), &so).expect("a plan");
    assert!(r.breakdown.step_time_s <= best.breakdown.step_time_s * (1.0 + 1e-9));
    if r.same_as.as_deref() == Some(best.config.as_str()) {
        assert_eq!(r.pipeline.is_some(), best.pipeline.is_some());
    }
}

/// A search told to take the grid alone (as `search_rewriting` searches a rewritten graph when
/// the graph as written took a grid configuration) takes the grid's best configuration, at
/// its price, without searching any mesh per op; on the same model the full search is never
/// slower than it.
#[test]
fn a_grid_only_search_takes_the_grids_best() {
    let g = gpt(16);
    let c = Cluster::preset("a100-cluster-2").unwrap();
    let best = walk(&g, &c, 16, true);
    let so = SearchOptions { pipeline: PipelineMode::Auto, memory_ladder: true, ..Default::default() };
    let only = autoshard::search(&g, &c, 16, &opts(), &SearchOptions { grid_only: true, ..so.clone() }).unwrap();
    assert!(only.meshes.is_empty(), "{:?}", only.meshes.len());
    assert_eq!(only.same_as.as_deref(), Some(best.config.as_str()));
    assert_eq!(only.breakdown.step_time_s, best.breakdown.step_time_s);
    let full = autoshard::search(&g, &c, 16, &opts(), &so).unwrap();
    assert!(!full.meshes.is_empty());
    assert!(full.breakdown.step_time_s <= only.breakdown.step_time_s * (1.0 + 1e-9));
}
