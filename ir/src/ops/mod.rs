//! What shardc knows about each op, one family per module.
//!
//! Every op of [`Op`] implements [`OpRules`] in the module of its family, next to the other
//! ops of that family: its arity and element-type rules (the verifier), shape inference, its
//! iteration space (how it can be split over devices), its work (FLOPs and how the backward
//! pass splits), its reference evaluation, and how changed dims flow through it (rebatching).
//! The engines — [`crate::verify`], [`crate::infer`], [`crate::shard`], [`crate::cost`],
//! [`crate::eval`] and the rebatch pass — walk graphs and call these rules through the one
//! generated dispatch, [`Op::rules`].
//!
//! A facet an op does not provide is reported by its default (`None`, or an "unsupported"
//! evaluation error); the completeness test over every known op type (`tests/tests/ops.rs`)
//! fails when a facet is missing.
//!
//! | module | ops |
//! |---|---|
//! | [`attention`] | `Attention`, `RotaryEmbedding` |
//! | [`flash`] | `AttentionBlock`, `AttentionGrad` (the `shardc` domain: attention block by block, as flash and ring attention compute it) |
//! | [`experts`] | `MoE`, `MoEGrad` (the `shardc` domain: a mixture of experts' expert MLPs) |
//! | [`elementwise`] | unary and binary maths, comparisons, logic, `Where`, `Cast`, `Clip`, `Dropout`, variadic `Max`/`Min`/`Sum`/`Mean` |
//! | [`contraction`] | `MatMul`, `Gemm`, `Einsum` |
//! | [`conv`] | `Conv`, `ConvTranspose` and the window geometry shared with pooling |
//! | [`pool`] | max, average and Lp pooling, global pooling |
//! | [`norm`] | batch, instance, layer, group, Lp and mean-variance normalization, LRN |
//! | [`softmax`] | `Softmax`, `LogSoftmax`, `Hardmax` |
//! | [`reduce`] | `Reduce*`, `ArgMax`, `ArgMin` |
//! | [`shape`] | reshapes, transposes, concat/split/slice, pad, expand/tile, constants, ranges |
//! | [`index`] | gathers and scatters, `OneHot`, `TopK`, `NonZero`, `CumSum`, `Trilu` |
//! | [`resize`] | `Resize`, `Upsample`, `DepthToSpace`, `SpaceToDepth` |
//! | [`recurrent`] | `LSTM`, `GRU`, `RNN` |
//! | [`quant`] | `QuantizeLinear`, `DequantizeLinear`, `DynamicQuantizeLinear`, integer and quantized contractions |
//! | [`signal`] | `DFT`, `STFT`, windows, `MelWeightMatrix` |
//! | [`image`] | `GridSample`, `AffineGrid`, `Col2Im`, `RoiAlign` |
//! | [`string`] | `StringConcat`, `StringSplit`, `StringNormalizer`, `RegexFullMatch` |
//! | [`control`] | `If`, `Loop`, `Scan` |
//! | [`comm`] | the `shardc` communication ops that lowering inserts |

pub mod apply;
pub mod attention;
pub mod comm;
pub mod contraction;
pub mod control;
pub mod conv;
pub mod elementwise;
pub mod experts;
pub mod flash;
pub mod flow;
pub mod grad;
pub mod image;
pub mod index;
pub mod loss;
pub mod norm;
pub mod optim;
pub mod pool;
pub mod quant;
pub mod recurrent;
pub mod reduce;
pub mod resize;
pub mod shape;
pub mod signal;
pub mod softmax;
pub mod space;
pub mod split;
pub mod string;
pub mod util;

use crate::array::{Array, EvalError};
use crate::graph::op::Op;
use crate::graph::{Graph, NodeId, Value};
use crate::layout::IterSpace;
use crate::types::{DType, Dim, TensorType};

/// `v`'s value when it is constant: an initializer, or an op (no subgraphs or captures) of
/// constants at most `depth` levels deep (exporters write operands such as a resize's scales
/// as `Concat`s of `Constant`s).
pub fn constant_value(g: &Graph, v: Value, depth: usize) -> Option<Array> {
    if let Some(t) = g.initializer(v) {
        return Array::from_tensor(t).ok();
    }
    let node = g.node(v.node);
    if depth == 0
        || matches!(node.op, Op::Input { .. } | Op::OuterRef)
        || node.op.has_subgraphs()
        || !node.captures().is_empty()
    {
        return None;
    }
    // The shape of a tensor of static shape is known without its values (an interpolation
    // to an input's size, a window padding computed from a shape).
    let static_dims = |x: Option<Value>| x.and_then(|x| g.tensor_type(x)).and_then(TensorType::static_dims);
    match &node.op {
        Op::Shape(s) => {
            let d = static_dims(node.input(0))?;
            let (a, b) = s.range(d.len());
            return Some(Array::i64(vec![b - a], d[a..b].to_vec()));
        }
        Op::Size(_) => return Some(Array::i64(vec![], vec![static_dims(node.input(0))?.iter().product()])),
        _ => {}
    }
    // An omitted input stays omitted; a present one must be constant.
    let mut ins: Vec<Option<Array>> = Vec::with_capacity(node.inputs().len());
    for i in node.inputs() {
        ins.push(match i {
            Some(i) => Some(constant_value(g, *i, depth - 1)?),
            None => None,
        });
    }
    let refs: Vec<Option<&Array>> = ins.iter().map(Option::as_ref).collect();
    crate::ops::eval_op(&node.op, &refs, node.num_outputs(), g.opset).ok()?.into_iter().nth(v.slot as usize)
}

pub use apply::{eval_op, infer_op, infer_op_asking};
pub use flow::{FlowCx, Mono};
pub use util::{bcast_shapes, broadcast_index, broadcast_shapes, norm_axis};

/// FLOPs counted for one exp/tanh/erf/sigmoid-like element (the work rules' unit; see
/// [`crate::cost`]).
pub const TRANSCENDENTAL_FLOPS: f64 = 8.0;

/// Any number of inputs or outputs.
pub const MANY: usize = usize::MAX;

/// What shape inference returns: per output, its type when known.
pub type Types = Result<Vec<Option<TensorType>>, String>;

/// What evaluation returns: the output arrays.
pub type Arrays = Result<Vec<Array>, EvalError>;

/// Admissible input and output counts of an op.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Arity {
    /// Fewest inputs.
    pub min_in: usize,
    /// Most inputs ([`MANY`]: no limit).
    pub max_in: usize,
    /// Fewest outputs.
    pub min_out: usize,
    /// Most outputs ([`MANY`]: no limit).
    pub max_out: usize,
}

impl Arity {
    /// `min_in..=max_in` inputs, `min_out..=max_out` outputs.
    pub const fn new(min_in: usize, max_in: usize, min_out: usize, max_out: usize) -> Arity {
        Arity { min_in, max_in, min_out, max_out }
    }

    /// Exactly `ins` inputs and one output.
    pub const fn fixed(ins: usize) -> Arity {
        Arity::new(ins, ins, 1, 1)
    }
}

/// Element types the verifier checks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TypeRule {
    /// No constraint beyond shape inference's.
    Free,
    /// These inputs share one element type (an index past the inputs is ignored).
    Same(Vec<usize>),
    /// Every input shares one element type.
    AllSame,
    /// Every input is bool.
    AllBool,
    /// Input 0 is bool, and these inputs share one element type.
    BoolAndSame(Vec<usize>),
}

/// What shape inference knows about a node's inputs.
pub struct InferCx<'a> {
    /// Input types (`None`: omitted or unknown).
    pub ins: &'a [Option<&'a TensorType>],
    /// Input values known as constants.
    pub consts: &'a [Option<&'a Array>],
    /// Input values known as symbolic shape vectors.
    pub syms: &'a [Option<&'a Vec<Dim>>],
    /// The node's output count.
    pub n_out: usize,
    /// The model's default-domain opset.
    pub opset: i64,
    /// Input slots (bit `i` for slot `i` < 64) whose constant value inference asked for and did
    /// not have: values (shape parameters such as `Reshape`'s shape or `Slice`'s starts) that
    /// would make the outputs' shapes known.
    pub missing: std::cell::Cell<u64>,
}

impl<'a> InferCx<'a> {
    /// Input `i`'s type.
    pub fn input(&self, i: usize) -> Option<&'a TensorType> {
        self.ins.get(i).copied().flatten()
    }

    /// Input `i`'s dims, when its rank is known.
    pub fn dims(&self, i: usize) -> Option<&'a Vec<Dim>> {
        self.input(i).and_then(|t| t.dims.as_ref())
    }

    /// Input 0's element type.
    pub fn dtype(&self) -> Option<DType> {
        self.input(0).map(|t| t.dtype)
    }

    /// Input `i` is given (present, typed or constant).
    pub fn has(&self, i: usize) -> bool {
        self.input(i).is_some() || self.konst(i).is_some()
    }

    /// Input `i`'s constant value.
    pub fn konst(&self, i: usize) -> Option<&'a Array> {
        let k = self.consts.get(i).copied().flatten();
        if k.is_none() && i < 64 && self.ins.get(i).is_some_and(Option::is_some) {
            self.missing.set(self.missing.get() | (1 << i));
        }
        k
    }

    /// Input `i`'s constant value as integers.
    pub fn ints(&self, i: usize) -> Option<Vec<i64>> {
        self.konst(i).and_then(|a| a.to_i64().ok())
    }

    /// Asks for the values of inputs `slots` that the outputs' shapes depend on (a `Range`'s
    /// bounds, the data of `NonZero`): when they are not constants, inference reports them
    /// ([`crate::infer::InferReport::params`]) so a caller that knows them can bind them.
    pub fn needs_values(&self, slots: &[usize]) -> bool {
        // Every slot is asked (not only up to the first missing one): each is reported.
        let mut all = true;
        for &i in slots {
            all &= self.konst(i).is_some();
        }
        all
    }

    /// Input `i` as a shape: constant values or symbolic dims.
    pub fn shape_operand(&self, i: usize) -> Option<Vec<Dim>> {
        if let Some(a) = self.konst(i) {
            return a.to_i64().ok().map(|v| v.into_iter().map(Dim::Fixed).collect());
        }
        self.syms.get(i).copied().flatten().cloned()
    }

    /// A type of element type `dtype` (when known) and `dims`.
    pub fn with(&self, dtype: Option<DType>, dims: Option<Vec<Dim>>) -> Option<TensorType> {
        dtype.map(|d| TensorType { dtype: d, dims })
    }

    /// One output of input 0's element type and `dims`.
    pub fn one(&self, dims: Option<Vec<Dim>>) -> Result<Vec<Option<TensorType>>, String> {
        Ok(vec![self.with(self.dtype(), dims)])
    }

    /// One output of input 0's type.
    pub fn same(&self) -> Result<Vec<Option<TensorType>>, String> {
        Ok(vec![self.input(0).cloned()])
    }
}

/// A node in a graph whose shapes are inferred, for the rules that read the graph.
#[derive(Copy, Clone)]
pub struct NodeCx<'a> {
    /// The graph.
    pub g: &'a Graph,
    /// The node.
    pub n: NodeId,
}

impl<'a> NodeCx<'a> {
    /// Input `i`.
    pub fn input(&self, i: usize) -> Option<Value> {
        self.g.node(self.n).input(i)
    }

    /// Number of input slots (omitted ones included).
    pub fn n_in(&self) -> usize {
        self.g.node(self.n).inputs().len()
    }

    /// Number of outputs.
    pub fn n_out(&self) -> usize {
        self.g.node(self.n).num_outputs()
    }

    /// Output `s`.
    pub fn output(&self, s: usize) -> Value {
        Value::new(self.n, s as u16)
    }

    /// A value's type.
    pub fn ty(&self, v: Option<Value>) -> Option<&'a TensorType> {
        v.and_then(|v| self.g.tensor_type(v))
    }

    /// A value's static dims (empty when unknown or absent).
    pub fn dims(&self, v: Option<Value>) -> Vec<i64> {
        self.ty(v).and_then(TensorType::static_dims).unwrap_or_default()
    }

    /// Input `i`'s static dims (empty when unknown or omitted).
    pub fn in_dims(&self, i: usize) -> Vec<i64> {
        self.dims(self.input(i))
    }

    /// Output `s`'s static dims.
    pub fn out_dims(&self, s: usize) -> Vec<i64> {
        self.dims(Some(self.output(s)))
    }

    /// A value's rank (0 when unknown).
    pub fn rank(&self, v: Value) -> usize {
        self.g.tensor_type(v).and_then(TensorType::rank).unwrap_or(0)
    }

    /// Input `i`'s element count (0 when unknown).
    pub fn in_numel(&self, i: usize) -> f64 {
        self.ty(self.input(i)).and_then(TensorType::numel).map_or(0.0, |n| n as f64)
    }

    /// The rows of input `i` when each row is its dims from `axis` on (an ONNX axis, negative
    /// from the end): the elements before `axis` (0 when unknown or out of range).
    pub fn rows_before(&self, i: usize, axis: i64) -> f64 {
        let d = self.in_dims(i);
        match norm_axis(axis, d.len()) {
            Ok(a) if d.iter().all(|&x| x > 0) => d[..a].iter().product::<i64>() as f64,
            _ => 0.0,
        }
    }

    /// Output `s`'s element count (0 when unknown).
    pub fn out_numel(&self, s: usize) -> f64 {
        self.ty(Some(self.output(s))).and_then(TensorType::numel).map_or(0.0, |n| n as f64)
    }

    /// Input `i`'s value when it is constant and holds integers (axes, shapes): an
    /// initializer, or a `Constant` (or an op of constants, a few levels deep: a training
    /// graph is built without canonicalization, so an exporter's `Constant` axes are still
    /// ops there, and they must give the op the same iteration space as an initializer).
    pub fn const_ints(&self, i: usize) -> Option<Vec<i64>> {
        let v = self.input(i)?;
        match self.g.initializer(v) {
            Some(t) => t.to_i64_vec(),
            None => constant_value(self.g, v, 4).and_then(|a| a.to_i64().ok()),
        }
    }

    /// The graph's opset.
    pub fn opset(&self) -> i64 {
        self.g.opset
    }
}

/// Evaluation of one node on arrays.
pub struct EvalCx<'a> {
    /// Input values (`None`: omitted).
    pub inputs: &'a [Option<&'a Array>],
    /// The node's output count.
    pub n_out: usize,
    /// The model's default-domain opset.
    pub opset: i64,
    /// The op type, for messages.
    pub name: &'a str,
}

impl<'a> EvalCx<'a> {
    /// Input `i`, which must be given.
    pub fn req(&self, i: usize) -> Result<&'a Array, EvalError> {
        self.opt(i).ok_or_else(|| EvalError::Invalid(format!("{}: input {i} is missing", self.name)))
    }

    /// Input `i`, when given.
    pub fn opt(&self, i: usize) -> Option<&'a Array> {
        self.inputs.get(i).copied().flatten()
    }

    /// Every given input, in order.
    pub fn all(&self) -> Vec<&'a Array> {
        self.inputs.iter().flatten().copied().collect()
    }
}

/// How an op's backward pass splits, for the cost model.
#[derive(Clone, Debug, PartialEq)]
pub enum Backward {
    /// A contraction: the backward computes, per listed input, a gradient costing as much as
    /// the forward (data gradient for activations, weight gradient for parameters); the
    /// optional bias input's gradient is a reduction of the output's size.
    Contraction {
        /// Inputs whose gradient is a contraction.
        inputs: Vec<usize>,
        /// The bias input, if any.
        bias: Option<usize>,
    },
    /// About the forward's work for the activations' gradient, and at most the output's size
    /// for any parameter's (pointwise, pooling, normalization).
    LikeForward,
    /// The activations' gradients cost this multiple of the forward's work (an op whose
    /// backward recomputes part of its forward: fused attention's 2.5).
    Times(f64),
    /// A recurrent layer: weight gradients cost the recurrent and input GEMMs (`matmul`), data
    /// gradients those and the gates' pointwise work again.
    Recurrent {
        /// The GEMM FLOPs of the forward pass.
        matmul: f64,
        /// The pointwise FLOPs of the forward pass.
        pointwise: f64,
    },
}

/// The forward work of one op.
#[derive(Clone, Debug, PartialEq)]
pub struct Work {
    /// Forward FLOPs.
    pub fwd_flops: f64,
    /// How the backward pass splits.
    pub backward: Backward,
    /// Kernel launches of the forward pass (recurrent layers launch per time step).
    pub launches: f64,
    /// Independent invocations of its main kernel, where not one per output element (a
    /// kernel with one invocation per row, per sample): a device filled by fewer runs slower.
    pub parallel: Option<f64>,
}

impl Work {
    /// Pointwise-like work of `flops`.
    pub fn flops(flops: f64) -> Option<Work> {
        Some(Work { fwd_flops: flops, backward: Backward::LikeForward, launches: 1.0, parallel: None })
    }

    /// No arithmetic (data movement, views, constants).
    pub fn none() -> Option<Work> {
        Work::flops(0.0)
    }
}

/// How an op computes on pieces when some of its iteration dims are split (what lowering
/// must add around it).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Sharded {
    /// Each device computes its piece from its inputs' pieces; a split reduction dim leaves
    /// partial sums. Statistic and spatial dims may not split.
    Local,
    /// As `Local`, and its statistic dims split freely (they use stored statistics, as
    /// inference batch normalization does).
    StoredStatistics,
    /// Split spatial dims need rows from the neighbours (halo exchange).
    Window,
    /// Split statistic dims need the row maximum and sum all-reduced (softmax, log-softmax).
    Softmax {
        /// Log-softmax.
        log: bool,
    },
    /// Split normalized dims need the mean and variance all-reduced.
    LayerNorm,
    /// Training-mode batch normalization (and its gradient): split statistic dims (the batch,
    /// spatial dims) need the per-channel sums all-reduced (synchronized batch norm).
    BatchNorm,
    /// A loss averaged over split samples (and its gradient): each device sums its samples'
    /// terms and divides by the all-reduced count of the samples that count.
    Loss,
    /// A split vocabulary: each device gathers the rows it holds, results are partial sums.
    VocabGather,
    /// Split experts: each device reads the experts' ids shifted by its first expert (the
    /// pairs routed elsewhere fall out of its range and add nothing), results are partial sums.
    Experts,
    /// A split sequence of queries, keys and values at once (role `Sequence`) runs as ring
    /// attention: each device's queries meet every device's keys and values, passed around
    /// the ring block by block (attention and its gradient).
    Ring,
    /// Runs whole on every device (control flow, communication).
    Whole,
}

/// The rules of an op. See the module documentation.
pub trait OpRules {
    /// Admissible input and output counts.
    fn arity(&self) -> Arity;

    /// Element types the verifier checks.
    fn type_rule(&self) -> TypeRule {
        TypeRule::Free
    }

    /// Output types from input types and known input values. `Ok` with `None` entries where
    /// an output cannot be known yet; `Err` when the inputs break the op's rules.
    fn infer(&self, cx: &InferCx<'_>) -> Result<Vec<Option<TensorType>>, String>;

    /// The iteration space (called with static shapes). `None`: the op has no rule.
    fn space(&self, _cx: &NodeCx<'_>) -> Option<IterSpace> {
        None
    }

    /// The forward work. `None`: the op has no rule.
    fn work(&self, _cx: &NodeCx<'_>) -> Option<Work> {
        None
    }

    /// How the op computes on pieces when its dims split.
    fn sharded(&self) -> Sharded {
        Sharded::Local
    }

    /// Reference evaluation.
    fn eval(&self, cx: &EvalCx<'_>) -> Result<Vec<Array>, EvalError> {
        Err(EvalError::Unsupported(format!("evaluating {}", cx.name)))
    }

    /// The gradient rule: adds to the training graph the ops that compute the gradients of
    /// the inputs the context asks for from the gradients of the outputs (see
    /// [`grad::GradCx`]). `None`: the op has no rule.
    fn grad(&self, _cx: &mut grad::GradCx<'_>) -> Option<Result<(), String>> {
        None
    }

    /// Whether the gradient rule can give input `i` a gradient (every input by default); the
    /// cost model prices gradients, their synchronisation and updates for these only.
    fn differentiates(&self, _i: usize) -> bool {
        true
    }

    /// An element-wise op's derivative `y'(x)` at input `x` with output `y` (the gradient
    /// rule's `ElementwiseGrad` evaluates it); `None` (the default) for other ops.
    fn derivative(&self, _x: f64, _y: f64) -> Option<f64> {
        None
    }

    /// The GEMM the op's kernel runs on one device's pieces — `x` and `w` the local dims of
    /// inputs 0 and 1, `y` of output 0 — as `(m, n, k)`: an `m × n` output over a reduction
    /// of `k`, for the device's shape-dependent GEMM rate; `None` (the default) for an op
    /// that runs no GEMM.
    fn gemm(&self, _x: &[f64], _w: Option<&[f64]>, _y: &[f64]) -> Option<(f64, f64, f64)> {
        None
    }

    /// Whether the op's kernel is made of matrix products that run on the device's matrix
    /// units (tensor cores) in the training precision: contractions, convolutions and their
    /// gradients, attention, experts, recurrent cells. The other kernels (element-wise,
    /// normalization, reductions, data movement) run on the regular cores and compute in
    /// float32 whatever the storage precision, as PyTorch's half and bfloat16 kernels do
    /// (their `opmath` type is float); the cost model prices them at the float32 peak.
    fn matrix_units(&self) -> bool {
        false
    }

    /// The op type of the one kernel the gradient rule writes for the input's gradient, where
    /// it writes one of its own (`MaxPool` → `MaxPoolGrad`): a forward model's backward pass
    /// is priced at that kernel's measured rate (the device's `kernel_factors`), as the
    /// training program prices the kernel itself. `None` (the default): element-wise and
    /// GEMM work priced at the roofline.
    fn grad_kernel(&self) -> Option<&'static str> {
        None
    }

    /// How changed dims flow from the inputs to the outputs (rebatching); the return value
    /// only serves early returns. Without a rule (the default) every output dim changes in a
    /// way that cannot be followed when an input's does, and the context records it.
    fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
        cx.no_rule();
        None
    }
}

/// `impl Op { fn rules }`: the one dispatch over every op, written beside the rules it picks
/// (the op enum itself knows nothing of them).
macro_rules! dispatch_rules {
    ($($name:ident),*) => {
        impl Op {
            /// The op's rules: arity, shape inference, iteration space, work, evaluation,
            /// dim flow (see [`crate::ops`]). The one dispatch over every op.
            pub fn rules(&self) -> &dyn OpRules {
                match self {
                    Op::Input { .. } | Op::Initializer(_) | Op::OuterRef => &SourceRules,
                    $( Op::$name(x) => x, )*
                    Op::Opaque(o) => o,
                }
            }
        }
    };
}
crate::graph::op::with_all_ops!(dispatch_rules);

/// Graph inputs, initializers and outer-scope captures: values, not computations.
pub struct SourceRules;

impl OpRules for SourceRules {
    fn arity(&self) -> Arity {
        Arity::fixed(0)
    }

    fn infer(&self, _cx: &InferCx<'_>) -> Result<Vec<Option<TensorType>>, String> {
        Ok(vec![None])
    }

    fn flow(&self, _cx: &mut FlowCx<'_>) -> Option<()> {
        Some(())
    }
}

impl OpRules for crate::graph::op::Opaque {
    fn arity(&self) -> Arity {
        Arity::new(0, MANY, 0, MANY)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Result<Vec<Option<TensorType>>, String> {
        Ok(vec![None; cx.n_out])
    }

    fn eval(&self, _cx: &EvalCx<'_>) -> Result<Vec<Array>, EvalError> {
        Err(EvalError::Unsupported(format!(
            "evaluating {}{}",
            if self.domain.is_empty() { String::new() } else { format!("{}.", self.domain) },
            self.op_type
        )))
    }
}

/// The iteration space of node `n` when its shapes are static (else `None`).
pub(crate) fn static_node(g: &Graph, n: NodeId) -> bool {
    let node = g.node(n);
    let out_static = (0..node.num_outputs()).all(|s| {
        g.tensor_type(Value::new(n, s as u16)).is_some_and(TensorType::is_static) || node.outputs()[s].name.is_empty()
    });
    let in_static = node.inputs().iter().flatten().all(|&v| g.tensor_type(v).is_some_and(TensorType::is_static));
    out_static && in_static && node.num_outputs() > 0
}

impl Op {
    /// The number of input and output slots an op admits.
    pub fn arity(&self) -> Arity {
        self.rules().arity()
    }
}
