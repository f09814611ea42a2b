//! Malformed inputs: each gives a rendered diagnostic with file:line:col, the source line and
//! a caret (for binary `.onnx` inputs, the field path inside the protobuf). The expected text is in `tests/diagnostics/NAME.stderr`; run with `BLESS=1` to
//! rewrite the expectations after an intended change.

use std::path::Path;

use pretty_assertions::assert_eq;

#[test]
fn malformed_inputs_render_as_expected() {
    let dir = Path::new("diagnostics");
    let bless = std::env::var_os("BLESS").is_some();
    let mut cases: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "onnxtxt" || x == "onnx"))
        .collect();
    cases.sort();
    assert!(cases.len() >= 25, "only {} diagnostic cases", cases.len());
    let mut mismatches = Vec::new();
    for path in &cases {
        let got = match shardc::load_and_check(path) {
            Ok(_) => panic!("{} was accepted", path.display()),
            Err(rendered) => rendered,
        };
        assert!(got.starts_with("error"), "{}: {got}", path.display());
        assert!(got.contains(&format!("{}:", path.display())), "{}: no file:line:col in\n{got}", path.display());
        let expected_path = path.with_extension("stderr");
        if bless {
            std::fs::write(&expected_path, &got).unwrap();
            continue;
        }
        let expected = std::fs::read_to_string(&expected_path).unwrap_or_default();
        if expected != got {
            mismatches.push((path.display().to_string(), expected, got));
        }
    }
    for (name, expected, got) in &mismatches {
        eprintln!("--- {name}");
        assert_eq!(expected, got, "{name} (re-bless with BLESS=1 if the change is intended)");
    }
}

/// The deepest input the nesting check lets through parses, lowers and prints on a thread
/// with a 2 MiB stack (Rust's default for spawned threads): nested types, and nested `If`
/// subgraphs (whose `=>` closes no bracket), each one bracket short of the limit. One more
/// bracket is refused with a diagnostic.
#[test]
fn the_deepest_accepted_nesting_parses_on_a_small_stack() {
    let max = frontend::parse::MAX_NESTING;
    let header = "<ir_version: 8, opset_import: [\"\" : 17]>\n";
    // `seq(` × k inside the input list's `(`.
    let types = |k: usize| {
        format!(
            "{header}g ({}float{} x) => (float y) {{ y = Constant <value = float {{1}}> () }}",
            "seq(".repeat(k),
            ")".repeat(k)
        )
    };
    // Each If level opens `<` and `{` (its signature's parentheses close again): the body
    // `{` of the graph is depth 1.
    let ifs = |levels: usize| {
        let mut body = String::from("y = Identity (x)");
        for k in 0..levels {
            body = format!(
                "y = If (c) <then_branch = t{k} () => (float y) {{ {body} }}, else_branch = e{k} () => (float y) {{ y = Identity (x) }}>"
            );
        }
        format!("{header}g (float x, bool c) => (float y) {{ {body} }}")
    };
    let cases =
        vec![(types(max - 1), true), (types(max), false), (ifs((max - 1) / 2), true), (ifs(max / 2 + 1), false)];
    std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(move || {
            for (text, ok) in cases {
                match frontend::parse(&text) {
                    Ok(p) => {
                        assert!(ok, "accepted nesting beyond the limit");
                        let printed = ir::print::model_to_string(&p.model);
                        assert!(!printed.is_empty());
                    }
                    Err(d) => {
                        assert!(!ok, "refused: {}", frontend::render(&d, "deep", &text));
                        assert!(d.iter().any(|d| d.message.contains("nested more than")), "{d:?}");
                    }
                }
            }
        })
        .unwrap()
        .join()
        .expect("no stack overflow");
}
