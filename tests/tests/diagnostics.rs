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
