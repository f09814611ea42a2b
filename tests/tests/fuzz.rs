//! Thousands of random mutations of real model text: the frontend, verifier, shape inference
//! and canonicalization must answer every one with a result or an error, never a panic.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Instant;

use ir::eval::Rng;
use shardc_tests::*;

/// Characters that matter to the grammar, to mutate with.
const ALPHABET: &[u8] = b"()[]{}<>,:=@?.-\"#\\ \n0123456789abcdefxyzINFnan_";

fn mutate(text: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut t = text.to_vec();
    let n = 1 + (rng.next_u64() % 4) as usize;
    for _ in 0..n {
        if t.is_empty() {
            break;
        }
        let at = (rng.next_u64() % t.len() as u64) as usize;
        match rng.next_u64() % 7 {
            0 => {
                let len = ((rng.next_u64() % 16) as usize).min(t.len() - at);
                t.drain(at..at + len);
            }
            1 => {
                let c = ALPHABET[(rng.next_u64() % ALPHABET.len() as u64) as usize];
                t.insert(at, c);
            }
            2 => {
                let c = ALPHABET[(rng.next_u64() % ALPHABET.len() as u64) as usize];
                t[at] = c;
            }
            3 => t.truncate(at),
            4 => {
                let len = ((rng.next_u64() % 64) as usize).min(t.len() - at);
                let piece: Vec<u8> = t[at..at + len].to_vec();
                let to = (rng.next_u64() % t.len() as u64) as usize;
                t.splice(to..to, piece);
            }
            5 => {
                // Digits to other numbers: shapes, attribute values, tensor sizes.
                if t[at].is_ascii_digit() {
                    t[at] = b"0123456789"[(rng.next_u64() % 10) as usize];
                }
            }
            _ => t.insert(at, (rng.next_u64() & 0xff) as u8),
        }
    }
    t
}

fn exercise(bytes: &[u8]) {
    let Ok(text) = frontend::decode(bytes) else { return };
    let Ok(parsed) = frontend::parse(text) else { return };
    let mut model = parsed.model;
    let _ = ir::print::model_to_string(&model);
    if ir::verify(&model.graph).is_err() {
        return;
    }
    let mut pm = passes::PassManager::new();
    pm.add(passes::InferShapes::default()).add(passes::Canonicalize);
    let _ = pm.run(&mut model);
}

#[test]
fn random_mutations_never_panic() {
    let mut sources: Vec<Vec<u8>> = data_files("golden").iter().map(|p| std::fs::read(p).unwrap()).collect();
    for name in ["tv_alexnet.onnxtxt", "pt_lstm_lm.onnxtxt", "hf_gpt2_small4.onnxtxt", "magika_standard_v3_3.onnxtxt"] {
        let p = data_files("models").into_iter().find(|p| p.file_name().unwrap() == name).unwrap();
        sources.push(std::fs::read(p).unwrap());
    }
    let mut rng = Rng::new(20261121);
    let start = Instant::now();
    let mut count = 0;
    for i in 0..n_iter() {
        let src = &sources[i % sources.len()];
        let input = mutate(src, &mut rng);
        let t0 = Instant::now();
        let r = catch_unwind(AssertUnwindSafe(|| exercise(&input)));
        if r.is_err() {
            let path = std::env::temp_dir().join(format!("shardc-fuzz-{i}.onnxtxt"));
            std::fs::write(&path, &input).unwrap();
            panic!("mutation {i} panicked; input saved to {}", path.display());
        }
        // No input may take long: a hang would show here long before CI's limit.
        assert!(t0.elapsed().as_secs() < 20, "mutation {i} took {:?}", t0.elapsed());
        count += 1;
    }
    eprintln!("{count} mutations in {:?}", start.elapsed());
}

/// 6,000 by default; `SHARDC_FUZZ_ITERS` runs more.
fn n_iter() -> usize {
    std::env::var("SHARDC_FUZZ_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(6000)
}

/// Binary mutations of binary `.onnx` models (bytes flipped, dropped, duplicated, varints
/// changed): the protobuf reader and everything after it answer with a result or an error.
fn exercise_binary(bytes: &[u8]) {
    let Ok((parsed, _)) = frontend::parse_binary(bytes) else { return };
    let mut model = parsed.model;
    let _ = ir::print::model_to_string(&model);
    let _ = frontend::onnx::to_bytes(&model);
    if ir::verify(&model.graph).is_err() {
        return;
    }
    let mut pm = passes::PassManager::new();
    pm.add(passes::InferShapes::default()).add(passes::Canonicalize);
    let _ = pm.run(&mut model);
}

fn mutate_binary(bytes: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut t = bytes.to_vec();
    let n = 1 + (rng.next_u64() % 3) as usize;
    for _ in 0..n {
        if t.is_empty() {
            break;
        }
        let at = (rng.next_u64() % t.len() as u64) as usize;
        match rng.next_u64() % 5 {
            0 => t[at] ^= 1 << (rng.next_u64() % 8),
            1 => t[at] = (rng.next_u64() & 0xff) as u8,
            2 => {
                let len = ((rng.next_u64() % 8) as usize).min(t.len() - at);
                t.drain(at..at + len);
            }
            3 => t.truncate(at),
            _ => {
                // A large varint where a small one was: counts, dims, lengths.
                t.splice(at..at, [0xff, 0xff, 0xff, 0xff, 0x0f]);
            }
        }
    }
    t
}

#[test]
fn random_binary_mutations_never_panic() {
    let dir = repo_root().join("tests/data/onnx");
    let sources: Vec<Vec<u8>> =
        ["tiny_mlp.onnx", "conv2d_basic.onnx", "lstm_small.onnx", "tv_alexnet.onnx", "shape_ops.onnx"]
            .iter()
            .map(|n| std::fs::read(dir.join(n)).unwrap_or_else(|e| panic!("{n}: {e}")))
            .collect();
    let mut rng = Rng::new(20261124);
    for i in 0..n_iter() / 2 {
        let input = mutate_binary(&sources[i % sources.len()], &mut rng);
        let t0 = Instant::now();
        if catch_unwind(AssertUnwindSafe(|| exercise_binary(&input))).is_err() {
            let path = std::env::temp_dir().join(format!("shardc-fuzz-{i}.onnx"));
            std::fs::write(&path, &input).unwrap();
            panic!("binary mutation {i} panicked; input saved to {}", path.display());
        }
        assert!(t0.elapsed().as_secs() < 20, "binary mutation {i} took {:?}", t0.elapsed());
    }
}
