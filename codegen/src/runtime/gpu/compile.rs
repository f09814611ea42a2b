//! The pure half of the GPU backend: an op, its inputs' shapes and element types (and the
//! values of the few inputs a kernel needs on the host) become a [`Compiled`] program —
//! WGSL sources, buffer bindings, parameters, workgroup counts — with no device in sight.
//! The executor ([`super::GpuExecutor`]) then only allocates and launches.
//!
//! Every op of the IR implements [`Kernel`] in the file of its kernel family; the dispatch
//! ([`compile`]) is generated from the IR's op list, so a new op does not compile until it
//! says how it runs. Ops that run on the host say so by returning `Ok(None)` and are listed,
//! with the reason, in [`HOST_ONLY`]; the completeness test checks the two agree.

use ir::eval::Array;
use ir::{DType, Op};

use super::Elem;

/// A tensor an op reads, as the compiler sees it.
#[derive(Clone, Debug)]
pub struct TensorDesc<'a> {
    /// Shape.
    pub shape: Vec<usize>,
    /// Logical element type.
    pub dtype: DType,
    /// The values, for the inputs the kernel asked for ([`Kernel::value_inputs`]) and for
    /// small tensors the executor holds on the host anyway.
    pub value: Option<&'a Array>,
}

impl TensorDesc<'_> {
    /// Elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Element storage.
    pub fn elem(&self) -> Elem {
        Elem::of(self.dtype)
    }

    /// The values as integers, when known.
    pub fn ints(&self) -> Option<Vec<i64>> {
        self.value.and_then(|a| a.to_i64().ok())
    }

    /// The values as floats, when known.
    pub fn floats(&self) -> Option<Vec<f64>> {
        self.value.and_then(|a| a.to_f64().ok())
    }
}

/// What [`compile`] sees of a node.
#[derive(Clone, Debug)]
pub struct CompileCx<'a> {
    /// Per input slot: the tensor, or `None` for an omitted input.
    pub ins: Vec<Option<TensorDesc<'a>>>,
    /// Per output slot: its shape and element type, or `None` for an omitted output.
    pub outs: Vec<Option<(Vec<usize>, DType)>>,
    /// The model's default-domain opset.
    pub opset: i64,
    /// The target's fixed subgroup size when kernels may use subgroup operations (`None`:
    /// kernels without them).
    pub subgroup: Option<u32>,
}

impl<'a> CompileCx<'a> {
    /// Input `k`, when given.
    pub fn input(&self, k: usize) -> Option<&TensorDesc<'a>> {
        self.ins.get(k).and_then(Option::as_ref)
    }

    /// Output 0's shape and type.
    pub fn out0(&self) -> Option<&(Vec<usize>, DType)> {
        self.outs.first().and_then(Option::as_ref)
    }

    /// Some output after the first is wanted.
    pub fn extra_outputs(&self) -> bool {
        self.outs.iter().skip(1).any(Option::is_some)
    }
}

/// A buffer a step touches.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Buf {
    /// Input slot `k`.
    In(usize),
    /// Output slot `k`.
    Out(usize),
    /// Scratch buffer `k` of [`Compiled::temps`].
    Tmp(usize),
}

/// One compute dispatch.
#[derive(Clone, Debug, PartialEq)]
pub struct Launch {
    /// The WGSL source (bindings in order, then `P: array<u32>`).
    pub src: String,
    /// The buffers bound, in binding order.
    pub bufs: Vec<Buf>,
    /// The parameters (`P`).
    pub params: Vec<u32>,
    /// Workgroups.
    pub groups: [u32; 3],
    /// At most this many loop iterations in one invocation, summed over its loops (a nested
    /// loop's count multiplied by its parents'); [`UNKNOWN_TRIPS`] when the kernel does not
    /// say. Adapters that stop long loops (lavapipe ends every shader after
    /// [`LAVAPIPE_LOOP_LIMIT`] iterations, silently) run an op on the host instead of a
    /// kernel that would be cut short.
    pub trips: u64,
    /// The element-wise computation the kernel is, where it is one ([`super::wgsl::elementwise`]):
    /// what a fused kernel composes ([`super::fused`]).
    pub pointwise: Option<Box<Pointwise>>,
}

/// An element-wise launch: `out[i] = expr(a, b, c)` over `shape`, the operands broadcast.
#[derive(Clone, Debug, PartialEq)]
pub struct Pointwise {
    /// The operands, bound as `a`, `b`, `c` in order: buffer, shape, storage.
    pub ins: Vec<(Buf, Vec<usize>, Elem)>,
    /// Where the result goes, and its storage.
    pub out: (Buf, Elem),
    /// The output shape.
    pub shape: Vec<usize>,
    /// The expression.
    pub expr: String,
}

/// The trip count of a launch whose kernel has loops but did not bound them.
pub const UNKNOWN_TRIPS: u64 = u64::MAX;

/// Loop iterations after which Mesa's llvmpipe/lavapipe ends a shader invocation
/// (`LP_MAX_TGSI_LOOP_ITERATIONS`, shared by every loop of the shader): a kernel that needs
/// more returns wrong values without an error.
pub const LAVAPIPE_LOOP_LIMIT: u64 = 65535;

/// The loop iterations of loops nested with these trip counts, outermost first:
/// `a + a·b + a·b·c + …` (each level's iterations, all counted).
pub fn nested(extents: &[usize]) -> u64 {
    let mut total = 0u64;
    let mut prod = 1u64;
    for &e in extents {
        prod = prod.saturating_mul(e as u64);
        total = total.saturating_add(prod);
    }
    total
}

/// One step of a compiled op.
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    /// A dispatch.
    Launch(Launch),
    /// Zero-fills a buffer.
    Zero(Buf),
    /// Copies `n` elements from `src` at element `offset` to the start of `dst`.
    Copy {
        /// Source.
        src: Buf,
        /// First element read.
        offset: usize,
        /// Destination.
        dst: Buf,
        /// Elements.
        n: usize,
    },
}

/// How an output is produced.
#[derive(Clone, Debug, PartialEq)]
pub struct OutSpec {
    /// Shape.
    pub shape: Vec<usize>,
    /// Logical element type.
    pub dtype: DType,
    /// The output is input `k`'s buffer seen with another shape (no copy, no kernel).
    pub view_of: Option<usize>,
}

/// A compiled op: the buffers it needs and the steps that fill its outputs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Compiled {
    /// Per output slot.
    pub outputs: Vec<OutSpec>,
    /// Scratch buffers: shape and type.
    pub temps: Vec<(Vec<usize>, DType)>,
    /// In order.
    pub steps: Vec<Step>,
    /// The target's fixed subgroup size, from [`CompileCx::subgroup`] when the program is
    /// made for a context ([`Compiled::like_out0`]): what shared kernels such as the GEMM
    /// may use.
    pub subgroup: Option<u32>,
}

impl Compiled {
    /// A program with `outputs` allocated fresh.
    pub fn new(outputs: Vec<(Vec<usize>, DType)>) -> Compiled {
        Compiled {
            outputs: outputs.into_iter().map(|(shape, dtype)| OutSpec { shape, dtype, view_of: None }).collect(),
            ..Compiled::default()
        }
    }

    /// One new output of the shape and type the graph gives output 0.
    pub fn like_out0(cx: &CompileCx<'_>) -> Option<Compiled> {
        let (shape, dtype) = cx.out0()?.clone();
        Some(Compiled { subgroup: cx.subgroup, ..Compiled::new(vec![(shape, dtype)]) })
    }

    /// Output 0 as a view of input 0 with output 0's shape.
    pub fn view(cx: &CompileCx<'_>) -> Option<Compiled> {
        let (shape, dtype) = cx.out0()?.clone();
        Some(Compiled { outputs: vec![OutSpec { shape, dtype, view_of: Some(0) }], ..Compiled::default() })
    }

    /// Adds a scratch buffer.
    pub fn temp(&mut self, shape: Vec<usize>, dtype: DType) -> Buf {
        self.temps.push((shape, dtype));
        Buf::Tmp(self.temps.len() - 1)
    }

    /// Adds a dispatch of `src` over `bufs` with `params`, `groups` workgroups; a kernel with
    /// loops added this way has [`UNKNOWN_TRIPS`] (use [`Compiled::launch_loop`]).
    pub fn launch(&mut self, src: String, bufs: Vec<Buf>, params: Vec<u32>, groups: [u32; 3]) {
        let trips =
            if src.contains("for (") || src.contains("loop {") || src.contains("while (") { UNKNOWN_TRIPS } else { 0 };
        self.steps.push(Step::Launch(Launch { src, bufs, params, groups, trips, pointwise: None }));
    }

    /// Adds a dispatch whose invocations run at most `trips` loop iterations in all.
    pub fn launch_loop(&mut self, src: String, bufs: Vec<Buf>, params: Vec<u32>, groups: [u32; 3], trips: u64) {
        self.steps.push(Step::Launch(Launch { src, bufs, params, groups, trips, pointwise: None }));
    }

    /// The most loop iterations any invocation of any dispatch runs.
    pub fn max_trips(&self) -> u64 {
        self.launches().map(|l| l.trips).max().unwrap_or(0)
    }

    /// Every dispatch, in order.
    pub fn launches(&self) -> impl Iterator<Item = &Launch> {
        self.steps.iter().filter_map(|s| if let Step::Launch(l) = s { Some(l) } else { None })
    }
}

/// Workgroups for `threads` invocations of the [`WORKGROUP`]-wide 1-D kernels.
pub fn groups(threads: usize) -> [u32; 3] {
    let g = threads.div_ceil(WORKGROUP).max(1) as u64;
    // Past the 65535 groups one dimension allows, as few rows as needed and the groups
    // spread evenly over them (not full rows and a nearly empty last one: lavapipe pays
    // for every group, even one that returns at once).
    let rows = g.div_ceil(65535);
    [g.div_ceil(rows) as u32, rows as u32, 1]
}

/// Invocations per workgroup of the 1-D kernels ([`super::wgsl::source`]).
pub const WORKGROUP: usize = 64;

/// The result of compiling an op: `Ok(None)` when it runs on the host.
pub type CompileResult = Result<Option<Compiled>, String>;

/// How an op runs on a GPU.
pub trait Kernel {
    /// The program for the op on these inputs, or `Ok(None)` to run it on the host (always
    /// for ops in [`HOST_ONLY`]; for others only for element types or attributes the kernels
    /// do not cover).
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult;

    /// Inputs whose values the compiler needs on the host (shape operands, bounds, flags).
    fn value_inputs(&self) -> &'static [usize] {
        &[]
    }

    /// An element-wise op's derivative times dY as a WGSL expression over `a` (X), `b` (Y)
    /// and `c` (dY), for `ElementwiseGrad`'s kernel; `None` (the default) for other ops.
    fn derivative(&self) -> Option<String> {
        None
    }
}

/// Ops that always run on the host, and why. Everything else has a kernel for float inputs.
pub const HOST_ONLY: &[(&str, &str)] = &[
    ("Shape", "a shape is host metadata"),
    ("Size", "a shape is host metadata"),
    ("Constant", "folded to an initializer before it runs"),
    ("ConstantOfShape", "its output shape is a runtime value; filled once on the host"),
    ("Range", "its length is a runtime value"),
    ("NonZero", "its output size depends on the data"),
    ("TopK", "a sort; k is small and the op is rare in training graphs"),
    ("Einsum", "a general contraction, run by the reference evaluator"),
    ("GatherElements", "index-dependent scatter of reads, rare in training graphs"),
    ("GatherND", "index-dependent, rare in training graphs"),
    ("ScatterND", "a scatter with possible collisions (WGSL has no float atomics)"),
    ("ScatterElements", "a scatter with possible collisions (WGSL has no float atomics)"),
    ("OneHot", "index-dependent, small"),
    ("CumSum", "a scan, rare in training graphs"),
    ("Trilu", "mask construction, usually folded"),
    ("EyeLike", "constant construction"),
    ("DepthToSpace", "block permutation, rare in training graphs"),
    ("SpaceToDepth", "block permutation, rare in training graphs"),
    ("LRN", "a legacy normalization (AlexNet-era)"),
    ("LpNormalization", "rare; the reference kernel runs it"),
    ("MeanVarianceNormalization", "rare; the reference kernel runs it"),
    ("GroupNormalization", "grouped statistics; the reference kernel runs it"),
    ("GlobalLpPool", "rare; the reference kernel runs it"),
    ("BitShift", "64-bit integer arithmetic (devices hold i32)"),
    ("BitwiseAnd", "64-bit integer arithmetic (devices hold i32)"),
    ("BitwiseOr", "64-bit integer arithmetic (devices hold i32)"),
    ("BitwiseXor", "64-bit integer arithmetic (devices hold i32)"),
    ("BitwiseNot", "64-bit integer arithmetic (devices hold i32)"),
    ("BitCast", "a reinterpretation of bits, rare"),
    ("SwiGLU", "a gated activation, rare outside fused exports"),
    ("Det", "an LU factorization per matrix"),
    ("RMSNormalization", "row statistics; the reference kernel runs it"),
    ("MaxUnpool", "an index scatter"),
    ("RotaryEmbedding", "position-dependent rotation, small"),
    ("CumProd", "a scan, rare in training graphs"),
    ("Scatter", "a scatter with possible collisions (WGSL has no float atomics)"),
    ("Compress", "its output size depends on the data"),
    ("ReverseSequence", "per-batch index remap, rare"),
    ("TensorScatter", "a cache update by index"),
    ("Unique", "its output size depends on the data"),
    ("CenterCropPad", "a crop/pad index remap, rare"),
    ("QuantizeLinear", "quantized arithmetic runs on the reference kernels"),
    ("DequantizeLinear", "quantized arithmetic runs on the reference kernels"),
    ("DynamicQuantizeLinear", "quantized arithmetic runs on the reference kernels"),
    ("MatMulInteger", "integer arithmetic wider than the devices' i32 lanes hold exactly"),
    ("QLinearMatMul", "quantized arithmetic runs on the reference kernels"),
    ("ConvInteger", "integer arithmetic runs on the reference kernels"),
    ("QLinearConv", "quantized arithmetic runs on the reference kernels"),
    ("DFT", "a direct transform, rare in training graphs"),
    ("STFT", "a framed transform, rare in training graphs"),
    ("HannWindow", "constant construction"),
    ("HammingWindow", "constant construction"),
    ("BlackmanWindow", "constant construction"),
    ("MelWeightMatrix", "constant construction"),
    ("GridSample", "data-dependent gathers"),
    ("AffineGrid", "a small grid construction"),
    ("Col2Im", "a scatter-add of blocks"),
    ("RoiAlign", "data-dependent sampling"),
    ("RoiAlignGrad", "a data-dependent scatter of samples"),
    ("MoERoute", "a serial count of routed pairs per device, small integers; it refuses an overflow"),
    (
        "MoEDispatch",
        "rows moved to the dispatcher's buffer by index, beside its all-to-alls (which run through the host)",
    ),
    ("MoECombine", "the dispatcher's rows summed back per token by index, beside its all-to-alls"),
    ("NonMaxSuppression", "its output size depends on the data"),
    ("StringConcat", "strings live on the host"),
    ("StringSplit", "strings live on the host"),
    ("StringNormalizer", "strings live on the host"),
    ("RegexFullMatch", "strings live on the host"),
    ("If", "control flow: the subgraph runs on the host"),
    ("Loop", "control flow: the subgraph runs on the host"),
    ("Scan", "control flow: the subgraph runs on the host"),
    ("AllReduce", "communication: the runtime moves it through the host"),
    ("AllGather", "communication: the runtime moves it through the host"),
    ("ReduceScatter", "communication: the runtime moves it through the host"),
    ("AllToAll", "communication: the runtime moves it through the host"),
    ("HaloExchange", "communication: the runtime moves it through the host"),
    ("Send", "communication: the runtime moves it through the host"),
    ("Recv", "communication: the runtime moves it through the host"),
];

/// Whether an op type is in [`HOST_ONLY`].
pub fn host_only(op_type: &str) -> bool {
    HOST_ONLY.iter().any(|(t, _)| *t == op_type)
}

/// Ops that run on the host: one line each.
macro_rules! host_kernels {
    ($($name:ident),* $(,)?) => {$(
        impl Kernel for ir::op::$name {
            fn compile(&self, _cx: &CompileCx<'_>) -> CompileResult {
                Ok(None)
            }
        }
    )*};
}

host_kernels!(
    Shape,
    Size,
    Constant,
    ConstantOfShape,
    Range,
    NonZero,
    TopK,
    Einsum,
    GatherElements,
    GatherND,
    ScatterND,
    ScatterElements,
    OneHot,
    CumSum,
    Trilu,
    EyeLike,
    DepthToSpace,
    SpaceToDepth,
    LRN,
    LpNormalization,
    MeanVarianceNormalization,
    GroupNormalization,
    GlobalLpPool,
    BitShift,
    BitwiseAnd,
    BitwiseOr,
    BitwiseXor,
    BitwiseNot,
    BitCast,
    SwiGLU,
    Det,
    RMSNormalization,
    MaxUnpool,
    RotaryEmbedding,
    CumProd,
    Scatter,
    Compress,
    ReverseSequence,
    TensorScatter,
    Unique,
    CenterCropPad,
    QuantizeLinear,
    DequantizeLinear,
    DynamicQuantizeLinear,
    MatMulInteger,
    QLinearMatMul,
    ConvInteger,
    QLinearConv,
    DFT,
    STFT,
    HannWindow,
    HammingWindow,
    BlackmanWindow,
    MelWeightMatrix,
    GridSample,
    AffineGrid,
    Col2Im,
    RoiAlign,
    RoiAlignGrad,
    MoERoute,
    MoEDispatch,
    MoECombine,
    NonMaxSuppression,
    StringConcat,
    StringSplit,
    StringNormalizer,
    RegexFullMatch,
    If,
    Loop,
    Scan,
    AllReduce,
    AllGather,
    ReduceScatter,
    AllToAll,
    HaloExchange,
    Send,
    Recv,
);

macro_rules! dispatch {
    ($($name:ident),*) => {
        /// Compiles `op` (see [`Kernel::compile`]); sources and opaque ops run on the host.
        pub fn compile(op: &Op, cx: &CompileCx<'_>) -> CompileResult {
            match op {
                $( Op::$name(x) => Kernel::compile(x, cx), )*
                Op::Input { .. } | Op::Initializer(_) | Op::OuterRef | Op::Opaque(_) => Ok(None),
            }
        }

        /// `op`'s derivative expression (see [`Kernel::derivative`]).
        pub fn derivative(op: &Op) -> Option<String> {
            match op {
                $( Op::$name(x) => Kernel::derivative(x), )*
                Op::Input { .. } | Op::Initializer(_) | Op::OuterRef | Op::Opaque(_) => None,
            }
        }

        /// The inputs whose values compiling `op` needs (see [`Kernel::value_inputs`]).
        pub fn value_inputs(op: &Op) -> &'static [usize] {
            match op {
                $( Op::$name(x) => Kernel::value_inputs(x), )*
                Op::Input { .. } | Op::Initializer(_) | Op::OuterRef | Op::Opaque(_) => &[],
            }
        }
    };
}

ir::for_all_ops!(dispatch);
