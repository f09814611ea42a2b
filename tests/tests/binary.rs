//! Binary ONNX: every bundled text model, converted to `.onnx` by the `onnx` package itself
//! (`scripts/convert-to-onnx.py`: `onnx.parser.parse_model` + `onnx.save`, in
//! tests/data/onnx/), reads to the same graph as its text and prints byte for byte the same
//! text; what shardc writes reads back to the same graph; external data is read from its file
//! only when values are needed, at its offset, and a file larger than 4 GiB works.

use std::path::Path;

use shardc_tests::*;

fn binary_of(text_path: &Path) -> std::path::PathBuf {
    let name = text_path.file_stem().unwrap().to_string_lossy().to_string();
    repo_root().join("tests/data/onnx").join(format!("{name}.onnx"))
}

fn bundled() -> Vec<std::path::PathBuf> {
    let mut all = Vec::new();
    for kind in ["models", "golden", "golden-train"] {
        for e in std::fs::read_dir(repo_root().join("tests/data").join(kind)).unwrap().flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "onnxtxt") {
                all.push(p);
            }
        }
    }
    all.sort();
    all
}

#[test]
fn onnx_written_binaries_read_as_their_text() {
    let cases = bundled();
    assert!(cases.len() >= 40, "{} bundled models", cases.len());
    for text_path in cases {
        let from_text = load_model(&text_path);
        let bin = binary_of(&text_path);
        let bytes =
            std::fs::read(&bin).unwrap_or_else(|e| panic!("{}: {e} (run scripts/convert-to-onnx.py)", bin.display()));
        assert!(frontend::onnx::is_binary(&bytes));
        let (parsed, _) = frontend::parse_binary(&bytes).unwrap_or_else(|(d, l)| {
            panic!("{}: {}", bin.display(), frontend::diag::render_binary(&d, &bin.display().to_string(), &l))
        });
        if let Some(d) = from_text.graph.difference(&parsed.model.graph) {
            panic!("{}: the binary reads to another graph: {d}", bin.display());
        }
        let (a, b) = (ir::print::model_to_string(&from_text), ir::print::model_to_string(&parsed.model));
        assert!(a == b, "{}: prints differently from its text", bin.display());
        // And shardc's own writer: written, read back, the same graph and text.
        let again = frontend::parse_binary(&frontend::onnx::to_bytes(&parsed.model)).unwrap_or_else(|(d, _)| {
            panic!("{}: shardc's own output does not read: {:?}", bin.display(), d.first().map(|d| &d.message))
        });
        assert!(
            from_text.graph.difference(&again.0.model.graph).is_none(),
            "{}: write → read changes the graph",
            bin.display()
        );
        assert_eq!(ir::print::model_to_string(&again.0.model), a, "{}", bin.display());
    }
}

/// A model whose weights are in an external file: planning reads only the model; running
/// reads each tensor's bytes at its offset, also past 4 GiB into a (sparse) file.
#[test]
fn external_data_is_read_at_its_offset_and_only_when_needed() {
    let dir = std::env::temp_dir().join(format!("shardc-external-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let weights: Vec<f32> = (0..12).map(|i| i as f32 * 0.25 - 1.0).collect();
    let bias: Vec<f32> = vec![0.5, -0.5, 1.5];
    let far: u64 = (1 << 32) + 4096;
    {
        use std::io::{Seek, SeekFrom, Write};
        let mut f = std::fs::File::create(dir.join("w.bin")).unwrap();
        f.seek(SeekFrom::Start(64)).unwrap();
        f.write_all(&weights.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>()).unwrap();
        f.seek(SeekFrom::Start(far)).unwrap();
        f.write_all(&bias.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>()).unwrap();
    }
    let text = format!(
        "<ir_version: 8, opset_import: [\"\" : 17]>\n\
         g (float[2,4] x) => (float[2,3] y)\n\
         <float[4,3] w = [\"location\": \"w.bin\", \"offset\": \"64\", \"length\": \"48\"], \
          float[3] b = [\"location\": \"w.bin\", \"offset\": \"{far}\", \"length\": \"12\"]>\n\
         {{ h = MatMul (x, w)\n y = Add (h, b) }}"
    );
    let m = frontend::parse(&text).unwrap().model;
    let path = dir.join("m.onnx");
    std::fs::write(&path, frontend::onnx::to_bytes(&m)).unwrap();
    let mut loaded = shardc::load_model(&path).expect("loads").model;
    assert!(
        loaded.graph.node_ids().any(|n| matches!(&loaded.graph.node(n).op, ir::Op::Initializer(t) if t.is_external()))
    );
    let w = shardc::exec::materialize(&mut loaded, &dir, 0).unwrap();
    assert_eq!(w.loaded, 2);
    let x = ir::eval::Array::f32(vec![2, 4], vec![1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0]);
    let out = ir::eval::run(&loaded.graph, &[("x".to_string(), x)].into_iter().collect(), &Default::default()).unwrap();
    let y = out[0].to_f32().unwrap();
    // Row 0 picks w's first row; row 1 sums its second and third rows; plus the far bias.
    let want: Vec<f32> =
        (0..3).map(|j| weights[j] + bias[j]).chain((0..3).map(|j| weights[3 + j] + weights[6 + j] + bias[j])).collect();
    assert_eq!(y, want);
    // A length that does not match the tensor is an error naming it, not a silent draw.
    let bad = text.replace("\"length\": \"12\"", "\"length\": \"16\"");
    let mut m = frontend::parse(&bad).unwrap().model;
    let err = shardc::exec::materialize(&mut m, &dir, 0).unwrap_err();
    assert!(err.contains("`b`") && err.contains("length"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The optimizer state of weights that are not loaded is a fill (zeros, held as one value):
/// a training graph of a model whose weights are absent holds no state data. Run, it is the
/// zeros it stands for; written as ONNX, it is written out as its values.
#[test]
fn optimizer_state_of_absent_weights_is_a_fill() {
    let text = "<ir_version: 8, opset_import: [\"\" : 17]>\n\
         g (float[2,4] x) => (float[2,3] y)\n\
         <float[4,3] w = [\"location\": \"absent.bin\"]>\n\
         { y = MatMul (x, w) }";
    let m = frontend::parse(text).unwrap().model;
    let loss = passes::autodiff::LossSpec::Mean(None);
    let opt = passes::autodiff::OptimizerSpec::adam(0.01);
    let (tm, _) = shardc::train::training_model(&m, &loss, &opt).unwrap();
    let g = &tm.graph;
    let states: Vec<&ir::Tensor> = ["w__exp_avg", "w__exp_avg_sq"]
        .iter()
        .map(|n| g.initializer(g.lookup(n).unwrap_or_else(|| panic!("no `{n}`"))).unwrap())
        .collect();
    for t in &states {
        assert_eq!((t.fill(), t.dims.clone(), t.host_bytes()), (Ok(Some(0.0)), vec![4, 3], 0));
    }
    // Made inline for a run: zeros (the weight itself drawn from the seed).
    let mut run = tm.clone();
    let w = shardc::exec::materialize(&mut run, std::path::Path::new("/nonexistent"), 0).unwrap();
    assert_eq!((w.loaded, w.seeded), (0, 1), "the fills are made, the weight is drawn");
    let g = &run.graph;
    let state = g.initializer(g.lookup("w__exp_avg").unwrap()).unwrap();
    assert_eq!(ir::eval::Array::from_tensor(state).unwrap().to_f32().unwrap(), vec![0.0; 12]);
    // Written as ONNX: the values, not shardc's description.
    let back = frontend::parse_binary(&frontend::onnx::to_bytes(&tm)).unwrap_or_else(|_| panic!("reads")).0.model;
    let g = &back.graph;
    let state = g.initializer(g.lookup("w__exp_avg_sq").unwrap()).unwrap();
    assert!(!state.is_external());
    assert_eq!(ir::eval::Array::from_tensor(state).unwrap().to_f32().unwrap(), vec![0.0; 12]);
}
