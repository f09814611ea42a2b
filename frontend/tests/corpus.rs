//! Quick corpus round trip used while developing the frontend.
use std::path::Path;

#[test]
fn corpus_round_trips_exactly() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data");
    let mut failures = Vec::new();
    for dir in ["models", "golden"] {
        for e in std::fs::read_dir(root.join(dir)).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_none_or(|x| x != "onnxtxt") {
                continue;
            }
            let text = std::fs::read_to_string(&p).unwrap();
            match shardc_frontend::parse(&text) {
                Ok(parsed) => {
                    let printed = ir::print::model_to_string(&parsed.model);
                    if printed != text {
                        let line = printed.lines().zip(text.lines()).position(|(a, b)| a != b);
                        failures.push(format!("{}: differs at line {:?}", p.display(), line.map(|l| l + 1)));
                        if let Some(l) = line {
                            let a = printed.lines().nth(l).unwrap();
                            let b = text.lines().nth(l).unwrap();
                            let c = a.chars().zip(b.chars()).position(|(x, y)| x != y).unwrap_or(a.len().min(b.len()));
                            failures.push(format!("  printed: {}", &a[c.saturating_sub(80)..(c + 80).min(a.len())]));
                            failures.push(format!("  source:  {}", &b[c.saturating_sub(80)..(c + 80).min(b.len())]));
                        }
                    }
                }
                Err(d) => failures.push(format!("{}: {}", p.display(), shardc_frontend::render(&d, "x", &text))),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
