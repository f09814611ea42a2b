//! Shared by the benches.

/// A model with some inputs re-shaped (`rebatch`), shapes inferred, canonicalized when
/// `canonical` (a training graph keeps the parameters as the model names them), and its
/// weights inline: read from the external data beside it, else drawn from seed 0.
pub fn prepare(path: &str, shapes: &[(&str, &[i64])], canonical: bool) -> shardc::ir::Model {
    let mut m = shardc::load_model(std::path::Path::new(path)).expect("model loads").model;
    let mut pm = shardc::passes::PassManager::new();
    let dir = std::path::Path::new(path).parent().unwrap_or(std::path::Path::new("."));
    if !shapes.is_empty() {
        // Constants in external data change with the new dims: read, or drawn where the file
        // is absent (as `shardc train --input-shape` does).
        let spec = shardc::passes::RebatchSpec {
            batch: None,
            input_shapes: shapes.iter().map(|(n, s)| (n.to_string(), s.to_vec())).collect(),
            external: shardc::passes::ExternalData::Read(shardc::exec::external_reader(dir)),
            ..Default::default()
        };
        pm.add(shardc::passes::Rebatch { spec });
    }
    pm.add(shardc::passes::InferShapes::default());
    if canonical {
        pm.add(shardc::passes::Canonicalize);
    }
    pm.run(&mut m).expect("passes run");
    shardc::exec::materialize(&mut m, dir, 0).expect("weights");
    m
}
