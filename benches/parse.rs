//! Parse + verify + shape inference time, for the largest shared model and a synthetic
//! 6,000-node graph. Target (DESIGN.md): under 0.2 s for 6,000 nodes.
//!
//! Run with `cargo bench --bench parse`. Prints the median, min and max of repeated runs.

use std::time::{Duration, Instant};

fn pipeline(text: &str) -> usize {
    let parsed = shardc::frontend::parse(text).expect("parses");
    let mut g = parsed.model.graph;
    shardc::ir::verify(&g).expect("verifies");
    shardc::ir::infer::infer_shapes(&mut g, shardc::ir::infer::Mode::Check).expect("infers");
    g.op_count()
}

fn measure(name: &str, text: &str, runs: usize) {
    let mut times: Vec<Duration> = Vec::with_capacity(runs);
    let mut nodes = 0;
    for _ in 0..runs {
        let t = Instant::now();
        nodes = pipeline(text);
        times.push(t.elapsed());
    }
    times.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "{name:<34} {nodes:>6} nodes {:>8.1} KB   median {:>8.2} ms   min {:>8.2} ms   max {:>8.2} ms   ({runs} runs)",
        text.len() as f64 / 1024.0,
        ms(times[runs / 2]),
        ms(times[0]),
        ms(times[runs - 1])
    );
}

fn main() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    println!("parse + verify + infer-shapes");
    for name in ["pt_nn_transformer", "hf_bert_base", "hf_gpt2_124m", "tv_resnet50"] {
        let text = std::fs::read_to_string(root.join("tests/data/models").join(format!("{name}.onnxtxt")))
            .expect("bundled model");
        measure(name, &text, 21);
    }
    let text = shardc::synthetic::chain(6000);
    measure("synthetic 6000-node graph", &text, 21);
    let text = shardc::synthetic::chain(20000);
    measure("synthetic 20000-node graph", &text, 7);
}
