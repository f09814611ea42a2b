//! The wgpu executor on lavapipe (or any adapter): every golden case on one simulated device
//! matches onnxruntime's outputs, and sharded runs match the reference.
//!
//! Without an adapter these tests are skipped, unless `SHARDC_REQUIRE_GPU` is set (as `.ci/run`
//! does), when a missing adapter is a failure.

use codegen::{Backend, Placement, RunOptions};
use shardc_tests::*;

fn prepared(path: &std::path::Path) -> ir::Model {
    let mut m = load_model(path);
    let mut pm = passes::PassManager::new();
    pm.add(passes::Verify).add(passes::InferShapes::default()).add(passes::Canonicalize);
    pm.run(&mut m).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    m
}

#[test]
fn every_golden_case_runs_on_one_wgpu_device() {
    if !gpu_available() {
        return;
    }
    let mut host_ops = std::collections::BTreeMap::new();
    for path in data_files("golden") {
        let m = prepared(&path);
        let io = load_io(&path);
        let prog = codegen::lower(&m.graph, &Placement::single()).unwrap();
        let r = codegen::run(&prog, &io.inputs, &RunOptions { backend: Backend::Wgpu, ..Default::default() })
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert_eq!(r.outputs.len(), io.outputs.len());
        for (name, want) in &io.outputs {
            let got = &r.outputs.iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("no output `{name}`")).1;
            compare(name, got, want, io.rtol, io.atol).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        }
        for (op, k) in &r.devices[0].host_ops {
            *host_ops.entry(op.clone()).or_insert(0) += k;
        }
    }
    eprintln!("ops run on the host: {host_ops:?}");
}

#[test]
fn sharded_plans_run_on_wgpu_devices_and_match_the_reference() {
    use passes::autoshard::Named;
    use passes::cost::{Cluster, CostModel, Options};
    if !gpu_available() {
        return;
    }
    let c = Cluster::preset("dgx-a100").unwrap();
    let mut ran = 0;
    for path in data_files("golden") {
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if ![
            "tiny_resnet.onnxtxt",
            "tiny_gpt.onnxtxt",
            "tiny_mlp.onnxtxt",
            "tiny_lstm_lm.onnxtxt",
            "conv2d_basic.onnxtxt",
            "norm_layers.onnxtxt",
        ]
        .contains(&name.as_str())
        {
            continue;
        }
        let m = prepared(&path);
        let g = &m.graph;
        let io = load_io(&path);
        let reference = ir::eval::run(g, &io.inputs, &Default::default()).unwrap();
        for (strategy, devices) in [("data", 2), ("model", 2), ("spatial", 2), ("spatial-hybrid:2x2", 4), ("model", 4)]
        {
            let named = Named::parse(strategy).unwrap();
            let Ok(mesh) = named.mesh(&c, devices) else { continue };
            let cm = CostModel::new(g, &c, mesh.clone(), Options::default());
            let Ok(asg) = passes::autoshard::named::assign(&cm, &named) else { continue };
            let pl = Placement {
                stages: vec![codegen::StagePlacement { mesh, devices: (0..devices).collect() }],
                strategies: asg.strategies,
                stage_of: Default::default(),
                micro_batches: 1,
                policy: cm.policy,
                schedule: Default::default(),
                recompute: Vec::new(),
                zero: 0,
            };
            let prog = codegen::lower(g, &pl).unwrap_or_else(|e| panic!("{name} {strategy}: {e}"));
            codegen::check(&prog).unwrap_or_else(|e| panic!("{name} {strategy}: {e:?}"));
            codegen::verify(g, &prog).unwrap_or_else(|e| panic!("{name} {strategy} on {devices}: not proved: {e}"));
            let r = codegen::run(&prog, &io.inputs, &RunOptions { backend: Backend::Wgpu, ..Default::default() })
                .unwrap_or_else(|e| panic!("{name} {strategy} on {devices}: {e}"));
            for ((out, got), want) in r.outputs.iter().zip(&reference) {
                compare(out, got, want, 1e-4, 1e-5).unwrap_or_else(|e| panic!("{name} {strategy} on {devices}: {e}"));
            }
            ran += 1;
        }
    }
    assert!(ran >= 15, "{ran}");
}

/// One-op models of many convolution geometries (1-, 2- and 3-d; groups, depthwise, strides,
/// dilations, asymmetric pads, bias; small reductions that take the direct kernel and large
/// ones that take im2col + GEMM) give the reference's outputs on the wgpu executor.
#[test]
fn convolutions_of_every_geometry_match_the_reference() {
    if !gpu_available() {
        return;
    }
    struct Case {
        op: &'static str,
        x: Vec<usize>,
        w: Vec<usize>,
        attrs: &'static str,
        bias: bool,
    }
    let c = |op, x: &[usize], w: &[usize], attrs, bias| Case { op, x: x.to_vec(), w: w.to_vec(), attrs, bias };
    let cases = [
        c("Conv", &[2, 3, 9, 9], &[4, 3, 3, 3], "pads: ints = [1, 1, 1, 1]", true),
        c("Conv", &[2, 8, 12, 10], &[16, 8, 3, 3], "pads: ints = [1, 0, 2, 1], strides: ints = [2, 1]", true),
        c("Conv", &[1, 8, 11, 11], &[8, 8, 3, 3], "dilations: ints = [2, 2], pads: ints = [2, 2, 2, 2]", false),
        c("Conv", &[2, 8, 10, 10], &[16, 4, 3, 3], "group: int = 2, pads: ints = [1, 1, 1, 1]", true),
        c("Conv", &[2, 8, 10, 10], &[8, 1, 3, 3], "group: int = 8, pads: ints = [1, 1, 1, 1]", true),
        c("Conv", &[2, 16, 7, 7], &[32, 16, 1, 1], "", false),
        // Few output positions per image: one GEMM per group over all images.
        c("Conv", &[3, 8, 4, 4], &[16, 4, 3, 3], "group: int = 2, pads: ints = [1, 1, 1, 1]", true),
        c("Conv", &[4, 32, 2, 3], &[8, 32, 3, 3], "pads: ints = [1, 0, 1, 2]", false),
        c("Conv", &[2, 6, 20], &[8, 6, 5], "strides: ints = [3], pads: ints = [2, 1]", true),
        c("Conv", &[1, 4, 6, 7, 8], &[8, 4, 3, 3, 3], "pads: ints = [1, 1, 1, 1, 1, 1]", true),
        c("Conv", &[1, 3, 15, 15], &[8, 3, 7, 7], "strides: ints = [2, 2], pads: ints = [3, 3, 3, 3]", false),
        c("ConvTranspose", &[2, 8, 5, 5], &[8, 4, 3, 3], "strides: ints = [2, 2], pads: ints = [1, 1, 1, 1]", true),
        c("ConvTranspose", &[1, 4, 6], &[4, 2, 4], "group: int = 2, strides: ints = [2]", false),
    ];
    let dims = |v: &[usize]| v.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(",");
    for (i, case) in cases.iter().enumerate() {
        let m_out = if case.op == "Conv" { case.w[0] } else { case.w[1] * attr_group(case.attrs) };
        let b_decl = if case.bias { format!(", float[{m_out}] b") } else { String::new() };
        let b_arg = if case.bias { ", b" } else { "" };
        let attrs = if case.attrs.is_empty() { String::new() } else { format!(" <{}>", case.attrs) };
        let text = format!(
            "<\n ir_version: 8,\n opset_import: [\"\" : 17]\n>\nc (float[{}] x, float[{}] w{b_decl}) => (y)\n{{\n y = {}{attrs} (x, w{b_arg})\n}}\n",
            dims(&case.x),
            dims(&case.w),
            case.op
        );
        let mut shapes = vec![("x", case.x.clone()), ("w", case.w.clone())];
        if case.bias {
            shapes.push(("b", vec![m_out]));
        }
        wgpu_matches_reference(&format!("case {i}"), &text, &shapes, 7, &["y"]);
    }
}

/// The convolution gradients (`ConvGradInput` as one GEMM per group and a col2im,
/// `ConvGradWeight` as im2col and one GEMM per group over all images; the direct kernels for
/// tiny reductions) give the reference's values on the wgpu executor, over 1-, 2- and 3-d
/// geometries with groups, depthwise, strides, dilations, asymmetric pads, one image or several.
#[test]
fn convolution_gradients_of_every_geometry_match_the_reference() {
    if !gpu_available() {
        return;
    }
    // (x, w, attrs): the forward convolution whose gradients are taken.
    let cases: [(&[usize], &[usize], &str); 11] = [
        (&[2, 3, 9, 9], &[4, 3, 3, 3], "pads: ints = [1, 1, 1, 1]"),
        (&[2, 8, 12, 10], &[16, 8, 3, 3], "pads: ints = [1, 0, 2, 1], strides: ints = [2, 1]"),
        (&[1, 8, 11, 11], &[8, 8, 3, 3], "dilations: ints = [2, 2], pads: ints = [2, 2, 2, 2]"),
        (&[2, 8, 10, 10], &[16, 4, 3, 3], "group: int = 2, pads: ints = [1, 1, 1, 1]"),
        (&[2, 8, 10, 10], &[8, 1, 3, 3], "group: int = 8, pads: ints = [1, 1, 1, 1]"),
        (&[2, 16, 7, 7], &[32, 16, 1, 1], ""),
        (&[3, 8, 4, 4], &[16, 4, 3, 3], "group: int = 2, pads: ints = [1, 1, 1, 1]"),
        (&[4, 32, 2, 3], &[8, 32, 3, 3], "pads: ints = [1, 0, 1, 2]"),
        (&[2, 6, 20], &[8, 6, 5], "strides: ints = [3], pads: ints = [2, 1]"),
        (&[1, 4, 6, 7, 8], &[8, 4, 3, 3, 3], "pads: ints = [1, 1, 1, 1, 1, 1], strides: ints = [1, 2, 1]"),
        (&[2, 3, 15, 15], &[8, 3, 7, 7], "strides: ints = [2, 2], pads: ints = [3, 3, 3, 3]"),
    ];
    let dims = |v: &[usize]| v.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ");
    for (i, (x, w, attrs)) in cases.iter().enumerate() {
        // The forward output's shape, from shape inference of the convolution itself.
        let sep = if attrs.is_empty() { "" } else { ", " };
        let fwd = format!(
            "<\n ir_version: 8,\n opset_import: [\"\" : 17]\n>\nc (float[{}] x, float[{}] w) => (y)\n{{\n y = Conv <kernel_shape: ints = [{}]{sep}{attrs}> (x, w)\n}}\n",
            dims(x),
            dims(w),
            dims(&w[2..])
        );
        let mut m = frontend::parse(&fwd).unwrap_or_else(|e| panic!("case {i}: {e:?}")).model;
        ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap();
        let y = m.graph.outputs()[0].value;
        let ydims: Vec<usize> =
            m.graph.tensor_type(y).unwrap().static_dims().unwrap().iter().map(|&d| d as usize).collect();
        let common = format!("kernel_shape: ints = [{}]{sep}{attrs}", dims(&w[2..]));
        let text = format!(
            "<\n ir_version: 8,\n opset_import: [\"\" : 18, \"shardc\" : 1]\n>\nc (float[{}] x, float[{}] w, float[{}] dy) => (dx, dw)\n{{\n dx = shardc.ConvGradInput <input_shape: ints = [{}], {common}> (dy, w)\n dw = shardc.ConvGradWeight <{common}> (x, dy)\n}}\n",
            dims(x),
            dims(w),
            dims(&ydims),
            dims(x)
        );
        let shapes = [("x", x.to_vec()), ("w", w.to_vec()), ("dy", ydims)];
        wgpu_matches_reference(&format!("case {i}"), &text, &shapes, 11, &["dx", "dw"]);
    }
}

/// Parses `text`, draws its inputs (`shapes`, seeded), runs it on one wgpu device and checks
/// that no op ran on the host and that each output named in `outputs` equals the reference's.
/// Training-mode batch normalization (the batch's statistics per channel, the running ones
/// updated with them) runs on the device, not the host, and gives the reference's output and
/// running statistics: 2-d, 3-d and 4-d inputs, the default and a given momentum, with and
/// without the running statistics asked for.
#[test]
fn training_batch_normalization_runs_on_the_device() {
    if !gpu_available() {
        return;
    }
    let cases: [(&[usize], &str, &str); 4] = [
        (&[4, 3, 5, 5], "", "y, rm, rv"),
        (&[2, 8, 6], "momentum: float = 0.5, ", "y, rm, rv"),
        (&[6, 4], "epsilon: float = 0.001, ", "y, rm, rv"),
        (&[3, 2, 4, 4], "", "y"),
    ];
    for (i, (x, attrs, outs)) in cases.iter().enumerate() {
        let c = x[1];
        let dims = |d: &[usize]| d.iter().map(|v| v.to_string()).collect::<Vec<_>>().join(",");
        let names: Vec<&str> = outs.split(", ").collect();
        let sig: Vec<String> = names
            .iter()
            .map(|n| if *n == "y" { format!("float[{}] y", dims(x)) } else { format!("float[{c}] {n}") })
            .collect();
        let text = format!(
            "<ir_version: 8, opset_import: [\"\" : 15]>\nbn (float[{}] x, float[{c}] s, float[{c}] b, float[{c}] m, float[{c}] v) => ({})\n{{\n   {outs} = BatchNormalization <{attrs}training_mode: int = 1> (x, s, b, m, v)\n}}\n",
            dims(x),
            sig.join(", ")
        );
        let shapes = [("x", x.to_vec()), ("s", vec![c]), ("b", vec![c]), ("m", vec![c]), ("v", vec![c])];
        wgpu_matches_reference(&format!("case {i}"), &text, &shapes, 5, &names);
    }
}

/// Runs `text` on one wgpu device and compares `outputs` with the reference; returns the
/// kernels the step dispatched (the CPU executor's run dispatches none).
fn wgpu_matches_reference(what: &str, text: &str, shapes: &[(&str, Vec<usize>)], seed: u64, outputs: &[&str]) -> u64 {
    let mut m = frontend::parse(text).unwrap_or_else(|e| panic!("{what}: {e:?}\n{text}")).model;
    ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap_or_else(|e| panic!("{what}: {e:?}"));
    let g = &m.graph;
    let inputs: std::collections::HashMap<String, ir::eval::Array> = shapes
        .iter()
        .map(|(name, s)| {
            let dims: Vec<i64> = s.iter().map(|&d| d as i64).collect();
            (name.to_string(), ir::eval::random_tensor(ir::DType::Float, &dims, "weight", seed, name).unwrap())
        })
        .collect();
    let reference = ir::eval::run(g, &inputs, &Default::default()).unwrap();
    let prog = codegen::lower(g, &Placement::single()).unwrap();
    let r = codegen::run(&prog, &inputs, &RunOptions { backend: Backend::Wgpu, ..Default::default() })
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(r.devices[0].host_ops.is_empty(), "{what} ran on the host: {:?}", r.devices[0].host_ops);
    let cpu = codegen::run(&prog, &inputs, &RunOptions { backend: Backend::Cpu, ..Default::default() }).unwrap();
    assert_eq!(cpu.devices[0].dispatches, 0, "{what}: the CPU executor dispatches no kernels");
    for (k, name) in outputs.iter().enumerate() {
        compare(name, &r.outputs[k].1, &reference[k], 1e-4, 1e-5).unwrap_or_else(|e| panic!("{what} ({text}): {e}"));
    }
    r.devices[0].dispatches
}

fn attr_group(attrs: &str) -> usize {
    attrs
        .split("group: int = ")
        .nth(1)
        .and_then(|s| s.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok())
        .unwrap_or(1)
}

/// Pipelined plans (two stages exchanging micro-batches by Send/Recv, data parallel within a
/// stage) on wgpu devices give the reference's outputs.
#[test]
fn pipelined_plans_run_on_wgpu_devices_and_match_the_reference() {
    use passes::autoshard::{PipelineMode, SearchOptions};
    if !gpu_available() {
        return;
    }
    let c = passes::cost::Cluster::preset("local-wgpu").unwrap();
    let mut ran = 0;
    for name in ["tiny_resnet.onnxtxt", "tiny_gpt.onnxtxt", "tiny_lstm_lm.onnxtxt"] {
        let Some(path) = data_files("golden").into_iter().find(|p| p.file_name().unwrap().to_string_lossy() == name)
        else {
            continue;
        };
        let m = prepared(&path);
        let g = &m.graph;
        let io = load_io(&path);
        let reference = ir::eval::run(g, &io.inputs, &Default::default()).unwrap();
        for devices in [2, 4] {
            let so = SearchOptions { pipeline: PipelineMode::Stages(2), ..Default::default() };
            let r = passes::autoshard::search(g, &c, devices, &Default::default(), &so).unwrap();
            assert!(r.pipeline.is_some(), "{name}: no pipeline on {devices}");
            let prog = shardc::exec::program_for_search(g, &r, devices).unwrap();
            codegen::check(&prog).unwrap_or_else(|e| panic!("{name}: {e:?}"));
            let proof = shardc::exec::proof_graph(g, &prog).unwrap_or_else(|e| panic!("{name}: {e}"));
            codegen::verify(&proof, &prog).unwrap_or_else(|e| panic!("{name} pipelined on {devices}: not proved: {e}"));
            let out = codegen::run(&prog, &io.inputs, &RunOptions { backend: Backend::Wgpu, ..Default::default() })
                .unwrap_or_else(|e| panic!("{name} on {devices}: {e}"));
            for ((o, got), want) in out.outputs.iter().zip(&reference) {
                compare(o, got, want, 1e-4, 1e-5).unwrap_or_else(|e| panic!("{name} pipelined on {devices}: {e}"));
            }
            ran += 1;
        }
    }
    assert!(ran >= 6, "{ran}");
}

/// Reductions longer than an adapter runs loops for (lavapipe stops every shader after
/// 65535 loop iterations, silently): a language model's loss over its vocabulary, sums,
/// softmaxes and log-sum-exps over 40 000–70 000 elements, forward and gradient, equal the
/// reference (on lavapipe these ops run on the host; elsewhere on their kernels).
/// GEMMs with reductions long enough to be split into chunks whose partial products are
/// summed (`codegen::runtime::gpu::gemm::SPLIT_K_FROM`): reductions that are no multiple of
/// the chunk, outputs that are no multiple of the 32×32 tile, a `Gemm` with a transposed
/// operand, `alpha` and a bias (added once, after the chunks), a batch folded into rows over
/// a shared B — each equal to the reference — and beside them a batched long reduction and a
/// short one, computed without chunks.
#[test]
fn gemms_with_long_reductions_split_them_and_match_the_reference() {
    if !gpu_available() {
        return;
    }
    const { assert!(codegen::runtime::gpu::gemm::SPLIT_K_FROM < 8300) };
    let text = r#"<ir_version: 8, opset_import: ["" : 17]>
g (float[37,9001] a, float[9001,45] b, float[45,8500] wt, float[45] c, float[2,33,8300] x, float[8300,20] w, float[2,5,8300] p, float[2,8300,7] q, float[9,20] s, float[20,11] t) => (y, z, u, v, r) {
  y = MatMul (a, b)
  st = Constant <value = int64[1] {0}> ()
  en = Constant <value = int64[1] {8500}> ()
  ax = Constant <value = int64[1] {1}> ()
  a8500 = Slice (a, st, en, ax)
  z = Gemm <transB = 1, alpha = 0.5, beta = 2.0> (a8500, wt, c)
  u = MatMul (x, w)
  v = MatMul (p, q)
  r = MatMul (s, t)
}
"#;
    let shapes = [
        ("a", vec![37, 9001]),
        ("b", vec![9001, 45]),
        ("wt", vec![45, 8500]),
        ("c", vec![45]),
        ("x", vec![2, 33, 8300]),
        ("w", vec![8300, 20]),
        ("p", vec![2, 5, 8300]),
        ("q", vec![2, 8300, 7]),
        ("s", vec![9, 20]),
        ("t", vec![20, 11]),
    ];
    wgpu_matches_reference("long reductions", text, &shapes, 11, &["y", "z", "u", "v", "r"]);
}

/// GEMMs on the kernel for adapters with a fixed subgroup size (`gemm::gemm_sg_src`: lavapipe's
/// 8-lane subgroups): rows that are no multiple of a subgroup or of a workgroup's 64, fewer
/// columns than a subgroup's lanes cover and more than one workgroup's, a batch with a
/// broadcast operand, a shared B folded into rows, `Gemm` with `alpha`, `beta` and a bias per
/// column and per element, a transposed B (also of columns of no multiple of 4, with a bias),
/// a transposed A (of rows spanning two workgroups), both, and operands it reads element by
/// element (a reduction and columns of no multiple of 4, a transposed A of no multiple of 4
/// rows) — each equal to the reference. On lavapipe the subgroup kernel is the one that runs.
#[test]
fn gemms_on_subgroups_match_the_reference() {
    if !gpu_available() {
        return;
    }
    let text = r#"<ir_version: 8, opset_import: ["" : 17]>
g (float[5,8] a, float[8,4] b, float[70,12] c, float[12,36] d, float[2,3,20,16] e, float[2,1,16,12] f, float[3,7,16] h, float[16,8] w, float[67,20] x, float[20,44] y, float[44] bias, float[67,44] full, float[6,10] p, float[10,5] q, float[9,8] r, float[12,8] s, float[12,6] u, float[8,12] v, float[12,8] w2, float[12,20] x2, float[16,68] w3, float[12,16] x3, float[13,20] s2, float[13] b2) => (o1, o2, o3, o4, o5, o6, o7, o8, o9, o10, o11, o12) {
  o1 = MatMul (a, b)
  o2 = MatMul (c, d)
  o3 = MatMul (e, f)
  o4 = MatMul (h, w)
  o5 = Gemm <alpha = 0.5, beta = 2.0> (x, y, bias)
  o6 = Gemm <alpha = 1.5, beta = 0.25> (x, y, full)
  o7 = MatMul (p, q)
  o8 = Gemm <transB = 1> (r, s)
  o9 = Gemm <transA = 1, transB = 1> (u, v)
  o10 = Gemm <transA = 1> (w2, x2)
  o11 = Gemm <transA = 1, transB = 1, alpha = 0.75> (w3, x3)
  o12 = Gemm <transB = 1, beta = 0.5> (x, s2, b2)
}
"#;
    let shapes = [
        ("a", vec![5, 8]),
        ("b", vec![8, 4]),
        ("c", vec![70, 12]),
        ("d", vec![12, 36]),
        ("e", vec![2, 3, 20, 16]),
        ("f", vec![2, 1, 16, 12]),
        ("h", vec![3, 7, 16]),
        ("w", vec![16, 8]),
        ("x", vec![67, 20]),
        ("y", vec![20, 44]),
        ("bias", vec![44]),
        ("full", vec![67, 44]),
        ("p", vec![6, 10]),
        ("q", vec![10, 5]),
        ("r", vec![9, 8]),
        ("s", vec![12, 8]),
        ("u", vec![12, 6]),
        ("v", vec![8, 12]),
        ("w2", vec![12, 8]),
        ("x2", vec![12, 20]),
        ("w3", vec![16, 68]),
        ("x3", vec![12, 16]),
        ("s2", vec![13, 20]),
        ("b2", vec![13]),
    ];
    let dispatches = wgpu_matches_reference(
        "subgroup GEMMs",
        text,
        &shapes,
        13,
        &["o1", "o2", "o3", "o4", "o5", "o6", "o7", "o8", "o9", "o10", "o11", "o12"],
    );
    assert!(dispatches >= 12, "one kernel per GEMM at least, each counted: {dispatches}");
    use codegen::runtime::Executor as _;
    let exec = codegen::runtime::gpu::GpuExecutor::new().unwrap();
    if exec.name().contains("llvmpipe") {
        assert_eq!(exec.subgroup(), Some(8), "{}: lavapipe's subgroups at 256 bits", exec.name());
    }
}

#[test]
fn reductions_longer_than_the_adapters_loop_limit_match_the_reference() {
    if !gpu_available() {
        return;
    }
    let text = r#"<ir_version: 8, opset_import: ["" : 17]>
g (float[2,3,40000] x, int64[2,3] labels, float[1,70000] z) => (loss, s, lse, sm, dsm, lp) {
  shape = Constant <value = int64[2] {-1, 40000}> ()
  flat = Constant <value = int64[1] {-1}> ()
  scores = Reshape (x, shape)
  ls = Reshape (labels, flat)
  loss = SoftmaxCrossEntropyLoss <reduction = "mean"> (scores, ls)
  s = ReduceSum <keepdims = 0> (z)
  lse = ReduceLogSumExp <keepdims = 0> (z)
  sm = Softmax <axis = 1> (z)
  dsm = shardc.SoftmaxGrad <axes = [1]> (sm, z)
  lp = LogSoftmax <axis = -1> (scores)
}
"#;
    let mut m = frontend::parse(text).unwrap_or_else(|e| panic!("{e:?}")).model;
    ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap_or_else(|e| panic!("{e:?}"));
    let g = &m.graph;
    let mut inputs = std::collections::HashMap::new();
    for (name, dims) in [("x", vec![2, 3, 40000]), ("z", vec![1, 70000])] {
        inputs.insert(name.to_string(), ir::eval::random_tensor(ir::DType::Float, &dims, "weight", 3, name).unwrap());
    }
    let labels = ir::eval::Array::int(ir::DType::Int64, vec![2, 3], vec![0, 39999, 17, 20000, 5, 31000]);
    inputs.insert("labels".to_string(), labels);
    let reference = ir::eval::run(g, &inputs, &Default::default()).unwrap();
    let prog = codegen::lower(g, &Placement::single()).unwrap();
    let r = codegen::run(&prog, &inputs, &RunOptions { backend: Backend::Wgpu, ..Default::default() }).unwrap();
    for (k, (name, got)) in r.outputs.iter().enumerate() {
        compare(name, got, &reference[k], 1e-4, 1e-6)
            .unwrap_or_else(|e| panic!("{e} (host ops {:?})", r.devices[0].host_ops));
    }
    eprintln!("adapter {}; ran on the host: {:?}", r.devices[0].adapter, r.devices[0].host_ops);
}

/// A softmax loss over a vocabulary (50 257 classes: a serial loop per sample would pass the
/// adapter's loop limit) runs on the device: each sample's log-sum-exp from chunks of classes
/// found in parallel. Its value, log-probabilities and gradient equal the reference, with
/// `mean`, `sum` and `none` reductions, class weights, an ignored label, scores with a
/// trailing dim, and classes whose scores are all −∞ in one chunk.
#[test]
fn a_loss_over_a_vocabulary_runs_on_the_device_in_chunks() {
    if !gpu_available() {
        return;
    }
    let text = r#"<ir_version: 8, opset_import: ["" : 17, "shardc" : 1]>
g (float[3,50257] x, int64[3] labels, float[1] d1, float[2,700,3] y, int64[2,3] ly, float[700] w) => (loss, lp, dx, sy, dy, ny) {
  dl = ReduceSum <keepdims = 0> (d1)
  loss, lp = SoftmaxCrossEntropyLoss <reduction = "mean"> (x, labels)
  dx = shardc.SoftmaxCrossEntropyLossGrad <reduction = "mean"> (dl, x, labels)
  sy = SoftmaxCrossEntropyLoss <reduction = "sum", ignore_index = 4> (y, ly, w)
  dy = shardc.SoftmaxCrossEntropyLossGrad <reduction = "sum", ignore_index = 4> (dl, y, ly, w)
  ny = SoftmaxCrossEntropyLoss <reduction = "none"> (y, ly)
}
"#;
    let mut m = frontend::parse(text).unwrap_or_else(|e| panic!("{e:?}")).model;
    ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap_or_else(|e| panic!("{e:?}"));
    let g = &m.graph;
    let mut inputs = std::collections::HashMap::new();
    for (name, dims) in [("x", vec![3, 50257]), ("d1", vec![1]), ("w", vec![700])] {
        inputs.insert(name.to_string(), ir::eval::random_tensor(ir::DType::Float, &dims, "weight", 7, name).unwrap());
    }
    // The first sample's classes 256–511 (one whole chunk) are −∞: that chunk adds nothing.
    let mut y = ir::eval::random_tensor(ir::DType::Float, &[2, 700, 3], "weight", 7, "y").unwrap().to_f64().unwrap();
    for c in 256..512 {
        for j in 0..3 {
            y[c * 3 + j] = f64::NEG_INFINITY;
        }
    }
    inputs.insert("y".to_string(), ir::eval::Array::float(ir::DType::Float, vec![2, 700, 3], y));
    inputs.insert("labels".to_string(), ir::eval::Array::int(ir::DType::Int64, vec![3], vec![0, 50256, 31000]));
    inputs.insert("ly".to_string(), ir::eval::Array::int(ir::DType::Int64, vec![2, 3], vec![4, 699, 17, 255, 600, 4]));
    let reference = ir::eval::run(g, &inputs, &Default::default()).unwrap();
    let prog = codegen::lower(g, &Placement::single()).unwrap();
    let r = codegen::run(&prog, &inputs, &RunOptions { backend: Backend::Wgpu, ..Default::default() }).unwrap();
    assert!(r.devices[0].host_ops.is_empty(), "ran on the host: {:?}", r.devices[0].host_ops);
    for (k, (name, got)) in r.outputs.iter().enumerate() {
        compare(name, got, &reference[k], 1e-4, 1e-6).unwrap_or_else(|e| panic!("{e}"));
    }
}

/// A sum, mean, max, min or product over axes of extent 1 is its input: the compiler makes it
/// a view (no kernel), and its values equal the reference's; a sum of squares over one element
/// and a sum over two still run kernels.
#[test]
fn reductions_over_one_element_are_views_of_their_input() {
    let text = r#"<ir_version: 8, opset_import: ["" : 17]>
g (float[3,1,4] x, float[2,5] z) => (s, m, mx, mn, p, sq, two) {
  ax = Constant <value = int64[1] {1}> ()
  a0 = Constant <value = int64[1] {0}> ()
  s = ReduceSum <keepdims = 0> (x, ax)
  m = ReduceMean (x, ax)
  mx = ReduceMax <keepdims = 0> (x, ax)
  mn = ReduceMin (x, ax)
  p = ReduceProd <keepdims = 0> (x, ax)
  sq = ReduceSumSquare <keepdims = 0> (x, ax)
  two = ReduceSum <keepdims = 0> (z, a0)
}
"#;
    let mut m = frontend::parse(text).unwrap_or_else(|e| panic!("{e:?}")).model;
    let consts = ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap().consts;
    let g = &m.graph;
    for n in g.op_nodes().unwrap() {
        let op = &g.node(n).op;
        if !op.op_type().starts_with("Reduce") {
            continue;
        }
        let c = codegen::runtime::gpu::compile::compile(op, &compile_cx(g, n, &consts)).unwrap().unwrap();
        let name = g.value_name(ir::Value::new(n, 0)).to_string();
        let view = c.launches().count() == 0 && c.outputs[0].view_of == Some(0);
        assert_eq!(view, !matches!(name.as_str(), "sq" | "two"), "{name}: {} launches", c.launches().count());
        // The cost model's reading of the same node (what it prices as nothing).
        let dims = g.tensor_type(g.node(n).input(0).unwrap()).unwrap().static_dims().unwrap();
        let axes = ir::ops::reduce::single_element_axes(g, n);
        assert_eq!(view, axes.is_some_and(|a| a.iter().all(|&a| dims[a] == 1)), "{name}");
    }
    if !gpu_available() {
        return;
    }
    wgpu_matches_reference(
        "one-element reductions",
        text,
        &[("x", vec![3, 1, 4]), ("z", vec![2, 5])],
        4,
        &["s", "m", "mx", "mn", "p", "sq", "two"],
    );
}

#[test]
fn constants_are_made_once_not_on_the_host_every_step() {
    if !gpu_available() {
        return;
    }
    // A Constant op's value never changes: the runtime makes and uploads it with the
    // parameters, instead of running it on the host (no kernel makes constants) each step.
    let text = r#"<ir_version: 8, opset_import: ["" : 17]>
k (float[2,3] x) => (y)
{
  c = Constant <value: tensor = float[3] {1.0, 2.0, 3.0}> ()
  y = Add (x, c)
}
"#;
    let mut m = frontend::parse(text).unwrap_or_else(|e| panic!("{e:?}")).model;
    ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap_or_else(|e| panic!("{e:?}"));
    let x = ir::eval::Array::f32(vec![2, 3], vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    let inputs = std::collections::HashMap::from([("x".to_string(), x)]);
    let prog = codegen::lower(&m.graph, &Placement::single()).unwrap();
    let opts = RunOptions { backend: Backend::Wgpu, steps: 3, ..Default::default() };
    let r = codegen::run(&prog, &inputs, &opts).unwrap();
    assert!(r.devices[0].host_ops.is_empty(), "ran on the host: {:?}", r.devices[0].host_ops);
    let want = ir::eval::Array::f32(vec![2, 3], vec![1.0, 3.0, 5.0, 4.0, 6.0, 8.0]);
    compare("y", &r.outputs[0].1, &want, 0.0, 0.0).unwrap();
}

#[test]
fn freed_buffers_are_reused_and_dispatches_past_one_dimension_reach_every_element() {
    if !gpu_available() {
        return;
    }
    use codegen::runtime::Executor;
    use codegen::runtime::gpu::GpuExecutor;
    // 65536 groups of 64 and one more element: more groups than one dispatch dimension holds.
    let n = 65536 * 64 + 1;
    let mut e = GpuExecutor::new().unwrap();
    let (m, node) =
        shardc::calibrate::one_op(&format!("(float[{n}] a, float[{n}] b) => (y)"), "y = Add (a, b)").unwrap();
    let a = ir::eval::Array::f32(vec![n], (0..n).map(|i| (i % 1000) as f32).collect());
    let b = ir::eval::Array::f32(vec![n], (0..n).map(|i| (i / 1000) as f32).collect());
    let (ta, tb) = (e.upload(&a).unwrap(), e.upload(&b).unwrap());
    let (outs, _) = e.run(&m.graph, node, &[Some(&ta), Some(&tb)], &[]).unwrap();
    let y = e.download(&outs[0]).unwrap().to_f64().unwrap();
    let bad = (0..n).find(|&i| y[i] != ((i % 1000) + i / 1000) as f64);
    assert_eq!(bad, None, "element {bad:?} of {n} not written");
    // Dropped, its buffer waits for the next output of its size, which overwrites it whole.
    assert_eq!(e.pooled_bytes(), 0);
    drop(outs);
    assert_eq!(e.pooled_bytes(), 4 * n as u64);
    let (outs, _) = e.run(&m.graph, node, &[Some(&tb), Some(&tb)], &[]).unwrap();
    assert_eq!(e.pooled_bytes(), 0, "the freed buffer was not reused");
    let y = e.download(&outs[0]).unwrap().to_f64().unwrap();
    let bad = (0..n).find(|&i| y[i] != (2 * (i / 1000)) as f64);
    assert_eq!(bad, None, "element {bad:?} of the reused buffer holds an old value");
}

/// An upload into a freed buffer lands after the work already encoded that read the
/// buffer's old contents (a queue write would land before it: the pipeline stages' stashed
/// micro-batches came back overwritten by the next micro-batch's received tensors).
#[test]
fn an_upload_into_a_freed_buffer_waits_for_the_work_that_read_it() {
    if !gpu_available() {
        return;
    }
    use codegen::runtime::Executor;
    use codegen::runtime::gpu::GpuExecutor;
    let n = 4096;
    let mut e = GpuExecutor::new().unwrap();
    let (m, node) =
        shardc::calibrate::one_op(&format!("(float[{n}] a, float[{n}] b) => (y)"), "y = Add (a, b)").unwrap();
    let a = ir::eval::Array::f32(vec![n], (0..n).map(|i| i as f32).collect());
    let ones = ir::eval::Array::f32(vec![n], vec![1.0; n]);
    let (ta, tb) = (e.upload(&a).unwrap(), e.upload(&ones).unwrap());
    // Encoded, not yet submitted: y = a + 1 reads `a`'s buffer.
    let (outs, _) = e.run(&m.graph, node, &[Some(&ta), Some(&tb)], &[]).unwrap();
    drop(ta);
    // The next upload of that size takes `a`'s buffer.
    let big = ir::eval::Array::f32(vec![n], vec![1.0e6; n]);
    let _t = e.upload(&big).unwrap();
    assert_eq!(e.pooled_bytes(), 0, "the freed buffer was not reused");
    let y = e.download(&outs[0]).unwrap().to_f64().unwrap();
    let bad = (0..n).find(|&i| y[i] != i as f64 + 1.0);
    assert_eq!(bad, None, "element {bad:?}: {:?}, the later upload's value", bad.map(|i| y[i]));
}

/// The kernels the runtime compiles for a convolution and its two gradients are the kernels
/// the cost model prices (`ir::ops::conv::launches`): im2col + GEMM (+ a permutation of the
/// images for few positions, + dY regrouped for several images in the gradients), or one direct
/// kernel each for small reductions or few filters.
#[test]
fn convolutions_launch_the_kernels_the_cost_model_prices() {
    // (x, w, pads): GEMM path with several images; few positions (wide); one image; a 1×1
    // kernel over 3 channels (direct); two filters per group (direct); and GEMMs whose
    // reduction is split into a second dispatch (`ir::ops::contraction::gemm_dispatches`):
    // the weight gradient's over 2 × 96² positions, the forward's over 1024 × 9 taps, the
    // input gradient's over 9000 filters.
    type Case<'a> = (&'a [i64], &'a [i64], i64, [f64; 3]);
    let cases: [Case<'_>; 8] = [
        (&[2, 3, 8, 8], &[8, 3, 3, 3], 1, [2.0, 3.0, 3.0]),
        (&[2, 8, 4, 4], &[8, 8, 3, 3], 1, [3.0, 3.0, 3.0]),
        (&[1, 8, 8, 8], &[8, 8, 3, 3], 1, [2.0, 2.0, 2.0]),
        (&[2, 3, 8, 8], &[8, 3, 1, 1], 0, [1.0, 1.0, 1.0]),
        (&[2, 16, 8, 8], &[2, 16, 3, 3], 1, [1.0, 1.0, 1.0]),
        (&[2, 8, 96, 96], &[8, 8, 3, 3], 1, [2.0, 3.0, 4.0]),
        (&[1, 1024, 4, 4], &[8, 1024, 3, 3], 1, [3.0, 2.0, 2.0]),
        (&[1, 16, 4, 4], &[9000, 16, 3, 3], 1, [2.0, 3.0, 2.0]),
    ];
    let dims = |d: &[i64]| d.iter().map(|v| v.to_string()).collect::<Vec<_>>().join(",");
    for (x, w, pad, want) in cases {
        let text = format!(
            r#"<ir_version: 8, opset_import: ["" : 17]>
g (float[{}] x) => (float loss)
   <float[{}] w = ["location": "w.bin", "offset": "0", "length": "{}"], float[{},4,1,1] w0 = ["location": "w.bin", "offset": "0", "length": "{}"]>
{{
   xs = Conv (x, w0)
   y = Conv <pads: ints = [{pad}, {pad}, {pad}, {pad}]> (xs, w)
   sq = Mul (y, y)
   loss = ReduceMean <keepdims: int = 0> (sq)
}}"#,
            dims(&[x[0], 4, x[2], x[3]]),
            dims(w),
            4 * w.iter().product::<i64>(),
            x[1],
            16 * x[1]
        );
        let m = frontend::parse(&text).unwrap_or_else(|e| panic!("{e:?}")).model;
        let opt = passes::autodiff::OptimizerSpec::sgd(0.1, 0.0);
        let (mut t, _) = shardc::train::training_model(&m, &passes::autodiff::LossSpec::Model, &opt).unwrap();
        let consts = ir::infer::infer_shapes(&mut t.graph, ir::infer::Mode::Check).unwrap().consts;
        let g = &t.graph;
        let mut seen = Vec::new();
        for n in g.op_nodes().unwrap() {
            let op = &g.node(n).op;
            // The convolution by `w` (not the 1×1 one in front of it making its input).
            let w_value = g.lookup("w").unwrap();
            let out_dims = g.tensor_type(ir::Value::new(n, 0)).and_then(|t| t.static_dims());
            let which = match op {
                ir::Op::Conv(_) if g.node(n).input(1) == Some(w_value) => 0,
                ir::Op::ConvGradInput(_) if g.node(n).input(1) == Some(w_value) => 1,
                ir::Op::ConvGradWeight(_) if out_dims.as_deref() == Some(w) => 2,
                _ => continue,
            };
            let c = codegen::runtime::gpu::compile::compile(op, &compile_cx(g, n, &consts)).unwrap().unwrap();
            assert_eq!(c.launches().count() as f64, want[which], "{x:?} * {w:?}: {}", op.op_type());
            let y: Vec<i64> = match which {
                0 => g.tensor_type(ir::Value::new(n, 0)).unwrap().static_dims().unwrap(),
                _ => g
                    .tensor_type(g.node(n).input(if which == 1 { 0 } else { 1 }).unwrap())
                    .unwrap()
                    .static_dims()
                    .unwrap(),
            };
            assert_eq!(ir::ops::conv::launches_of(x, w, &y, 1), Some(want), "{x:?} * {w:?}");
            seen.push(which);
        }
        seen.sort();
        assert_eq!(seen, [0, 1, 2], "{x:?} * {w:?}: the training graph's convolutions");
    }
}

/// A model of element-wise chains (a tanh GELU written out, a residual, a gated product, a
/// comparison and a cast) behind a MatMul; `loss` its mean square.
fn element_wise_chains() -> String {
    let vals =
        |n: usize, k: usize| (0..n).map(|i| format!("{:.3}", ((i * k) % 17) as f32 / 17.0 - 0.5)).collect::<Vec<_>>();
    format!(
        r#"<ir_version: 8, opset_import: ["" : 17]>
g (float[8,16] x) => (float[8,16] z, float loss)
   <float[16,16] w = {{{}}}, float[16] b = {{{}}}>
{{
   c1 = Constant <value_float: float = 0.044715> ()
   c2 = Constant <value_float: float = 0.7978846> ()
   one = Constant <value_float: float = 1.0> ()
   half = Constant <value_float: float = 0.5> ()
   zero = Constant <value_float: float = 0.0> ()
   h = MatMul (x, w)
   a = Add (h, b)
   a2 = Mul (a, a)
   a3 = Mul (a2, a)
   t1 = Mul (a3, c1)
   t2 = Add (a, t1)
   t3 = Mul (t2, c2)
   t4 = Tanh (t3)
   t5 = Add (t4, one)
   t6 = Mul (a, t5)
   ge = Mul (t6, half)
   r = Add (ge, x)
   s = Sigmoid (r)
   q = Mul (s, r)
   m = Greater (q, zero)
   mf = Cast <to: int = 1> (m)
   z = Mul (q, mf)
   sq = Mul (z, z)
   loss = ReduceMean <keepdims: int = 0> (sq)
}}"#,
        vals(256, 7).join(", "),
        vals(16, 5).join(", ")
    )
}

/// Element-wise chains run as one kernel each: the forward values, and a training step's
/// losses and parameters, are those of the ops run one by one, in fewer dispatches.
#[test]
fn element_wise_chains_run_fused_with_the_values_of_the_ops_one_by_one() {
    if !gpu_available() {
        return;
    }
    let mut m = frontend::parse(&element_wise_chains()).unwrap_or_else(|e| panic!("{e:?}")).model;
    ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap();
    let x = ir::eval::random_tensor(ir::DType::Float, &[8, 16], "weight", 3, "x").unwrap();
    let inputs: std::collections::HashMap<String, ir::eval::Array> = [("x".to_string(), x)].into();
    let reference = ir::eval::run(&m.graph, &inputs, &Default::default()).unwrap();
    let prog = codegen::lower(&m.graph, &Placement::single()).unwrap();
    let run = |fusion: bool| {
        codegen::run(&prog, &inputs, &RunOptions { backend: Backend::Wgpu, fusion, steps: 2, ..Default::default() })
            .unwrap()
    };
    let (fused, alone) = (run(true), run(false));
    for ((f, a), want) in fused.outputs.iter().zip(&alone.outputs).zip(&reference) {
        compare("fused vs alone", &f.1, &a.1, 1e-6, 1e-7).unwrap();
        compare("fused vs reference", &f.1, want, 1e-4, 1e-5).unwrap();
    }
    let (f, a) = (fused.devices[0].dispatches, alone.devices[0].dispatches);
    // Forward only: everything after the MatMul is one group, less than half the kernels.
    assert!(2 * f <= a, "{f} dispatches fused, {a} alone");
    assert!(fused.devices[0].by_op.contains_key("Fused"), "{:?}", fused.devices[0].by_op);

    // A training step: the backward part's chains fuse as well.
    let opt = passes::autodiff::OptimizerSpec::sgd(0.1, 0.0);
    let (mut t, info) =
        shardc::train::training_model(&m, &passes::autodiff::LossSpec::Output("loss".into()), &opt).unwrap();
    ir::infer::infer_shapes(&mut t.graph, ir::infer::Mode::Check).unwrap();
    let inputs = shardc::train::seeded_inputs(&t.graph, &info, 4).unwrap();
    let prog = codegen::lower(&t.graph, &Placement::single()).unwrap();
    let train = |fusion: bool| {
        let opts = RunOptions {
            backend: Backend::Wgpu,
            fusion,
            steps: 3,
            carry: info.state.iter().map(|(s, n)| (s.clone(), n.clone())).collect(),
            every_step: vec![info.loss.clone()],
            ..Default::default()
        };
        codegen::run(&prog, &inputs, &opts).unwrap()
    };
    let (fused, alone) = (train(true), train(false));
    for (step, (f, a)) in fused.per_step.iter().zip(&alone.per_step).enumerate() {
        let loss = |s: &Vec<(String, ir::eval::Array)>| s.iter().find(|(n, _)| *n == info.loss).unwrap().1.clone();
        compare(&format!("loss of step {step}"), &loss(f), &loss(a), 1e-6, 1e-7).unwrap();
    }
    for ((name, f), (_, a)) in fused.outputs.iter().zip(&alone.outputs) {
        compare(name, f, a, 1e-5, 1e-6).unwrap();
    }
    let (f, a) = (fused.devices[0].dispatches, alone.devices[0].dispatches);
    // The forward values the backward part reads are written by the forward groups.
    assert!(3 * f <= 2 * a, "training: {f} dispatches fused, {a} alone");
}
