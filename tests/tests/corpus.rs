//! Every shared model: parses, verifies, infers shapes consistently with ONNX's own
//! `value_info`, and prints back byte for byte.

use shardc_tests::*;

#[test]
fn every_model_round_trips_exactly() {
    for path in data_files("models").into_iter().chain(data_files("golden")) {
        let text = std::fs::read_to_string(&path).unwrap();
        let model = load_model(&path);
        let printed = ir::print::model_to_string(&model);
        if printed != text {
            let line = printed.lines().zip(text.lines()).position(|(a, b)| a != b).map_or(0, |l| l + 1);
            panic!("{}: printing differs from the source at line {line}", path.display());
        }
        // Canonical: printing a reparse gives the same text.
        let again = frontend::parse(&printed).expect("printed text parses");
        assert_eq!(ir::print::model_to_string(&again.model), printed, "{}", path.display());
    }
}

#[test]
fn every_model_verifies() {
    for path in data_files("models").into_iter().chain(data_files("golden")) {
        let model = load_model(&path);
        if let Err(e) = ir::verify(&model.graph) {
            panic!("{}: {:?}", path.display(), e.0);
        }
    }
}

#[test]
fn shape_inference_agrees_with_onnx_value_info() {
    let mut failures = Vec::new();
    for path in data_files("models").into_iter().chain(data_files("golden")) {
        let mut model = load_model(&path);
        match ir::infer::infer_shapes(&mut model.graph, ir::infer::Mode::Check) {
            Ok(report) => {
                // One real export declares its 3-D output as a scalar; that is the only
                // contradiction between ONNX's value_info and shardc in the corpus.
                for w in &report.warnings {
                    if !w.msg.contains("`fetch_name_0` is declared as float, but inferred float[d0,?,18385]") {
                        failures.push(format!("{}: {}", path.display(), w.msg));
                    }
                }
            }
            Err(errs) => failures.extend(errs.iter().map(|e| format!("{}: {}", path.display(), e.msg))),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn shape_inference_from_scratch_finds_every_shape_of_static_models() {
    let mut failures = Vec::new();
    for path in data_files("models").into_iter().chain(data_files("golden")) {
        let mut model = load_model(&path);
        let g = &mut model.graph;
        let static_inputs = g.input_values().iter().all(|&v| g.tensor_type(v).is_some_and(|t| t.is_static()));
        // Keep what ONNX wrote, infer from nothing, compare.
        let declared: Vec<(ir::Value, Option<ir::Type>)> = g
            .op_nodes()
            .unwrap()
            .into_iter()
            .flat_map(|n| (0..g.node(n).num_outputs()).map(move |s| ir::Value::new(n, s as u16)))
            .map(|v| (v, g.value_type(v).cloned()))
            .collect();
        if let Err(errs) = ir::infer::infer_shapes(g, ir::infer::Mode::Reset) {
            failures.extend(errs.iter().map(|e| format!("{}: {}", path.display(), e.msg)));
            continue;
        }
        for (v, decl) in declared {
            if g.value_name(v).is_empty() {
                continue;
            }
            let inferred = g.tensor_type(v);
            if static_inputs && !inferred.is_some_and(|t| t.is_static()) {
                failures.push(format!(
                    "{}: `{}` not fully inferred: {:?}",
                    path.display(),
                    g.value_name(v),
                    inferred.map(|t| t.to_string())
                ));
            }
            if let (Some(ir::Type::Tensor(d)), Some(i)) = (decl, inferred) {
                let agree = d.dtype == i.dtype
                    && match (&d.dims, &i.dims) {
                        (Some(a), Some(b)) => {
                            a.len() == b.len()
                                && a.iter().zip(b).all(|(x, y)| match (x.value(), y.value()) {
                                    (Some(p), Some(q)) => p == q,
                                    _ => true,
                                })
                        }
                        _ => true,
                    };
                if !agree {
                    failures.push(format!("{}: `{}` declared {d}, inferred {i}", path.display(), g.value_name(v)));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} problems:\n{}", failures.len(), failures[..failures.len().min(40)].join("\n"));
}

#[test]
fn stats_match_the_published_counts() {
    let mut checked = 0;
    for path in data_files("models") {
        let stats_path = path.parent().unwrap().join("stats").join(path.file_name().unwrap()).with_extension("json");
        let Ok(text) = std::fs::read_to_string(&stats_path) else { continue };
        let expected: serde_json::Value = serde_json::from_str(&text).unwrap();
        let mut model = load_model(&path);
        ir::infer::infer_shapes(&mut model.graph, ir::infer::Mode::Check).unwrap();
        let s = ir::cost::compute_stats(&model.graph).expect("stats");
        let name = path.display();
        assert_eq!(s.params, expected["params"].as_u64().unwrap(), "{name}: params");
        assert_eq!(s.float_params, expected["float_params"].as_u64().unwrap(), "{name}: float_params");
        assert_eq!(s.nodes as u64, expected["nodes_top"].as_u64().unwrap(), "{name}: nodes");
        for (op, count) in expected["op_counts"].as_object().unwrap() {
            let got = s.op_counts.iter().find(|(k, _)| k == op).map_or(0, |(_, c)| *c);
            assert_eq!(got as u64, count.as_u64().unwrap(), "{name}: {op} count");
        }
        let static_inputs =
            model.graph.input_values().iter().all(|&v| model.graph.tensor_type(v).is_some_and(|t| t.is_static()));
        if static_inputs {
            assert!(
                s.forward_flops > 0.0 && s.unknown_shapes == 0,
                "{name}: FLOPs {} with {} unknown shapes",
                s.forward_flops,
                s.unknown_shapes
            );
        }
        checked += 1;
    }
    assert!(checked >= 18, "only {checked} models have stats");
}
