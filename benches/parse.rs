//! Parse + verify + shape inference time, for the largest shared model and a synthetic
//! 6,000-node graph. Target (DESIGN.md): under 0.2 s for 6,000 nodes.
//!
//! Run with `cargo bench --bench parse`. Prints the median, min and max of repeated runs.

use std::time::{Duration, Instant};

fn synthetic(nodes: usize) -> String {
    // A transformer-like chain: MatMul, Add, LayerNormalization, Relu, Reshape, Transpose.
    let mut s = String::from(
        "<\n   ir_version: 8,\n   opset_import: [\"\" : 17]\n>\nsynthetic (float[8,64,256] x) => (float[8,64,256] y) \n   <",
    );
    let mut inits = Vec::new();
    inits.push("int64[3] shape =  {8,64,256}".to_string());
    inits.push("float[256] gamma = [\"location\": \"w.bin\", \"offset\": \"0\", \"length\": \"1024\"]".to_string());
    let layers = nodes / 6 + 1;
    for l in 0..layers {
        inits.push(format!(
            "float[256,256] w{l} = [\"location\": \"w.bin\", \"offset\": \"0\", \"length\": \"262144\"]"
        ));
    }
    s.push_str(&inits.join(", "));
    s.push_str(">\n{\n");
    let mut prev = "x".to_string();
    let mut count = 0;
    for l in 0..layers {
        let lines = [
            format!("   [mm{l}] m{l} = MatMul ({prev}, w{l})"),
            format!("   [add{l}] a{l} = Add (m{l}, {prev})"),
            format!("   [ln{l}] n{l} = LayerNormalization <axis: int = -1, epsilon: float = 1e-05> (a{l}, gamma)"),
            format!("   [relu{l}] r{l} = Relu (n{l})"),
            format!("   [t{l}] t{l} = Transpose <perm: ints = [0, 2, 1]> (r{l})"),
            format!("   [t2{l}] u{l} = Transpose <perm: ints = [0, 2, 1]> (t{l})"),
        ];
        for line in lines {
            if count == nodes - 1 {
                break;
            }
            s.push_str(&line);
            s.push('\n');
            count += 1;
        }
        prev = match count % 6 {
            0 => format!("u{l}"),
            1 => format!("m{l}"),
            2 => format!("a{l}"),
            3 => format!("n{l}"),
            4 => format!("r{l}"),
            _ => format!("t{l}"),
        };
        if count == nodes - 1 {
            break;
        }
    }
    s.push_str(&format!("   [out] y = Reshape ({prev}, shape)\n}}"));
    s
}

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
    let text = synthetic(6000);
    measure("synthetic 6000-node graph", &text, 21);
    let text = synthetic(20000);
    measure("synthetic 20000-node graph", &text, 7);
}
