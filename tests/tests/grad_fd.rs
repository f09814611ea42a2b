//! Every gradient rule against central finite differences in float64.
//!
//! Each op's sample (`shardc_tests::samples`) is turned into a float64 graph whose float
//! inputs become parameters (initializers drawn in `[0.1, 0.9]`), with the loss
//! `Σ_outputs ReduceSum(y · r)` for a random `r` per float output. The autodiff pass builds
//! the training graph; the reference evaluator runs it; each parameter's gradient is
//! compared with `(L(p + h) − L(p − h)) / 2h` at sampled elements. Ops without a rule must
//! be exactly those listed in [`NO_RULE`]. A second test draws random shapes and attributes
//! for the ops whose rules have the most geometry (convolutions, pools, contractions,
//! normalizations, gathers, slices, recurrences).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use ir::eval::{Array, Rng};
use ir::{DType, Graph, GraphOutput, Op, TensorType, Value, op};
use passes::autodiff::{LossSpec, OptimizerSpec, autodiff};
use passes::train::Trainer;
use shardc_tests::samples::samples;

/// Ops whose samples have a float path to an output but no gradient rule, and why.
const NO_RULE: &[(&str, &str)] = &[
    ("AllGather", "communication: inserted by the lowering, after autodiff"),
    ("AllReduce", "communication: inserted by the lowering, after autodiff"),
    ("AllToAll", "communication: inserted by the lowering, after autodiff"),
    ("HaloExchange", "communication: inserted by the lowering, after autodiff"),
    ("ReduceScatter", "communication: inserted by the lowering, after autodiff"),
    ("AveragePoolGrad", "a gradient op: training needs no second derivatives"),
    ("BatchNormGrad", "a gradient op: training needs no second derivatives"),
    ("ConvGradInput", "a gradient op: training needs no second derivatives"),
    ("ConvGradWeight", "a gradient op: training needs no second derivatives"),
    ("ElementwiseGrad", "a gradient op: training needs no second derivatives"),
    ("GatherGrad", "a gradient op: training needs no second derivatives"),
    ("MoEGrad", "a gradient op: training needs no second derivatives"),
    ("AttentionGrad", "a gradient op: training needs no second derivatives"),
    ("AttentionBlock", "ring attention's step: inserted by the lowering, after autodiff"),
    ("MoEDispatch", "the all-to-all dispatcher's send buffer: inserted by the lowering, after autodiff"),
    ("MoECombine", "the all-to-all dispatcher's combine: inserted by the lowering, after autodiff"),
    ("LayerNormGrad", "a gradient op: training needs no second derivatives"),
    ("MaxPoolGrad", "a gradient op: training needs no second derivatives"),
    ("NegativeLogLikelihoodLossGrad", "a gradient op: training needs no second derivatives"),
    ("RecurrentGrad", "a gradient op: training needs no second derivatives"),
    ("SliceGrad", "a gradient op: training needs no second derivatives"),
    ("RoiAlignGrad", "a gradient op: training needs no second derivatives"),
    ("SoftmaxCrossEntropyLossGrad", "a gradient op: training needs no second derivatives"),
    ("SoftmaxGrad", "a gradient op: training needs no second derivatives"),
    ("OneHot", "its float operand is a pair of constants in practice"),
    ("Loop", "control flow: subgraphs are not differentiated"),
    ("DynamicQuantizeLinear", "quantization: a step function of its input"),
    ("Scan", "control flow: subgraphs are not differentiated"),
];

/// Ops whose samples are skipped here, and why.
const SKIP: &[(&str, &str)] = &[
    ("Send", "communication: run by the runtime"),
    ("Recv", "communication: run by the runtime"),
    ("SgdUpdate", "an optimizer step, checked against torch by the golden training cases"),
    ("AdamUpdate", "an optimizer step, checked against torch by the golden training cases"),
];

/// The outcome for one model.
enum Outcome {
    /// Gradients checked: how many elements.
    Checked(usize),
    /// No parameter reaches the loss through a float path.
    NothingToCheck,
    /// Autodiff reported a missing rule for this op type.
    NoRule(String),
}

/// `text` with float32 types made float64 (LayerNormalization's statistics included).
fn to_f64(text: &str) -> String {
    text.replace("float[", "double[")
        .replace("float ", "double ")
        .replace("LayerNormalization <", "LayerNormalization <stash_type: int = 11, ")
}

fn draw(rng: &mut Rng, dtype: DType, dims: &[usize]) -> Array {
    let n = dims.iter().product();
    Array::float(dtype, dims.to_vec(), (0..n).map(|_| rng.uniform(0.1, 0.9)).collect())
}

/// Makes every float graph input an initializer, appends `Σ ReduceSum(y · r)` and the
/// training graph; returns it with the values for the `r` inputs.
/// A training graph and the values of its `r` inputs.
type Case = (Graph, HashMap<String, Array>);

fn training_graph(mut g: Graph, seed: u64) -> Result<Option<Case>, String> {
    ir::infer::infer_shapes(&mut g, ir::infer::Mode::Check).map_err(|e| format!("{e:?}"))?;
    let mut rng = Rng::new(seed);
    for v in g.input_values() {
        if !matches!(g.node(v.node).op, Op::Input { default: None }) {
            continue;
        }
        let t = g.tensor_type(v).ok_or("untyped input")?.clone();
        if !t.dtype.is_float() {
            continue;
        }
        let dims: Vec<usize> = t.static_dims().ok_or("dynamic input")?.iter().map(|&d| d as usize).collect();
        let name = g.value_name(v).to_string();
        g.rename(v, format!("{name}__was_input"));
        let p = g.add_initializer(name, draw(&mut rng, t.dtype, &dims).to_tensor());
        g.replace_all_uses(v, p);
        g.remove_node(v.node);
    }
    let mut terms = Vec::new();
    let mut feeds = HashMap::new();
    let outs: Vec<Value> = g.outputs().iter().map(|o| o.value).collect();
    for (k, y) in outs.into_iter().enumerate() {
        let Some(t) = g.tensor_type(y).cloned() else { continue };
        if !t.dtype.is_float() {
            continue;
        }
        let dims: Vec<i64> = t.static_dims().ok_or("dynamic output")?.to_vec();
        let rname = format!("fd__r{k}");
        let r = g.add_input(rname.clone(), Some(ir::Type::Tensor(TensorType::fixed(t.dtype, &dims))));
        feeds.insert(rname, draw(&mut rng, t.dtype, &dims.iter().map(|&d| d as usize).collect::<Vec<_>>()));
        let m = g.add_simple(Op::Mul(op::Mul::default()), &[y, r], format!("fd__m{k}"));
        let s = g.add_simple(
            Op::ReduceSum(op::ReduceSum { keepdims: Some(0), ..Default::default() }),
            &[m],
            format!("fd__s{k}"),
        );
        terms.push(s);
    }
    if terms.is_empty() {
        return Ok(None);
    }
    let loss = if terms.len() == 1 { terms[0] } else { g.add_simple(Op::Sum(op::Sum::default()), &terms, "fd__loss") };
    g.set_outputs(vec![GraphOutput { value: loss, ty: None }]);
    ir::infer::infer_shapes(&mut g, ir::infer::Mode::Check).map_err(|e| format!("{e:?}"))?;
    match autodiff(&mut g, &LossSpec::Model, &OptimizerSpec::sgd(0.0, 0.0)) {
        Ok(_) => Ok(Some((g, feeds))),
        Err(e) if e.iter().any(|l| l.msg.contains("nothing to train")) => Ok(None),
        Err(e) => Err(e.into_iter().map(|l| l.msg).collect::<Vec<_>>().join("; ")),
    }
}

/// Compares the gradients of `g` with central differences at up to `per_param` elements of
/// each parameter.
fn check(g: Graph, seed: u64, per_param: usize) -> Result<Outcome, String> {
    let (g, feeds) = match training_graph(g, seed) {
        Ok(Some(x)) => x,
        Ok(None) => return Ok(Outcome::NothingToCheck),
        Err(e) if e.contains("has no gradient rule") => return Ok(Outcome::NoRule(e)),
        Err(e) => return Err(e),
    };
    let mut tr = Trainer::new(g)?;
    let grads = tr.step(&feeds)?.gradients;
    let mut rng = Rng::new(seed ^ 0x5eed);
    let (mut n, mut skipped) = (0, 0);
    for (p, grad) in &grads {
        let x = tr.get(p).ok_or("no parameter")?;
        let xs = x.to_f64().map_err(|e| e.to_string())?;
        let gs = grad.to_f64().map_err(|e| e.to_string())?;
        if gs.len() != xs.len() {
            return Err(format!("gradient of {p} has {} elements, the parameter {}", gs.len(), xs.len()));
        }
        let picks: BTreeSet<usize> = if xs.len() <= per_param {
            (0..xs.len()).collect()
        } else {
            (0..per_param).map(|_| (rng.uniform(0.0, 1.0) * xs.len() as f64) as usize % xs.len()).collect()
        };
        for i in picks {
            let h = 1e-6 * xs[i].abs().max(1.0);
            let at = |d: f64| {
                let mut v = xs.clone();
                v[i] += d;
                Array::float(x.dtype, x.shape.clone(), v)
            };
            tr.set(p, &at(h))?;
            let lp = tr.loss(&feeds);
            tr.set(p, &at(-h))?;
            let lm = tr.loss(&feeds);
            tr.set(p, &x)?;
            // Where a nudge changes an output's shape (a repeated value of `Unique` made
            // distinct) the loss has no derivative there: that element is not checked.
            let (lp, lm) = match (lp, lm) {
                (Ok(lp), Ok(lm)) => (lp, lm),
                (Err(e), _) | (_, Err(e)) if e.contains("do not broadcast") => {
                    skipped += 1;
                    continue;
                }
                (Err(e), _) | (_, Err(e)) => return Err(e),
            };
            let fd = (lp - lm) / (2.0 * h);
            if (fd - gs[i]).abs() > 1e-5 + 1e-4 * fd.abs() {
                return Err(format!("d loss / d {p}[{i}]: autodiff {}, finite differences {fd}", gs[i]));
            }
            n += 1;
        }
    }
    if n == 0 && skipped > 0 {
        return Err(format!("no element checked: every nudge of the {skipped} tried changed an output's shape"));
    }
    Ok(Outcome::Checked(n))
}

fn parse(text: &str) -> Result<Graph, String> {
    let m = frontend::parse(text).map_err(|d| frontend::render(&d, "sample", text))?.model;
    Ok(m.graph)
}

#[test]
fn every_gradient_rule_matches_finite_differences() {
    let skip: BTreeSet<&str> = SKIP.iter().map(|s| s.0).collect();
    let mut failures = Vec::new();
    let mut no_rule = BTreeSet::new();
    let mut checked: BTreeMap<&str, usize> = BTreeMap::new();
    let mut nothing = Vec::new();
    for (k, s) in samples().iter().enumerate() {
        if skip.contains(s.op) {
            continue;
        }
        let r = parse(&to_f64(&s.text)).and_then(|g| check(g, 1000 + k as u64, 12));
        match r {
            Ok(Outcome::Checked(n)) => {
                checked.insert(s.op, n);
            }
            Ok(Outcome::NothingToCheck) => nothing.push(s.op),
            Ok(Outcome::NoRule(e)) => {
                if !e.contains(s.op) {
                    failures.push(format!("{}: a rule is missing on the way: {e}", s.op));
                }
                no_rule.insert(s.op);
            }
            Err(e) => failures.push(format!("{}: {e}", s.op)),
        }
    }
    let expected: BTreeSet<&str> = NO_RULE.iter().map(|s| s.0).collect();
    let total: usize = checked.values().sum();
    eprintln!(
        "{} ops checked ({} elements); without a float path to the loss: {}",
        checked.len(),
        total,
        nothing.join(", ")
    );
    if no_rule != expected {
        failures.push(format!(
            "ops without a gradient rule {:?}, NO_RULE lists {:?}",
            no_rule.difference(&expected).collect::<Vec<_>>(),
            expected.difference(&no_rule).collect::<Vec<_>>()
        ));
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// Variants of one op checked against finite differences: how many, and what failed.
#[derive(Default)]
struct Variants {
    checked: usize,
    failures: Vec<String>,
}

impl Variants {
    /// Checks the model `text` (described by `what`) at up to `per_param` elements of each
    /// parameter, seeded by its place in the sequence.
    fn check(&mut self, what: &str, text: &str, per_param: usize) {
        match parse(text).and_then(|g| check(g, self.checked as u64, per_param)) {
            Ok(Outcome::Checked(_)) => self.checked += 1,
            Ok(Outcome::NothingToCheck) => self.failures.push(format!("{what}: nothing to check")),
            Ok(Outcome::NoRule(e)) | Err(e) => self.failures.push(format!("{what}: {e}")),
        }
    }

    /// No failures, and `want` variants checked.
    fn assert_all(self, want: usize) {
        assert!(self.failures.is_empty(), "{} failures:\n{}", self.failures.len(), self.failures.join("\n"));
        assert_eq!(self.checked, want);
    }
}

/// GridSample of X of dims `xs` at a grid of dims `gs` (drawn in [0.1, 0.9], stretched to
/// about [-2.2, 2.3] so that padding matters).
fn grid_sample_case(xs: &[usize], gs: &[usize], mode: &str, pad: &str, align: usize) -> String {
    model(
        &format!("double[{}] x, double[{}] g", list(xs), list(gs)),
        "y",
        "double[1] a = {5.6}, double[1] b = {-2.8}",
        &format!(
            "   s = Mul (g, a)\n   t = Add (s, b)\n   y = GridSample <mode: string = \"{mode}\", padding_mode: string = \"{pad}\", align_corners: int = {align}> (x, t)"
        ),
    )
}

/// A model in ONNX text over float64 inputs.
fn model(inputs: &str, outputs: &str, inits: &str, body: &str) -> String {
    let inits = if inits.is_empty() { String::new() } else { format!("\n<{inits}>") };
    format!("<\n   ir_version: 8,\n   opset_import: [\"\" : 18]\n>\nm ({inputs}) => ({outputs}){inits}\n{{\n{body}\n}}")
}

fn list(v: &[usize]) -> String {
    v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ")
}

/// A DFT of a signal of dims `xs` (the last: 1 real, 2 complex) along `axis`, cut or padded
/// to `length` when given: what it is, and its model.
fn dft_case(xs: &[usize], axis: usize, inverse: usize, onesided: usize, length: Option<usize>) -> (String, String) {
    let (inits, args) = match length {
        Some(n) => (format!("int64 n = {{{n}}}"), "x, n"),
        None => (String::new(), "x"),
    };
    let text = model(
        &format!("double[{}] x", list(xs)),
        "y",
        &inits,
        &format!("   y = DFT <axis: int = {axis}, inverse: int = {inverse}, onesided: int = {onesided}> ({args})"),
    );
    (format!("DFT {xs:?} axis {axis} inverse {inverse} onesided {onesided} length {length:?}"), text)
}

/// One random model: an op with drawn shapes and attributes.
fn random_case(rng: &mut Rng, kind: usize) -> (String, String) {
    let mut pick = |n: usize| (rng.next_u64() % n as u64) as usize;
    match kind {
        // Conv: 1-3 spatial dims, strides, pads, dilations, groups.
        0 => {
            let k = 1 + pick(3);
            let g = 1 + pick(2);
            let (c, m) = (g * (1 + pick(2)), g * (1 + pick(2)));
            let n = 1 + pick(2);
            let ks: Vec<usize> = (0..k).map(|_| 1 + pick(3)).collect();
            let st: Vec<usize> = (0..k).map(|_| 1 + pick(2)).collect();
            let di: Vec<usize> = (0..k).map(|_| 1 + pick(2)).collect();
            let pads: Vec<usize> = (0..2 * k).map(|_| pick(2)).collect();
            let sp: Vec<usize> =
                (0..k).map(|i| (ks[i] - 1) * di[i] + 1 + pick(4) + if k == 3 { 0 } else { 1 }).collect();
            let xs = [vec![n, c], sp].concat();
            let ws = [vec![m, c / g], ks.clone()].concat();
            let text = model(
                &format!("double[{}] x, double[{}] w, double[{m}] b", list(&xs), list(&ws)),
                "y",
                "",
                &format!(
                    "   y = Conv <group: int = {g}, strides: ints = [{}], dilations: ints = [{}], pads: ints = [{}]> (x, w, b)",
                    list(&st),
                    list(&di),
                    list(&pads)
                ),
            );
            (format!("Conv k{k} g{g} x{xs:?} w{ws:?} s{st:?} d{di:?} p{pads:?}"), text)
        }
        // ConvTranspose.
        1 => {
            let k = 1 + pick(2);
            let g = 1 + pick(2);
            let (c, m) = (g * (1 + pick(2)), g * (1 + pick(2)));
            let ks: Vec<usize> = (0..k).map(|_| 1 + pick(3)).collect();
            let st: Vec<usize> = (0..k).map(|_| 1 + pick(2)).collect();
            let pads: Vec<usize> = (0..2 * k).map(|i| pick(ks[i % k].min(2))).collect();
            let sp: Vec<usize> = (0..k).map(|_| 2 + pick(3)).collect();
            let xs = [vec![1 + pick(2), c], sp].concat();
            let ws = [vec![c, m / g], ks].concat();
            let text = model(
                &format!("double[{}] x, double[{}] w", list(&xs), list(&ws)),
                "y",
                "",
                &format!(
                    "   y = ConvTranspose <group: int = {g}, strides: ints = [{}], pads: ints = [{}]> (x, w)",
                    list(&st),
                    list(&pads)
                ),
            );
            (format!("ConvTranspose g{g} x{xs:?} w{ws:?} s{st:?} p{pads:?}"), text)
        }
        // Pools.
        2 => {
            let k = 1 + pick(2);
            let ks: Vec<usize> = (0..k).map(|_| 1 + pick(3)).collect();
            let st: Vec<usize> = (0..k).map(|_| 1 + pick(2)).collect();
            let pads: Vec<usize> = (0..2 * k).map(|i| pick(ks[i % k].div_ceil(2))).collect();
            let sp: Vec<usize> = (0..k).map(|i| ks[i] + pick(4)).collect();
            let xs = [vec![1 + pick(2), 1 + pick(3)], sp].concat();
            let (op, extra) = match pick(5) {
                0 => ("MaxPool", String::new()),
                1 => ("AveragePool", ", count_include_pad: int = 0".to_string()),
                2 => ("AveragePool", ", count_include_pad: int = 1".to_string()),
                // Lp pools of p = 1, 2, 3, windows past the pads in ceil mode.
                _ => ("LpPool", format!(", p: int = {}, ceil_mode: int = {}", 1 + pick(3), pick(2))),
            };
            let text = model(
                &format!("double[{}] x", list(&xs)),
                "y",
                "",
                &format!(
                    "   y = {op} <kernel_shape: ints = [{}], strides: ints = [{}], pads: ints = [{}]{extra}> (x)",
                    list(&ks),
                    list(&st),
                    list(&pads)
                ),
            );
            (format!("{op}{extra} x{xs:?} k{ks:?} s{st:?} p{pads:?}"), text)
        }
        // MatMul, batched with broadcasting.
        3 => {
            let (m, k, n) = (1 + pick(4), 1 + pick(4), 1 + pick(4));
            let b = 1 + pick(3);
            let a = match pick(3) {
                0 => vec![m, k],
                1 => vec![b, m, k],
                _ => vec![2, 1, m, k],
            };
            let bs = match pick(3) {
                0 => vec![k, n],
                1 => vec![b, k, n],
                _ => vec![k],
            };
            let text =
                model(&format!("double[{}] a, double[{}] b", list(&a), list(&bs)), "y", "", "   y = MatMul (a, b)");
            (format!("MatMul {a:?} {bs:?}"), text)
        }
        // Gemm with transposes, alpha, beta and a broadcast C.
        4 => {
            let (m, k, n) = (1 + pick(4), 1 + pick(4), 1 + pick(4));
            let (ta, tb) = (pick(2), pick(2));
            let a = if ta == 1 { [k, m] } else { [m, k] };
            let b = if tb == 1 { [n, k] } else { [k, n] };
            let c = match pick(3) {
                0 => vec![n],
                1 => vec![m, 1],
                _ => vec![m, n],
            };
            let text = model(
                &format!("double[{}] a, double[{}] b, double[{}] c", list(&a), list(&b), list(&c)),
                "y",
                "",
                &format!(
                    "   y = Gemm <transA: int = {ta}, transB: int = {tb}, alpha: float = 0.7, beta: float = 1.3> (a, b, c)"
                ),
            );
            (format!("Gemm tA{ta} tB{tb} {a:?} {b:?} {c:?}"), text)
        }
        // Softmax / LogSoftmax / LayerNormalization over a random axis.
        5 => {
            let r = 1 + pick(3);
            let xs: Vec<usize> = (0..r).map(|_| 1 + pick(4)).collect();
            let axis = pick(r) as i64 - if pick(2) == 0 { r as i64 } else { 0 };
            let (op, ins, inputs) = match pick(3) {
                0 => ("Softmax", "x", format!("double[{}] x", list(&xs))),
                1 => ("LogSoftmax", "x", format!("double[{}] x", list(&xs))),
                _ => {
                    let a = if axis < 0 { axis + r as i64 } else { axis } as usize;
                    let s = list(&xs[a..]);
                    ("LayerNormalization", "x, s, b", format!("double[{}] x, double[{s}] s, double[{s}] b", list(&xs)))
                }
            };
            let text = model(&inputs, "y", "", &format!("   y = {op} <axis: int = {axis}> ({ins})"));
            (format!("{op} {xs:?} axis {axis}"), text)
        }
        // LRN: odd and even windows (an even one reaches further up the channels than down),
        // wider than the channels or not, with a local term large enough to matter.
        6 if pick(4) == 0 => {
            let xs = [vec![1 + pick(2), 1 + pick(5)], (0..pick(3)).map(|_| 1 + pick(3)).collect()].concat();
            let size = 1 + pick(6);
            let (alpha, beta, bias) = ([0.1, 0.5, 2.0][pick(3)], [0.5, 0.75, 1.0][pick(3)], [1.0, 2.0][pick(2)]);
            let text = model(
                &format!("double[{}] x", list(&xs)),
                "y",
                "",
                &format!(
                    "   y = LRN <size: int = {size}, alpha: float = {alpha}, beta: float = {beta}, bias: float = {bias}> (x)"
                ),
            );
            (format!("LRN size {size} α {alpha} β {beta} bias {bias} {xs:?}"), text)
        }
        // Instance and group normalization (parameters per channel, or per group as opset 18
        // writes them) over random spatial dims.
        6 if pick(2) == 0 => {
            let (g, variant) = (2 + pick(2), pick(3));
            // Per-group parameters are told from per-channel ones by there being fewer.
            let c = g * if variant == 2 { 2 } else { 1 + pick(2) };
            let xs = [vec![1 + pick(3), c], (0..1 + pick(2)).map(|_| 1 + pick(3)).collect()].concat();
            let (op, p) = match variant {
                0 => ("InstanceNormalization".to_string(), c),
                1 => (format!("GroupNormalization <num_groups: int = {g}>"), c),
                _ => (format!("GroupNormalization <num_groups: int = {g}>"), g),
            };
            let text = model(
                &format!("double[{}] x, double[{p}] s, double[{p}] b", list(&xs)),
                "y",
                "",
                &format!("   y = {op} (x, s, b)"),
            );
            (format!("{op} {xs:?} params {p}"), text)
        }
        // BatchNormalization, training mode (batch statistics) or inference.
        6 => {
            // At least two channels: single-element initializers are constants, not trained.
            let c = 2 + pick(2);
            let xs = [vec![1 + pick(3), c], (0..pick(3)).map(|_| 1 + pick(3)).collect()].concat();
            let train = pick(2);
            // The running statistics are state the step updates, not differentiated.
            let outs = "y";
            let text = model(
                &format!("double[{}] x, double[{c}] s, double[{c}] b", list(&xs)),
                outs,
                &format!(
                    "double[{c}] m = {{{}}}, double[{c}] v = {{{}}}",
                    vec!["0.2"; c].join(", "),
                    vec!["1.5"; c].join(", ")
                ),
                &format!(
                    "   {outs} = BatchNormalization <training_mode: int = {train}, momentum: float = 0.8> (x, s, b, m, v)"
                ),
            );
            (format!("BatchNormalization train {train} {xs:?}"), text)
        }
        // Resize: every interpolation mode and coordinate mode, up or down, by scales or sizes.
        7 if pick(2) == 0 => {
            let xs = [1 + pick(2), 1 + pick(2), 2 + pick(4), 2 + pick(4)];
            let (mode, extra) = match pick(4) {
                0 => ("nearest", ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"][pick(4)].to_string()),
                1 => ("linear", String::new()),
                2 => ("cubic", String::new()),
                _ => ("linear", "antialias".to_string()),
            };
            let coord =
                ["half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "half_pixel_symmetric"][pick(5)];
            let mut attrs = format!("mode: string = \"{mode}\", coordinate_transformation_mode: string = \"{coord}\"");
            if mode == "nearest" {
                attrs += &format!(", nearest_mode: string = \"{extra}\"");
            } else if extra == "antialias" {
                attrs += ", antialias: int = 1";
            }
            let (inits, args, out) = if pick(2) == 0 {
                let sc = [[0.5, 1.5, 2.0, 3.0][pick(4)], [0.5, 1.5, 2.0, 3.0][pick(4)]];
                let out: Vec<usize> =
                    [xs[2] as f64 * sc[0], xs[3] as f64 * sc[1]].iter().map(|v| v.floor() as usize).collect();
                (format!("float[4] scales = {{1, 1, {}, {}}}", sc[0], sc[1]), "x, , scales", out)
            } else {
                let out = vec![1 + pick(2 * xs[2]), 1 + pick(2 * xs[3])];
                (format!("int64[4] sizes = {{{}, {}, {}, {}}}", xs[0], xs[1], out[0], out[1]), "x, , , sizes", out)
            };
            let text =
                model(&format!("double[{}] x", list(&xs)), "y", &inits, &format!("   y = Resize <{attrs}> ({args})"));
            (format!("Resize {mode} {extra} {coord} {xs:?} → {out:?}"), text)
        }
        // MaxUnpool with indices that repeat (the forward keeps the last value written to an
        // index: the earlier ones get no gradient), with and without a wider output_shape.
        7 if pick(3) == 0 => {
            let xs = [1, 1 + pick(2), 1 + pick(2), 1 + pick(3)];
            let out = [xs[0], xs[1], 2 * xs[2], 2 * xs[3]];
            let n: usize = xs.iter().product();
            let range = (out.iter().product::<usize>() / 2).max(1);
            let idx: Vec<String> = (0..n).map(|_| pick(range).to_string()).collect();
            let wide = pick(2) == 1;
            let (inits, args) = if wide {
                (
                    format!(
                        "int64[{}] i = {{{}}}, int64[4] os = {{{}, {}, {}, {}}}",
                        list(&xs),
                        idx.join(", "),
                        out[0],
                        out[1],
                        out[2] + 1,
                        out[3] + 2
                    ),
                    "x, i, os",
                )
            } else {
                (format!("int64[{}] i = {{{}}}", list(&xs), idx.join(", ")), "x, i")
            };
            let text = model(
                &format!("double[{}] x", list(&xs)),
                "y",
                &inits,
                &format!("   y = MaxUnpool <kernel_shape: ints = [2, 2], strides: ints = [2, 2]> ({args})"),
            );
            (format!("MaxUnpool {xs:?} indices {idx:?} wide {wide}"), text)
        }
        // Gather on a random axis with repeated indices (embedding-style scatter-add).
        7 => {
            let r = 1 + pick(3);
            let xs: Vec<usize> = (0..r).map(|_| 2 + pick(3)).collect();
            let axis = pick(r);
            let n = 1 + pick(5);
            let idx: Vec<String> = (0..n)
                .map(|_| (pick(xs[axis]) as i64 - if pick(3) == 0 { xs[axis] as i64 } else { 0 }).to_string())
                .collect();
            let text = model(
                &format!("double[{}] x", list(&xs)),
                "y",
                &format!("int64[{n}] i = {{{}}}", idx.join(", ")),
                &format!("   y = Gather <axis: int = {axis}> (x, i)"),
            );
            (format!("Gather {xs:?} axis {axis} idx {idx:?}"), text)
        }
        // Slice with steps (negative included).
        // Attention (opset 23): 3-D or 4-D, grouped query heads, a key/value cache, an additive
        // mask, causal, a soft cap, a given scale, the scores output in each mode.
        8 if pick(2) == 0 => {
            let (b, hk, group, sq, sk, d, dv, past) =
                (1 + pick(2), 1 + pick(2), 1 + pick(2), 1 + pick(3), 1 + pick(3), 1 + pick(3), 1 + pick(3), pick(3));
            let hq = hk * group;
            let total = past + sk;
            let four = pick(2) == 0;
            let (qs, ks, vs) = if four {
                (vec![b, hq, sq, d], vec![b, hk, sk, d], vec![b, hk, sk, dv])
            } else {
                (vec![b, sq, hq * d], vec![b, sk, hk * d], vec![b, sk, hk * dv])
            };
            let mut attrs = vec![format!("is_causal: int = {}", pick(2))];
            if !four {
                attrs.push(format!("q_num_heads: int = {hq}, kv_num_heads: int = {hk}"));
            }
            if pick(3) == 0 {
                attrs.push("softcap: float = 2.0".into());
            }
            if pick(2) == 0 {
                attrs.push("scale: float = 0.7".into());
            }
            let mode = [0, 2, 3][pick(3)];
            attrs.push(format!("qk_matmul_output_mode: int = {mode}"));
            let mut inputs = vec![
                format!("double[{}] q", list(&qs)),
                format!("double[{}] k", list(&ks)),
                format!("double[{}] v", list(&vs)),
            ];
            let masked = pick(2) == 0;
            let inits = if masked {
                let m: Vec<String> = (0..sq * total).map(|_| format!("{}", pick(5) as f64 * 0.3 - 0.6)).collect();
                format!("double[{sq},{total}] m = {{{}}}", m.join(", "))
            } else {
                String::new()
            };
            let mut args = vec!["q", "k", "v", if masked { "m" } else { "" }];
            if past > 0 {
                inputs.push(format!("double[{b},{hk},{past},{d}] pk, double[{b},{hk},{past},{dv}] pv"));
                args.extend(["pk", "pv"]);
            }
            let outs = if pick(2) == 0 { "y" } else { "y, yk, yv, qk" };
            let text = model(
                &inputs.join(", "),
                outs,
                &inits,
                &format!("   {outs} = Attention <{}> ({})", attrs.join(", "), args.join(", ")),
            )
            .replace("\"\" : 18", "\"\" : 23");
            (
                format!("Attention q{qs:?} k{ks:?} v{vs:?} past {past} mask {masked} <{}> → {outs}", attrs.join(", ")),
                text,
            )
        }
        8 => {
            let xs = [3 + pick(4), 2 + pick(4)];
            let neg = pick(2) == 1;
            let (st, en, step) = if neg {
                (xs[0] as i64 - 1, -(xs[0] as i64) - 1, -(1 + pick(2) as i64))
            } else {
                (pick(2) as i64, xs[0] as i64, 1 + pick(2) as i64)
            };
            let text = model(
                &format!("double[{}] x", list(&xs)),
                "y",
                &format!(
                    "int64[2] s = {{{st}, 0}}, int64[2] e = {{{en}, {}}}, int64[2] a = {{0, 1}}, int64[2] p = {{{step}, 1}}",
                    xs[1] as i64 - 1
                ),
                "   y = Slice (x, s, e, a, p)",
            );
            (format!("Slice {xs:?} {st}:{en}:{step}"), text)
        }
        // Recurrent layers, both directions.
        9 => {
            let (t, b, i, h) = (1 + pick(3), 1 + pick(2), 1 + pick(3), 1 + pick(3));
            let dirs = ["forward", "reverse", "bidirectional"];
            let dir = dirs[pick(3)];
            let d = if dir == "bidirectional" { 2 } else { 1 };
            let (op, gates, outs) = match pick(3) {
                0 => ("LSTM", 4, "y, yh, yc"),
                1 => ("GRU", 3, "y, yh"),
                _ => ("RNN", 1, "y, yh"),
            };
            let text = model(
                &format!(
                    "double[{t},{b},{i}] x, double[{d},{},{i}] w, double[{d},{},{h}] r, double[{d},{}] bias, double[{d},{b},{h}] h0",
                    gates * h,
                    gates * h,
                    2 * gates * h
                ),
                outs,
                "",
                &format!(
                    "   {outs} = {op} <hidden_size: int = {h}, direction: string = \"{dir}\"> (x, w, r, bias, , h0)"
                ),
            );
            (format!("{op} {dir} t{t} b{b} i{i} h{h}"), text)
        }
        // A running product with zeros in it, every direction and exclusivity.
        _ if pick(3) == 0 => {
            let xs: Vec<usize> = (0..1 + pick(3)).map(|_| 1 + pick(4)).collect();
            let axis = pick(xs.len()) as i64 - if pick(2) == 0 { xs.len() as i64 } else { 0 };
            let (exclusive, reverse) = (pick(2), pick(2));
            let n: usize = xs.iter().product();
            // Zeros at a few positions, fixed (an initializer is a constant here), multiplied in.
            let zeros: Vec<String> = (0..n).map(|_| if pick(3) == 0 { "0" } else { "1" }.to_string()).collect();
            let text = model(
                &format!("double[{}] x", list(&xs)),
                "y",
                &format!("double[{}] z = {{{}}}, int64 a = {{{axis}}}", list(&xs), zeros.join(", ")),
                &format!(
                    "   m = Mul (x, z)\n   y = CumProd <exclusive: int = {exclusive}, reverse: int = {reverse}> (m, a)"
                ),
            );
            (format!("CumProd {xs:?} axis {axis} exclusive {exclusive} reverse {reverse} zeros {zeros:?}"), text)
        }
        // DFT: forward of a real or complex signal (one-sided for a real one), or inverse of a
        // full or one-sided spectrum; cut or padded to a given length or not; on either axis.
        _ if pick(3) == 0 => {
            let inverse = pick(2);
            let onesided = pick(2);
            let complex = inverse == 1 || onesided == 0 && pick(2) == 0;
            let len = 2 + pick(5);
            let length = if pick(2) == 0 { Some(2 + pick(6)) } else { None };
            let other = 1 + pick(2);
            let axis = pick(2);
            let mut xs = vec![other, other, 1 + usize::from(complex)];
            xs[axis] = len;
            dft_case(&xs, axis, inverse, onesided, length)
        }
        // Col2Im: 1-2 spatial dims, strides, pads, dilations.
        _ if pick(2) == 0 => {
            let k = 1 + pick(2);
            let block: Vec<usize> = (0..k).map(|_| 1 + pick(3)).collect();
            let st: Vec<usize> = (0..k).map(|_| 1 + pick(2)).collect();
            let di: Vec<usize> = (0..k).map(|_| 1 + pick(2)).collect();
            let pads: Vec<usize> = (0..2 * k).map(|_| pick(2)).collect();
            let img: Vec<usize> = (0..k).map(|i| (block[i] - 1) * di[i] + 1 + pick(4)).collect();
            let cols: usize =
                (0..k).map(|i| (img[i] + pads[i] + pads[k + i] - ((block[i] - 1) * di[i] + 1)) / st[i] + 1).product();
            let (n, c) = (1 + pick(2), 1 + pick(2));
            let bl: usize = block.iter().product();
            let text = model(
                &format!("double[{n},{},{cols}] x", c * bl),
                "y",
                &format!("int64[{k}] i = {{{}}}, int64[{k}] b = {{{}}}", list(&img), list(&block)),
                &format!(
                    "   y = Col2Im <strides: ints = [{}], dilations: ints = [{}], pads: ints = [{}]> (x, i, b)",
                    list(&st),
                    list(&di),
                    list(&pads)
                ),
            );
            (format!("Col2Im c{c} img{img:?} block{block:?} s{st:?} d{di:?} p{pads:?}"), text)
        }
        // Det: 0-2 batch dims, matrices of 1-4 rows.
        11 => {
            let m = 1 + pick(4);
            let mut xs: Vec<usize> = (0..pick(3)).map(|_| 1 + pick(3)).collect();
            xs.extend([m, m]);
            let text = model(&format!("double[{}] x", list(&xs)), "y", "", "   y = Det (x)");
            (format!("Det {xs:?}"), text)
        }
        // GridSample: 1-3 spatial dims, every mode, padding and corner alignment; the grid
        // (drawn in [0.1, 0.9]) stretched to about [-2.2, 2.3] so that padding matters.
        12 => {
            let k = 1 + pick(3);
            let mode = ["nearest", "linear", "cubic"][pick(3)];
            let pad = ["zeros", "border", "reflection"][pick(3)];
            let align = pick(2);
            let (n, c) = (1 + pick(2), 1 + pick(2));
            let xs: Vec<usize> = [vec![n, c], (0..k).map(|_| 1 + pick(4)).collect()].concat();
            let gs: Vec<usize> = [vec![n], (0..k).map(|_| 1 + pick(3)).collect(), vec![k]].concat();
            let text = grid_sample_case(&xs, &gs, mode, pad, align);
            (format!("GridSample {mode} {pad} align {align} x{xs:?} grid{gs:?}"), text)
        }
        // AffineGrid, 2-D or 3-D, either corner alignment.
        _ => {
            let nd = 2 + pick(2);
            let n = 1 + pick(2);
            let dims: Vec<usize> = (0..nd).map(|_| 1 + pick(4)).collect();
            let align = pick(2);
            let text = model(
                &format!("double[{n},{nd},{}] t", nd + 1),
                "y",
                &format!("int64[{}] s = {{{n}, 1, {}}}", nd + 2, list(&dims)),
                &format!("   y = AffineGrid <align_corners: int = {align}> (t, s)"),
            );
            (format!("AffineGrid n{n} {dims:?} align {align}"), text)
        }
    }
}

#[test]
fn gradients_match_finite_differences_over_random_shapes_and_attributes() {
    let mut rng = Rng::new(20261123);
    let mut failures = Vec::new();
    let mut counts = [0usize; 13];
    for case in 0..13 * 12 {
        let kind = case % 13;
        // A draw whose tensors are all single elements has no parameter: drawn again.
        for attempt in 0..8 {
            let (what, text) = random_case(&mut rng, kind);
            match parse(&text).and_then(|g| check(g, case as u64, 6)) {
                Ok(Outcome::Checked(_)) => counts[kind] += 1,
                Ok(Outcome::NothingToCheck) if attempt < 7 => continue,
                Ok(Outcome::NothingToCheck) => failures.push(format!("{what}: nothing to check")),
                Ok(Outcome::NoRule(e)) | Err(e) => failures.push(format!("{what}: {e}")),
            }
            break;
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
    assert!(counts.iter().all(|&c| c == 12), "{counts:?}");
}

#[test]
fn dft_gradients_match_finite_differences_in_every_variant() {
    let mut variants = Variants::default();
    for inverse in 0..2 {
        for onesided in 0..2 {
            for complex in [false, true] {
                // A one-sided forward transform takes a real signal; an inverse, a spectrum.
                if (inverse == 0 && onesided == 1 && complex) || (inverse == 1 && !complex) {
                    continue;
                }
                for length in [None, Some(3), Some(8)] {
                    for (axis, len) in [(0, 5), (1, 4)] {
                        let mut xs = vec![2, 2, 1 + usize::from(complex)];
                        xs[axis] = len;
                        let (what, text) = dft_case(&xs, axis, inverse, onesided, length);
                        variants.check(&what, &text, 64);
                    }
                }
            }
        }
    }
    variants.assert_all(30);
}

#[test]
fn grid_sample_gradients_match_finite_differences_in_every_variant() {
    let mut variants = Variants::default();
    for k in 1..=3usize {
        for mode in ["nearest", "linear", "cubic"] {
            for pad in ["zeros", "border", "reflection"] {
                for align in 0..2 {
                    // Sides of 1 (every tap outside but one), 2 and 4 pixels; a grid drawn
                    // in [0.1, 0.9] and stretched to about [-2.2, 2.3].
                    let xs: Vec<usize> = [vec![1, 2], [4, 2, 1][..k].to_vec()].concat();
                    let gs: Vec<usize> = [vec![1], [3, 2, 2][..k].to_vec(), vec![k]].concat();
                    let what = format!("GridSample {mode} {pad} align {align} x{xs:?}");
                    let text = grid_sample_case(&xs, &gs, mode, pad, align);
                    variants.check(&what, &text, 64);
                }
            }
        }
    }
    variants.assert_all(54);
}

#[test]
fn stft_gradients_match_finite_differences_in_every_variant() {
    let mut variants = Variants::default();
    for complex in [false, true] {
        for onesided in 0..2 {
            // A one-sided transform takes a real signal.
            if complex && onesided == 1 {
                continue;
            }
            for window in [false, true] {
                for length in [false, true] {
                    if !window && !length {
                        continue;
                    }
                    // Overlapping frames (step 2 of 5), frames apart (step 4 of 3).
                    for (frame, step) in [(5, 2), (3, 4)] {
                        let c = 1 + usize::from(complex);
                        let mut ins = format!("double[2,11,{c}] x");
                        if window {
                            ins += &format!(", double[{frame}] w");
                        }
                        let inits = if length {
                            format!("int64 step = {{{step}}}, int64 len = {{{frame}}}")
                        } else {
                            format!("int64 step = {{{step}}}")
                        };
                        let args =
                            format!("x, step, {}{}", if window { "w" } else { "" }, if length { ", len" } else { "" });
                        let what = format!(
                            "STFT c{c} onesided {onesided} window {window} length {length} frame {frame} step {step}"
                        );
                        let text =
                            model(&ins, "y", &inits, &format!("   y = STFT <onesided: int = {onesided}> ({args})"));
                        variants.check(&what, &text, 64);
                    }
                }
            }
        }
    }
    variants.assert_all(18);
}

#[test]
fn roi_align_gradients_match_finite_differences_in_every_variant() {
    let mut variants = Variants::default();
    for mode in ["avg", "max"] {
        for transform in ["half_pixel", "output_half_pixel"] {
            for ratio in [0, 2] {
                // Regions inside, reaching past the image, and smaller than a bin.
                let what = format!("RoiAlign {mode} {transform} sampling_ratio {ratio}");
                let text = model(
                    "double[2,2,5,6] x",
                    "y",
                    "double[3,4] rois = {0.4, 0.2, 3.7, 4.1, -1.3, 2.2, 6.8, 5.9, 1.1, 1.4, 1.6, 1.9}, int64[3] bi = {0, 1, 1}",
                    &format!(
                        "   y = RoiAlign <mode: string = \"{mode}\", coordinate_transformation_mode: string = \"{transform}\", output_height: int = 2, output_width: int = 3, sampling_ratio: int = {ratio}, spatial_scale: float = 0.9> (x, rois, bi)"
                    ),
                );
                variants.check(&what, &text, 60);
            }
        }
    }
    variants.assert_all(8);
}
