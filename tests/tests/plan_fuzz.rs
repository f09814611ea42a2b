//! Mutated plan documents into what reads them (`shardc lower` and `shardc run --plan`):
//! reading the plan, fitting it to the model, lowering, checking and running the program
//! must answer every mutation with a result or an error, never a panic. Mutations are of the
//! JSON values (numbers to negative, zero, huge or fractional; strings renamed; keys
//! dropped; arrays shortened or grown; values of one kind put in place of another) and of
//! the text (truncated, bytes changed), so they reach past the JSON parser.

use std::panic::{AssertUnwindSafe, catch_unwind};

use ir::eval::Rng;
use passes::autoshard::{self, PipelineMode, Plan, SearchOptions};
use passes::cost::{Cluster, Options};
use serde_json::Value as Json;
use shardc_tests::*;

fn model(name: &str, batch: i64) -> ir::Model {
    let mut m = load_model(&repo_root().join("tests/data/golden").join(name));
    let mut pm = passes::PassManager::new();
    pm.add(passes::Verify)
        .add(passes::Rebatch { spec: passes::RebatchSpec { batch: Some(batch), ..Default::default() } })
        .add(passes::InferShapes::default())
        .add(passes::Canonicalize);
    pm.run(&mut m).unwrap_or_else(|e| panic!("{name}: {e}"));
    m
}

fn plan_json(g: &ir::Graph, devices: usize, pipeline: PipelineMode) -> Json {
    let c = Cluster::preset("local-wgpu").unwrap();
    let so = SearchOptions { pipeline, ..Default::default() };
    let r = autoshard::search(g, &c, devices, &Options::default(), &so).unwrap();
    serde_json::to_value(Plan::new(g, &c, devices, &Options::default(), Default::default(), &r)).unwrap()
}

/// Every value of a JSON document, by path, so one can be picked at random.
fn paths(v: &Json, at: &mut Vec<Vec<Json>>, here: &mut Vec<Json>) {
    at.push(here.clone());
    match v {
        Json::Object(o) => {
            for (k, x) in o {
                here.push(Json::String(k.clone()));
                paths(x, at, here);
                here.pop();
            }
        }
        Json::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                here.push(Json::from(i));
                paths(x, at, here);
                here.pop();
            }
        }
        _ => {}
    }
}

fn get_mut<'a>(v: &'a mut Json, path: &[Json]) -> Option<&'a mut Json> {
    let mut cur = v;
    for p in path {
        cur = match p {
            Json::String(k) => cur.as_object_mut()?.get_mut(k)?,
            Json::Number(i) => cur.as_array_mut()?.get_mut(i.as_u64()? as usize)?,
            _ => return None,
        };
    }
    Some(cur)
}

fn pick<T: Clone>(xs: &[T], rng: &mut Rng) -> T {
    xs[(rng.next_u64() % xs.len() as u64) as usize].clone()
}

fn mutate_value(doc: &mut Json, rng: &mut Rng) {
    let mut all = Vec::new();
    paths(doc, &mut all, &mut Vec::new());
    let path = pick(&all, rng);
    // Dropping a key or an element needs the parent.
    if rng.next_u64().is_multiple_of(6)
        && let Some((last, parent)) = path.split_last()
        && let Some(p) = get_mut(doc, parent)
    {
        match (p, last) {
            (Json::Object(o), Json::String(k)) => {
                o.remove(k);
            }
            (Json::Array(a), Json::Number(i)) => {
                a.remove(i.as_u64().unwrap() as usize);
            }
            _ => {}
        }
        return;
    }
    let Some(v) = get_mut(doc, &path) else { return };
    let numbers = [
        Json::from(-1),
        Json::from(0),
        Json::from(1),
        Json::from(2),
        Json::from(3),
        Json::from(7),
        Json::from(1u64 << 40),
        Json::from(u64::MAX),
        Json::from(i64::MIN),
        Json::from(0.5),
        Json::from(-1e300),
    ];
    *v = match (v.clone(), rng.next_u64() % 4) {
        (Json::Number(_), 0..=2) => pick(&numbers, rng),
        (Json::String(s), 0 | 1) => Json::String(pick(
            &[String::new(), format!("{s}x"), "d0".into(), "S(9)".into(), "P".into(), "inter".into(), "R".into()],
            rng,
        )),
        (Json::Array(mut a), 0) if !a.is_empty() => {
            a.truncate((rng.next_u64() % a.len() as u64) as usize);
            Json::Array(a)
        }
        (Json::Array(mut a), 1) if !a.is_empty() => {
            let x = pick(&a, rng);
            a.push(x);
            Json::Array(a)
        }
        (Json::Array(mut a), 2) if a.len() > 1 => {
            let last = a.len() - 1;
            a.swap(0, last);
            Json::Array(a)
        }
        _ => pick(
            &[
                Json::Null,
                Json::Bool(true),
                Json::from(-2),
                Json::String("?".into()),
                Json::Array(vec![]),
                Json::Object(Default::default()),
            ],
            rng,
        ),
    };
}

fn mutate_text(text: &str, rng: &mut Rng) -> String {
    let mut b = text.as_bytes().to_vec();
    let at = (rng.next_u64() % b.len() as u64) as usize;
    if rng.next_u64().is_multiple_of(2) {
        b.truncate(at);
    } else {
        b[at] = b"0123456789-.,\"[]{}:e"[(rng.next_u64() % 20) as usize];
    }
    String::from_utf8_lossy(&b).into_owned()
}

/// What `shardc lower` and `shardc run --plan` do with a plan document; a panic propagates.
fn exercise(g: &ir::Graph, text: &str, inputs: &std::collections::HashMap<String, ir::eval::Array>) -> &'static str {
    let Ok(plan) = Plan::from_json(text) else { return "unreadable" };
    let _ = plan.mesh();
    let _ = plan.stage_meshes();
    let _ = autoshard::plan::stage_report(&plan);
    let _ = shardc::report::timeline_svg(&plan);
    let Ok(program) = shardc::exec::program_for_plan(g, &plan) else { return "does not lower" };
    if codegen::check(&program).is_err() {
        return "inconsistent";
    }
    let opts = codegen::RunOptions { backend: codegen::Backend::Cpu, ..Default::default() };
    match codegen::run(&program, inputs, &opts) {
        Ok(_) => "runs",
        Err(_) => "run fails",
    }
}

#[test]
fn mutated_plans_are_errors_not_panics() {
    // A fixed seed, another with SHARDC_PROPTEST_SEED=N, a fresh one with `random`.
    let seed = match std::env::var("SHARDC_PROPTEST_SEED").ok().as_deref() {
        Some("random") => std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64,
        Some(n) => n.parse().unwrap_or(19),
        None => 19,
    };
    eprintln!("plan_fuzz seed {seed}");
    let mut rng = Rng::new(seed);
    let mut outcomes: std::collections::BTreeMap<&str, usize> = Default::default();
    let mut panics = Vec::new();
    for (name, devices, pipeline, cases) in [
        ("tiny_mlp.onnxtxt", 4, PipelineMode::Off, 300),
        ("tiny_resnet.onnxtxt", 2, PipelineMode::Off, 150),
        ("tiny_gpt.onnxtxt", 4, PipelineMode::Stages(2), 150),
    ] {
        let m = model(name, 4);
        let g = &m.graph;
        let doc = plan_json(g, devices, pipeline);
        let inputs = shardc::exec::inputs_for(g, None, 0).unwrap();
        // The unmutated plan runs.
        assert_eq!(exercise(g, &doc.to_string(), &inputs), "runs", "{name}");
        for i in 0..cases {
            let text = if i % 5 == 4 {
                mutate_text(&serde_json::to_string_pretty(&doc).unwrap(), &mut rng)
            } else {
                let mut d = doc.clone();
                for _ in 0..1 + rng.next_u64() % 3 {
                    mutate_value(&mut d, &mut rng);
                }
                d.to_string()
            };
            match catch_unwind(AssertUnwindSafe(|| exercise(g, &text, &inputs))) {
                Ok(o) => *outcomes.entry(o).or_default() += 1,
                Err(e) => {
                    let msg = e
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    panics.push(format!("{name} case {i}: {msg}\n{text}"));
                }
            }
        }
    }
    eprintln!("outcomes: {outcomes:?}");
    assert!(panics.is_empty(), "{} panics; first:\n{}", panics.len(), panics[0]);
    // The mutations reach past the parser: some plans lower and run, some are refused later.
    assert!(outcomes.get("runs").copied().unwrap_or(0) > 0, "{outcomes:?}");
    assert!(outcomes.get("does not lower").copied().unwrap_or(0) > 0, "{outcomes:?}");
}
