//! Formula tests: each expected number is worked out by hand in the comment above it, on a
//! toy cluster with round constants (peak 1 TFLOP/s at efficiency 1, 100 GB/s memory,
//! 10 GB/s links, no latencies or launch costs).

use ir::shard::LinkLevel;
use ir::{DType, Graph, Model, Op, Tensor, TensorType, op};

use super::Schedule;
use super::cluster::{BySize, Cluster, Device, HostLink, Link, PeakFlops, Topology};
use super::model::{Assignment, CostModel, InputPath, Optimizer, Options, Precision};
use crate::autoshard::named::Named;

fn toy() -> Cluster {
    Cluster {
        name: "toy".into(),
        source: "round numbers for hand calculations".into(),
        nodes: 1,
        devices_per_node: 8,
        device: Device {
            name: "toy".into(),
            peak_flops: PeakFlops { fp32: 1e12, tf32: None, fp16: None },
            efficiency: 1.0,
            mem_bandwidth: 1e11,
            mem_capacity: 1e9,
            mem_usable: 1.0,
            launch_overhead: 0.0,
            shared_host: false,
            launch_contention: 0.0,
            host_use: 1.0,
            host_staged: false,
            ring_contention: 0.0,
            host_cores: 0,
            // No tile quantization or reduction overhead: efficiency is flat.
            gemm_tile: 1,
            gemm_k_overhead: 0.0,
            sms: 0,
            conv_grad_efficiency: 1.0,
            attention_efficiency: [0.0; 2],
            transpose_efficiency: 1.0,
            transpose_cached_bytes: 0.0,
            kernel_factors: Default::default(),
            parallel_width: 0.0,
            serial_slowdown: 1.0,
            in_place_update: false,
            fused_elementwise: false,
        },
        intra: Link {
            bandwidth: 1e10,
            latency: 0.0,
            topology: Topology::Switch,
            shared_by: 1,
            by_size: BySize::default(),
        },
        inter: None,
        nics_per_node: 1,
        host: HostLink { bandwidth: 1e10, latency: 0.0, shared_by: 2, by_size: BySize::default() },
    }
}

fn opts() -> Options {
    Options { overlap_grad_sync: false, optimizer: Optimizer::Adam, ..Options::default() }
}

/// X [64, 1024] (input) · W [1024, 4096] (parameter) = Y [64, 4096].
fn gemm_graph() -> Graph {
    let mut g = Graph::new("gemm");
    let x = g.add_input("x", Some(TensorType::fixed(DType::Float, &[64, 1024]).into()));
    let w = g.add_initializer(
        "w",
        Tensor { dtype: DType::Float, dims: vec![1024, 4096], name: None, data: ir::TensorData::External(vec![]) },
    );
    let y = g.add_simple(Op::MatMul(op::MatMul::default()), &[x, w], "y");
    g.add_output(y, None);
    let mut m = Model::new(g, 17);
    ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap();
    m.graph
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * b.abs().max(1e-12)
}

#[test]
fn data_parallel_gemm_by_hand() {
    let g = gemm_graph();
    let c = toy();
    let cm = CostModel::new(&g, &c, c.mesh(8).unwrap(), opts());
    let mm = cm.order()[0];
    // MatMul dims: m (0), n (1), k (2). Data parallel splits m.
    let asg = Assignment { strategies: [(mm, vec![Some(0)])].into_iter().collect() };
    let t = cm.op_time(mm, &[Some(0)]);
    // Forward: 2·64·1024·4096 = 536,870,912 FLOPs, /8 = 67,108,864 → 67.1 µs of compute;
    // bytes: (x 262,144 + y 1,048,576)/8 + w 16,777,216 (replicated) = 16,941,056 → 169.41 µs.
    assert!(close(t.fwd, 16_941_056.0 / 1e11), "{}", t.fwd);
    // Backward: only the weight gradient (x is a graph input): 67,108,864 FLOPs, bytes twice
    // the forward's → 338.82 µs.
    assert!(close(t.bwd, 2.0 * 16_941_056.0 / 1e11), "{}", t.bwd);
    let b = cm.evaluate(&asg);
    // Gradient all-reduce of w (16,777,216 B) over 8: 2·7/8·16,777,216/1e10 = 2.936 ms.
    let sync = 2.0 * 7.0 / 8.0 * 16_777_216.0 / 1e10;
    assert!(close(b.gradient_sync_s, sync));
    assert!(close(b.exposed_gradient_sync_s, sync));
    // Adam update: 4,194,304 local parameters × 28 B / 1e11 = 1.1744 ms.
    let update = 4_194_304.0 * 28.0 / 1e11;
    assert!(close(b.update_s, update));
    // Input: each device pulls 262,144/8 = 32,768 B, two per host link: 32,768·2/1e10 with
    // preloading hidden entirely.
    assert!(close(b.input_transfer_s, 32_768.0 * 2.0 / 1e10));
    assert_eq!(b.input_s, 0.0);
    assert!(close(b.step_time_s, t.fwd + t.bwd + sync + update));
    // Memory: weights 16 MiB, gradients 16 MiB, Adam 8 B × 4,194,304 = 32 MiB; no
    // activations (the backward reads only x, the model's input, and w); workspace y/8 =
    // 131,072 B.
    assert!(close(b.memory.weights, 16_777_216.0));
    assert!(close(b.memory.gradients, 16_777_216.0));
    assert!(close(b.memory.optimizer, 33_554_432.0));
    assert_eq!(b.memory.activations, 0.0);
    assert!(close(b.memory.workspace, 131_072.0));
    assert!(close(b.memory.total(), 16_777_216.0 * 4.0 + 131_072.0));
}

#[test]
fn a_kernel_factor_scales_its_op_types_price() {
    // The toy MatMul's forward (169.41 µs, memory-bound) on a device whose MatMul kernels
    // measured 3× their price: 508.23 µs; its backward (a training program prices its
    // gradient ops as their own types) and other op types keep theirs.
    let g = gemm_graph();
    let mut c = toy();
    let cm = CostModel::new(&g, &c, c.mesh(8).unwrap(), opts());
    let mm = cm.order()[0];
    let t = cm.op_time(mm, &[Some(0)]);
    c.device.kernel_factors.insert("MatMul".into(), 3.0);
    c.device.kernel_factors.insert("Relu".into(), 7.0);
    let cm = CostModel::new(&g, &c, c.mesh(8).unwrap(), opts());
    let k = cm.op_time(mm, &[Some(0)]);
    assert!(close(k.fwd, 3.0 * 16_941_056.0 / 1e11), "{}", k.fwd);
    assert!(close(k.bwd, t.bwd), "{} vs {}", k.bwd, t.bwd);
}

#[test]
fn a_strided_transpose_keeps_its_own_rate_not_the_kernel_factor() {
    // Transposes of [64, 64] (16 KB, streams) and [1024, 1024] floats (4 MB, past the 1 MB a
    // transpose streams within): the first at 3× its roofline (2·16,384 B / 1e11 = 0.328 µs
    // → 0.983 µs), the second at its strided rate only (2·4,194,304 B / (0.25·1e11) =
    // 335.5 µs), not 3× that as well.
    let mut g = Graph::new("transposes");
    for (name, side) in [("small", 64), ("large", 1024)] {
        let x = g.add_input(name, Some(TensorType::fixed(DType::Float, &[side, side]).into()));
        let y = g.add_simple(Op::Transpose(op::Transpose { perm: Some(vec![1, 0]) }), &[x], format!("{name}_t"));
        g.add_output(y, None);
    }
    let mut m = Model::new(g, 17);
    ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap();
    let mut c = toy();
    c.device.transpose_efficiency = 0.25;
    c.device.transpose_cached_bytes = 1e6;
    c.device.kernel_factors.insert("Transpose".into(), 3.0);
    let cm = CostModel::new(&m.graph, &c, c.mesh(1).unwrap(), opts());
    let (small, large) = (cm.order()[0], cm.order()[1]);
    let t = cm.op_time(small, &[None]);
    assert!(close(t.fwd, 3.0 * 2.0 * 16_384.0 / 1e11), "{}", t.fwd);
    let t = cm.op_time(large, &[None]);
    assert!(close(t.fwd, 2.0 * 4_194_304.0 / (0.25 * 1e11)), "{}", t.fwd);
}

#[test]
fn kernels_of_few_invocations_run_slower() {
    // Softmax over rows of 4096 (4 rows: one invocation each) and of 16 (1024 rows), both
    // 16,384 floats: 2·65,536 B / 1e11 = 1.311 µs at the roofline. On a device filled by 256
    // invocations, at most 8× slower with one: the 4 rows at 256/4 = 64 → 8×, the 1024 at 1×.
    let mut g = Graph::new("rows");
    for (name, rows) in [("few", 4), ("many", 1024)] {
        let x = g.add_input(name, Some(TensorType::fixed(DType::Float, &[rows, 16384 / rows]).into()));
        let y = g.add_simple(Op::Softmax(op::Softmax { axis: Some(-1) }), &[x], format!("{name}_s"));
        g.add_output(y, None);
    }
    let mut m = Model::new(g, 17);
    ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap();
    let sm: Vec<_> = m.graph.node_ids().filter(|&n| matches!(m.graph.node(n).op, Op::Softmax(_))).collect();
    // The op's own facts: one invocation per row.
    assert_eq!(ir::cost::node_cost(&m.graph, sm[0], &Default::default()).parallel, 4.0);
    assert_eq!(ir::cost::node_cost(&m.graph, sm[1], &Default::default()).parallel, 1024.0);
    let mut c = toy();
    c.device.parallel_width = 256.0;
    c.device.serial_slowdown = 8.0;
    let cm = CostModel::new(&m.graph, &c, c.mesh(1).unwrap(), opts());
    let roof = 2.0 * 65_536.0 / 1e11;
    assert!(close(cm.op_time(sm[0], &[None]).fwd, 8.0 * roof), "{}", cm.op_time(sm[0], &[None]).fwd);
    assert!(close(cm.op_time(sm[1], &[None]).fwd, roof), "{}", cm.op_time(sm[1], &[None]).fwd);
    assert!(close(cm.underfill(128.0), 2.0) && close(cm.underfill(0.0), 1.0));
}

#[test]
fn column_parallel_gemm_needs_no_gradient_sync() {
    let g = gemm_graph();
    let c = toy();
    let cm = CostModel::new(&g, &c, c.mesh(8).unwrap(), Options { optimizer: Optimizer::Sgd, ..opts() });
    let mm = cm.order()[0];
    // Split n (output features): w is stored split, x replicated.
    let b = cm.evaluate(&Assignment { strategies: [(mm, vec![Some(1)])].into_iter().collect() });
    assert_eq!(b.gradient_sync_s, 0.0);
    // Weights per device: 16,777,216/8 = 2,097,152 B; SGD state 4 B × 524,288.
    assert!(close(b.memory.weights, 2_097_152.0));
    assert!(close(b.memory.optimizer, 2_097_152.0));
    // SGD update: 524,288 × 20 B / 1e11.
    assert!(close(b.update_s, 524_288.0 * 20.0 / 1e11));
    // Every device needs the whole input: 262,144·2/1e10 (two devices per host link).
    assert!(close(b.input_transfer_s, 262_144.0 * 2.0 / 1e10));
}

#[test]
fn row_parallel_gemm_all_reduces_its_output() {
    // Y = X·W then Z = Y + Y (to consume Y replicated).
    let mut g = gemm_graph();
    let y = g.lookup("y").unwrap();
    let out0 = g.outputs()[0].value;
    let z = g.add_simple(Op::Add(op::Add::default()), &[y, y], "z");
    g.set_outputs(vec![ir::GraphOutput { value: z, ty: None }]);
    let _ = out0;
    ir::infer::infer_shapes(&mut g, ir::infer::Mode::Reset).unwrap();
    let c = toy();
    let cm = CostModel::new(&g, &c, c.mesh(8).unwrap(), opts());
    let (mm, add) = (cm.order()[0], cm.order()[1]);
    // Split k: y is a partial sum; the Add (replicated) needs it whole: all-reduce of
    // 1,048,576 B: 2·7/8·1,048,576/1e10 = 183.5 µs, forward only (the gradient of a sum is
    // the same everywhere). Add reads y twice, but y is made whole once: one all-reduce.
    let b = cm.evaluate(&Assignment { strategies: [(mm, vec![Some(2)]), (add, vec![None])].into_iter().collect() });
    let ar = 2.0 * 7.0 / 8.0 * 1_048_576.0 / 1e10;
    assert!(close(b.communication_by_kind["all_reduce"], ar), "{:?}", b.communication_by_kind);
}

#[test]
fn overlapped_tensor_parallel_collectives_hide_behind_their_gemm() {
    // The row-parallel GEMM of the test above: the all-reduce of its partial sums (183.5 µs)
    // is made for the Add, which reads the GEMM's output. Overlapped (Megatron's
    // --tp-comm-overlap), it runs beside the GEMM's forward: only what outlasts the GEMM is
    // exposed, and the GEMM runs `overlap_slowdown` times slower meanwhile.
    let mut g = gemm_graph();
    let y = g.lookup("y").unwrap();
    let z = g.add_simple(Op::Add(op::Add::default()), &[y, y], "z");
    g.set_outputs(vec![ir::GraphOutput { value: z, ty: None }]);
    ir::infer::infer_shapes(&mut g, ir::infer::Mode::Reset).unwrap();
    let c = toy();
    let step = |o: Options| {
        let cm = CostModel::new(&g, &c, c.mesh(8).unwrap(), o);
        let (mm, add) = (cm.order()[0], cm.order()[1]);
        let gemm = cm.op_time(mm, &[Some(2)]).fwd;
        let asg = Assignment { strategies: [(mm, vec![Some(2)]), (add, vec![None])].into_iter().collect() };
        (cm.evaluate(&asg).forward_s, gemm)
    };
    let ar = 2.0 * 7.0 / 8.0 * 1_048_576.0 / 1e10;
    let (plain, gemm) = step(opts());
    assert!(gemm < ar, "the GEMM ({gemm} s) is shorter than the all-reduce ({ar} s)");
    for slowdown in [1.0, 1.2] {
        let (overlapped, _) = step(Options { tp_comm_overlap: true, overlap_slowdown: slowdown, ..opts() });
        let hidden = gemm * (2.0 - slowdown);
        assert!(close(plain - overlapped, hidden), "{plain} - {overlapped} vs {hidden}");
    }
}

#[test]
fn zero_parameter_gathers_overlap_the_next_forward() {
    // Data-parallel GEMM under ZeRO-1: the gradient is reduce-scattered when the only
    // backward ends (nothing to hide behind), the updated shards all-gathered after the
    // update. Where synchronisation overlaps, that all-gather runs beside the next step's
    // forward (Megatron's --overlap-param-gather): exposed by the forward's time less.
    let g = gemm_graph();
    let c = toy();
    let run = |overlap: bool| {
        let o = Options { zero: 1, overlap_grad_sync: overlap, overlap_slowdown: 1.0, ..opts() };
        let cm = CostModel::new(&g, &c, c.mesh(8).unwrap(), o);
        let mm = cm.order()[0];
        cm.evaluate(&Assignment { strategies: [(mm, vec![Some(0)])].into_iter().collect() })
    };
    let (apart, beside) = (run(false), run(true));
    assert!(close(apart.exposed_gradient_sync_s, apart.gradient_sync_s));
    assert!(close(apart.exposed_gradient_sync_s - beside.exposed_gradient_sync_s, beside.forward_s));
}

#[test]
fn gradient_buckets_fill_with_the_local_shards_bytes() {
    // Four column-parallel GEMMs X·W1·W2·W3·W4 (W 256×256 fp32: 262,144 B whole, 65,536 B
    // per device split 4 ways over `tensor`), data-parallel over `data` (2). With 200 kB
    // buckets the four local gradients (262,144 B together) fill one bucket: the ring's
    // latency 2(p−1)α is paid once, not once per whole-size gradient (four times).
    let mut g = Graph::new("chain");
    let mut x = g.add_input("x", Some(TensorType::fixed(DType::Float, &[64, 256]).into()));
    for i in 0..4 {
        let w = g.add_initializer(
            format!("w{i}"),
            Tensor { dtype: DType::Float, dims: vec![256, 256], name: None, data: ir::TensorData::External(vec![]) },
        );
        x = g.add_simple(Op::MatMul(op::MatMul::default()), &[x, w], format!("y{i}"));
    }
    g.add_output(x, None);
    ir::infer::infer_shapes(&mut g, ir::infer::Mode::Check).unwrap();
    let mesh = ir::shard::Mesh {
        axes: vec![
            ir::shard::MeshAxis { name: "data".into(), size: 2, level: LinkLevel::Intra },
            ir::shard::MeshAxis { name: "tensor".into(), size: 4, level: LinkLevel::Intra },
        ],
    };
    let sync = |latency: f64| {
        let mut c = toy();
        c.intra.latency = latency;
        let o = Options { bucket_bytes: 200e3, first_bucket_bytes: 200e3, ..opts() };
        let cm = CostModel::new(&g, &c, mesh.clone(), o);
        // MatMul dims m (0), n (1), k (2): rows over `data`, columns over `tensor`.
        let strategies = cm.order().iter().map(|&n| (n, vec![Some(0), Some(1)])).collect();
        cm.evaluate(&Assignment { strategies }).gradient_sync_s
    };
    let alpha = 1e-3;
    assert!(close(sync(alpha) - sync(0.0), 2.0 * alpha), "{} s of latency", sync(alpha) - sync(0.0));
}

#[test]
fn halo_exchange_of_a_split_convolution() {
    // Conv 3×3, stride 1, pad 1 on X [1, 8, 64, 64], split H over 4 devices: each device
    // needs one row from each neighbour. A row of its input block is 8 channels × 64 × 4 B =
    // 2,048 B; forward and backward each send one row: 2 × 2,048/1e10.
    let mut g = Graph::new("conv");
    let x = g.add_input("x", Some(TensorType::fixed(DType::Float, &[1, 8, 64, 64]).into()));
    let w = g.add_initializer(
        "w",
        Tensor { dtype: DType::Float, dims: vec![8, 8, 3, 3], name: None, data: ir::TensorData::External(vec![]) },
    );
    let y = g.add_simple(Op::Conv(op::Conv { pads: Some(vec![1, 1, 1, 1]), ..Default::default() }), &[x, w], "y");
    g.add_output(y, None);
    ir::infer::infer_shapes(&mut g, ir::infer::Mode::Check).unwrap();
    let c = toy();
    let cm = CostModel::new(&g, &c, c.mesh(4).unwrap(), opts());
    let conv = cm.order()[0];
    let sp = cm.space(conv);
    let h = sp.dims.iter().position(|d| d.name == "s0").unwrap();
    assert_eq!(sp.dims[h].kind, ir::shard::DimKind::Spatial { halo: (1, 1), stride: 1 });
    let t = cm.op_time(conv, &[Some(h)]);
    // Each device holds 16 of the 64 rows; a 3×3 window needs one row from each neighbour. An
    // inner device sends one row (8 channels × 64 × 4 B = 2048 B) to each neighbour: 4096 B,
    // 4096/1e10 s; the backward pass sends as much gradient back: 2·4096/1e10 in all.
    assert!(close(t.halo, 2.0 * 4096.0 / 1e10), "{}", t.halo);
}

#[test]
fn staged_input_goes_through_device_zero() {
    let g = gemm_graph();
    let c = toy();
    let o = Options { input_path: InputPath::Staged, preload: false, ..opts() };
    let cm = CostModel::new(&g, &c, c.mesh(8).unwrap(), o);
    let mm = cm.order()[0];
    let b = cm.evaluate(&Assignment { strategies: [(mm, vec![Some(0)])].into_iter().collect() });
    // Host → device 0: 262,144/1e10; then 7 sends of 32,768 B over device links.
    let want = 262_144.0 / 1e10 + 7.0 * 32_768.0 / 1e10;
    assert!(close(b.input_transfer_s, want), "{}", b.input_transfer_s);
    assert!(close(b.input_s, want));
}

#[test]
fn overlapped_gradient_sync_hides_behind_backward() {
    let g = gemm_graph();
    let c = toy();
    let o = Options { overlap_grad_sync: true, overlap_slowdown: 1.0, ..opts() };
    let cm = CostModel::new(&g, &c, c.mesh(8).unwrap(), o);
    let mm = cm.order()[0];
    let b = cm.evaluate(&Assignment { strategies: [(mm, vec![Some(0)])].into_iter().collect() });
    // The only gradient is ready when the only backward ends: nothing to hide behind.
    assert!(close(b.exposed_gradient_sync_s, b.gradient_sync_s));
    // Compression halves the bytes.
    let cm2 = CostModel::new(&g, &c, c.mesh(8).unwrap(), Options { grad_compression: 0.5, ..opts() });
    let b2 = cm2.evaluate(&Assignment { strategies: [(mm, vec![Some(0)])].into_iter().collect() });
    assert!(close(b2.gradient_sync_s, b.gradient_sync_s / 2.0));
}

#[test]
fn pipeline_schedules() {
    // Two stages, forward 1 and 2, backward 2 and 4, four micro-batches.
    let (f, b) = ([1.0, 2.0], [2.0, 4.0]);
    // GPipe: (4 + 2 − 1)(max f + max b) = 5 · 6 = 30; 1F1B: 5 · max(f + b) = 5 · 6 = 30.
    assert_eq!(Schedule::GPipe.makespan(&f, &b, 4), 30.0);
    assert_eq!(Schedule::OneFOneB.makespan(&f, &b, 4), 30.0);
    // Unbalanced the other way: f = [3, 1], b = [1, 3]: GPipe 5 · (3 + 3) = 30, 1F1B 5 · 4 = 20.
    assert_eq!(Schedule::GPipe.makespan(&[3.0, 1.0], &[1.0, 3.0], 4), 30.0);
    assert_eq!(Schedule::OneFOneB.makespan(&[3.0, 1.0], &[1.0, 3.0], 4), 20.0);
    // Bubble fraction (S−1)/(M+S−1): with S = 4, M = 12: 3/15 of the makespan.
    let mk = Schedule::OneFOneB.makespan(&[1.0; 4], &[1.0; 4], 12);
    let slot = mk / 15.0;
    assert!(close(3.0 * slot / mk, 3.0 / 15.0));
    // Activation memory: GPipe keeps M micro-batches in every stage, 1F1B min(M, S − s).
    assert_eq!(Schedule::GPipe.in_flight(0, 4, 8), 8.0);
    assert_eq!(Schedule::OneFOneB.in_flight(0, 4, 8), 4.0);
    assert_eq!(Schedule::OneFOneB.in_flight(3, 4, 8), 1.0);
}

#[test]
fn the_interleaved_schedule_shrinks_the_bubble_and_keeps_more_in_flight() {
    // S = 4 stages, M = 12 micro-batches, V = 3 chunks: (M + (S − 1)/V) = 13 slots of
    // max(f + b) instead of 15; the bubble a third of 1F1B's.
    let i3 = Schedule::Interleaved(3);
    assert_eq!(i3.slots(4, 12), 13.0);
    assert_eq!(i3.makespan(&[1.0; 4], &[2.0; 4], 12), 39.0);
    assert_eq!(Schedule::OneFOneB.makespan(&[1.0; 4], &[2.0; 4], 12), 45.0);
    assert!(close((i3.slots(4, 12) - 12.0) * 3.0, Schedule::OneFOneB.slots(4, 12) - 12.0));
    // Stage 0 holds S + (S − 1)/V micro-batches' activations (Korthikanti et al. 2022, §4.2.3):
    // 4 + 1 = 5 here; the last stage (S − 1) (2·0 + 2·4 + 1)/3 = 3; never more than M.
    assert_eq!(i3.in_flight(0, 4, 12), 5.0);
    assert_eq!(i3.in_flight(3, 4, 12), 3.0);
    assert_eq!(i3.in_flight(0, 4, 2), 2.0);
    assert_eq!(i3.name(), "interleaved:3");
    assert_eq!(Named::parse("pipeline:4:12:interleaved:3:tp:2").unwrap().name(), "pipeline:4:12:interleaved:3:tp:2");
    assert_eq!(
        Named::parse("pipeline:4:12:interleaved:3:tp:2").unwrap(),
        Named::Pipeline { stages: 4, micro: 12, schedule: i3, tensor: 2, expert: 1 }
    );
    assert_eq!(Named::parse("pipeline:4:12").unwrap().name(), "pipeline:4:12:1f1b");
    assert!(Named::parse("pipeline:4:12:interleaved:1").unwrap_err().contains("V ≥ 2"));
    assert!(Named::parse("pipeline:4:12:1f1b:tp:0").unwrap_err().contains("tp:T"));
}

#[test]
fn meshes_span_nodes_with_the_inter_link() {
    let c = Cluster::preset("a100-cluster-2").unwrap();
    let m = c.mesh(16).unwrap();
    assert_eq!(m.axes[0].level, LinkLevel::Inter);
    assert_eq!(c.link(LinkLevel::Inter).bandwidth, 22e9);
}

#[test]
fn a_links_bandwidth_by_size_interpolates_the_time_per_byte_in_log_size() {
    let curve = BySize(vec![(1e6, 2.0), (1e8, 0.5)]);
    // Below the first point and above the last their factors hold; no points: 1.
    assert_eq!(curve.factor(1e3), 2.0);
    assert_eq!(curve.factor(1e9), 0.5);
    assert_eq!(BySize::default().factor(1e6), 1.0);
    // Halfway in log size: the mean of the times per byte, 1/(0.5/2 + 0.5/0.5) = 0.8.
    assert!(close(curve.factor(1e7), 0.8));
    let link = Link { bandwidth: 1e9, latency: 0.0, topology: Topology::Switch, shared_by: 1, by_size: curve.clone() };
    assert!(close(link.bandwidth_at(1e7), 0.8e9));
    // The preset of this machine's simulated devices carries its measured curves through a
    // cluster file; a curve out of order, or with a factor of 0, is refused.
    let local = Cluster::preset("local-wgpu").unwrap();
    assert!(!local.intra.by_size.is_empty() && !local.host.by_size.is_empty());
    assert_eq!(Cluster::from_toml(&local.to_toml()).unwrap(), local);
    let mut bad = local.clone();
    bad.intra.by_size = BySize(vec![(1e8, 1.0), (1e6, 1.0)]);
    assert!(Cluster::from_toml(&bad.to_toml()).unwrap_err().contains("increasing"));
    bad.host.by_size = BySize(vec![(1e6, 0.0)]);
    bad.intra.by_size = BySize::default();
    assert!(Cluster::from_toml(&bad.to_toml()).unwrap_err().contains("positive"));
    // Priced by size: a 1 MB all-reduce between two of them moves its bytes faster than a
    // 64 MB one, in the ratio of the curve's factors.
    let ar = |bytes: f64| {
        let (a, b) = super::collective::alpha_beta(&local, LinkLevel::Intra, 2, 2, bytes);
        super::collective::all_reduce(bytes, 2, a, b) - 2.0 * a
    };
    let (small, large) = (1048576.0, 67108864.0);
    let ratio = (large / ar(large)) / (small / ar(small));
    assert!(close(ratio, local.intra.by_size.factor(large) / local.intra.by_size.factor(small)), "{ratio}");
    assert!(ratio < 1.0);
}

#[test]
fn a_shared_weight_folds_the_batch_into_rows() {
    // Sequence-first activations `[64, 1, 512]` times a weight `[512, 1536]`: the runtime runs
    // one GEMM of 64 rows (the batch folded into them), priced as the `[64, 512]` one — not as
    // 64 GEMMs of one row each at a 16th of a tile's rate. A weight with a batch of its own
    // keeps one row per GEMM.
    let price = |xs: &[i64], ws: &[i64]| {
        let mut g = Graph::new("mm");
        let x = g.add_input("x", Some(TensorType::fixed(DType::Float, xs).into()));
        let w = g.add_input("w", Some(TensorType::fixed(DType::Float, ws).into()));
        let y = g.add_simple(Op::MatMul(op::MatMul::default()), &[x, w], "y");
        g.add_output(y, None);
        let mut m = Model::new(g, 17);
        ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap();
        let c = Cluster::preset("dgx-a100").unwrap();
        let cm = CostModel::new(&m.graph, &c, c.mesh(1).unwrap(), opts());
        let n = m.graph.op_nodes().unwrap()[0];
        cm.op_time(n, &[None]).fwd
    };
    let folded = price(&[64, 1, 512], &[512, 1536]);
    assert!(close(folded, price(&[64, 512], &[512, 1536])), "{folded}");
    assert!(price(&[64, 1, 512], &[64, 512, 1536]) > 4.0 * folded);
}

#[test]
fn a_gemm_splitting_its_reduction_pays_a_second_dispatch() {
    // The runtime splits an unbatched GEMM's reduction past `SPLIT_K_FROM` into chunks and a
    // sum: one more dispatch (1 ms here), forward; backward, the input's gradient reduces over
    // the 64 columns and the weight's over the 16 rows (no split).
    let price = |k: i64, shared: bool| {
        let mut g = Graph::new("mm");
        let x = g.add_input("x", Some(TensorType::fixed(DType::Float, &[2, 16, k]).into()));
        let wd: Vec<i64> = if shared { vec![k, 64] } else { vec![2, k, 64] };
        let w = g.add_input("w", Some(TensorType::fixed(DType::Float, &wd).into()));
        let y = g.add_simple(Op::MatMul(op::MatMul::default()), &[x, w], "y");
        g.add_output(y, None);
        let mut m = Model::new(g, 17);
        ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap();
        let mut c = toy();
        c.device.launch_overhead = 1e-3;
        c.device.peak_flops.fp32 = 1e18;
        c.device.mem_bandwidth = 1e18;
        let cm = CostModel::new(&m.graph, &c, c.mesh(1).unwrap(), opts());
        let n = m.graph.op_nodes().unwrap()[0];
        cm.op_time(n, &[None]).fwd
    };
    let k = ir::ops::contraction::SPLIT_K_FROM as i64;
    assert!((price(k + 1, true) - price(k, true) - 1e-3).abs() < 1e-9);
    // A batch of products (B with a batch of its own) is not split.
    assert!((price(k + 1, false) - price(k, false)).abs() < 1e-9);
}

#[test]
fn skinny_and_short_gemms_reach_less_of_peak() {
    let d = Cluster::preset("dgx-a100").unwrap().device;
    let e = 0.859;
    // A large square GEMM: 32 × 32 = 1024 tiles of 128 in ⌈1024/108⌉ = 10 waves of the 108
    // SMs (1024/1080 full), reduction 4096/(4096+32).
    assert!(close(d.gemm_efficiency(4096.0, 4096.0, 4096.0), e * 1024.0 / 1080.0 * 4096.0 / 4128.0));
    // GPT-2's fused QKV projection column-split 8 ways: n = 2304/8 = 288 fills 288/384 of
    // three 128-wide tiles; the 8 × 3 = 24 tiles split their reduction 4 ways (⌊108/24⌋) to
    // fill 96 of the 108 SMs, each chunk of k = 768/4: 192/224.
    assert!(close(d.gemm_efficiency(1024.0, 288.0, 768.0), e * 0.75 * 96.0 / 108.0 * 192.0 / 224.0));
    // A weight gradient of one tile over a long reduction splits it over all 108 SMs.
    assert!(close(d.gemm_efficiency(128.0, 16.0, 24200.0), e * 0.125 * (24200.0 / 108.0) / (24200.0 / 108.0 + 32.0)));
    // Nine of them batched in one kernel: 216 tiles, two full waves.
    assert!(close(d.batched_gemm_efficiency(1024.0, 288.0, 768.0, 9.0), e * 0.75 * 768.0 / 800.0));
    // Its reduction split 8 ways instead: 8 × 18 = 144 tiles in two waves (144/216), and
    // k = 96 → 96/128 of the loop is useful.
    assert!(close(d.gemm_efficiency(1024.0, 2304.0, 96.0), e * 144.0 / 216.0 * 0.75));
}

#[test]
fn a_reduction_over_axes_of_one_element_is_a_view() {
    // Σ over axis 0 of [1, 64, 256] leaves the input as it is: no kernel, no price. Over
    // [2, 64, 256] it is a kernel — unless the batch is split over 2 devices, which leaves each
    // one sample. A sum of squares over one element is not its input: priced.
    let mut g = Graph::new("sums");
    let reduce = |axes: Vec<i64>| op::ReduceSum { axes: Some(axes), keepdims: Some(0), noop_with_empty_axes: None };
    let one = g.add_input("one", Some(TensorType::fixed(DType::Float, &[1, 64, 256]).into()));
    let two = g.add_input("two", Some(TensorType::fixed(DType::Float, &[2, 64, 256]).into()));
    for (x, name) in [(one, "a"), (two, "b")] {
        let y = g.add_simple(Op::ReduceSum(reduce(vec![0])), &[x], name.to_string());
        g.add_output(y, None);
    }
    let sq = op::ReduceSumSquare { axes: Some(vec![0]), keepdims: Some(0), noop_with_empty_axes: None };
    let y = g.add_simple(Op::ReduceSumSquare(sq), &[one], "c".to_string());
    g.add_output(y, None);
    let mut m = Model::new(g, 11);
    ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap();
    let ops: Vec<_> = m.graph.op_nodes().unwrap();
    let (a, b, c) = (ops[0], ops[1], ops[2]);
    let toy = toy();
    let cm = CostModel::new(&m.graph, &toy, toy.mesh(1).unwrap(), opts());
    assert_eq!(cm.op_time(a, &[None]).fwd, 0.0);
    assert!(cm.op_time(b, &[None]).fwd > 0.0);
    assert!(cm.op_time(c, &[None]).fwd > 0.0);
    let cm = CostModel::new(&m.graph, &toy, toy.mesh(2).unwrap(), opts());
    assert_eq!(cm.op_time(b, &[Some(0)]).fwd, 0.0, "one sample per device");
    assert!(cm.op_time(b, &[Some(1)]).fwd > 0.0, "two samples per device");
}

/// `gemm_graph`'s Y plus a row `m = k · s` broadcast over Y's rows: `k` [1, 4096] a graph
/// input, `s` either a one-element initializer (an exporter's constant) or a [1, 4096] one.
fn masked_gemm(s_dims: &[i64]) -> Graph {
    let mut g = gemm_graph();
    let y = g.outputs()[0].value;
    let k = g.add_input("k", Some(TensorType::fixed(DType::Float, &[1, 4096]).into()));
    let n: i64 = s_dims.iter().product();
    let s = g.add_initializer(
        "s",
        ir::eval::Array::float(DType::Float, s_dims.iter().map(|&d| d as usize).collect(), vec![0.5; n as usize])
            .to_tensor(),
    );
    let m = g.add_simple(Op::Mul(op::Mul::default()), &[k, s], "m");
    let z = g.add_simple(Op::Add(op::Add::default()), &[y, m], "z");
    g.set_outputs(vec![ir::GraphOutput { value: z, ty: None }]);
    let mut md = Model::new(g, 17);
    ir::infer::infer_shapes(&mut md.graph, ir::infer::Mode::Check).unwrap();
    md.graph
}

#[test]
fn values_computed_without_parameters_carry_no_gradient() {
    // Data parallel: the GEMM and the add split by rows, `m` read whole by every device.
    let c = toy();
    let priced = |g: &Graph| {
        let cm = CostModel::new(g, &c, c.mesh(8).unwrap(), opts());
        let o = cm.order();
        let asg = Assignment {
            strategies: [(o[0], vec![Some(0)]), (o[1], vec![None]), (o[2], vec![Some(0)])].into_iter().collect(),
        };
        (cm.evaluate(&asg), cm.op_time(o[1], &[None]))
    };
    // `s` a constant: `m` comes from an input and a constant, so no gradient flows into it
    // (as autodiff differentiates), and `s` is neither synchronised nor updated: the step
    // is `data_parallel_gemm_by_hand`'s communication and update.
    let (b, mul) = priced(&masked_gemm(&[1]));
    assert_eq!(mul.bwd, 0.0);
    assert!(!b.bytes_moved_per_device.contains_key("backward"), "{:?}", b.bytes_moved_per_device);
    assert!(close(b.gradient_sync_s, 2.0 * 7.0 / 8.0 * 16_777_216.0 / 1e10));
    assert!(close(b.update_s, 4_194_304.0 * 28.0 / 1e11));
    // `s` a parameter: `m`'s gradient (partial sums over the rows each device holds) is
    // all-reduced in the backward pass, 16,384 B, and `s` is updated.
    let (b, mul) = priced(&masked_gemm(&[1, 4096]));
    assert!(mul.bwd > 0.0);
    let bwd = &b.bytes_moved_per_device["backward"];
    assert!(close(bwd["all_reduce"], 2.0 * 7.0 / 8.0 * 16_384.0), "{bwd:?}");
    assert!(close(b.update_s, (4_194_304.0 + 4096.0) * 28.0 / 1e11));
}

#[test]
fn fused_element_wise_groups_are_priced_as_one_launch_without_inner_traffic() {
    let text = r#"<ir_version: 8, opset_import: ["" : 17]>
g (float[64,1024] x) => (float loss)
   <float[1024,4096] w = ["location": "w.bin", "offset": "0", "length": "16777216"]>
{
   h = MatMul (x, w)
   s = Sigmoid (h)
   t = Mul (s, h)
   r = Relu (t)
   loss = ReduceMean <keepdims: int = 0> (r)
}"#;
    let mut g = frontend::parse(text).unwrap_or_else(|d| panic!("{d:?}")).model.graph;
    crate::autodiff::autodiff(
        &mut g,
        &crate::autodiff::LossSpec::Model,
        &crate::autodiff::OptimizerSpec::sgd(0.1, 0.0),
    )
    .unwrap();
    ir::infer::infer_shapes(&mut g, ir::infer::Mode::Check).unwrap();
    let mut c = toy();
    c.device.launch_overhead = 1e-5;
    let mut fused = c.clone();
    fused.device.fused_elementwise = true;
    let (alone, together) = (
        CostModel::new(&g, &c, c.mesh(1).unwrap(), opts()),
        CostModel::new(&g, &fused, fused.mesh(1).unwrap(), opts()),
    );
    let node = |v: &str| g.lookup(v).unwrap().node;
    let none = vec![None; alone.mesh.axes.len()];
    let saved = |v: &str| alone.op_time(node(v), &none).fwd - together.op_time(node(v), &none).fwd;
    // The forward group Sigmoid → Mul → Relu: `s` and `t` are written (the backward part
    // reads them) but read by the Mul and the Relu from registers; the Sigmoid and the Mul
    // launch nothing of their own. 64 × 4096 floats: 1 MiB.
    let bytes = 64.0 * 4096.0 * 4.0;
    assert!(close(saved("s"), 1e-5 + bytes / 1e11), "{}", saved("s"));
    assert!(close(saved("t"), 1e-5 + bytes / 1e11), "{}", saved("t"));
    assert_eq!(saved("r"), 0.0, "the root keeps its launch and writes its value");
    // Nothing else changes: the MatMul's price is its own.
    assert_eq!(saved("h"), 0.0);
    // The whole step is cheaper by every group's savings, no more.
    let grouped: f64 =
        g.op_nodes().unwrap().iter().map(|&n| alone.op_time(n, &none).fwd - together.op_time(n, &none).fwd).sum();
    assert!(grouped >= 2.0 * (1e-5 + bytes / 1e11), "{grouped}");
}

#[test]
fn matrix_products_run_at_the_precisions_peak_and_the_rest_at_float32s() {
    // Y = tanh(X · W) on a device with 8× the float32 peak in half precision and memory too
    // fast to matter: in fp16 the MatMul takes an eighth of its fp32 time (tensor cores),
    // the Tanh the same as in fp32 (element-wise kernels compute in float32).
    let mut g = gemm_graph();
    let y = g.lookup("y").unwrap();
    let z = g.add_simple(Op::Tanh(op::Tanh::default()), &[y], "z");
    g.set_outputs(Vec::new());
    g.add_output(z, None);
    ir::infer::infer_shapes(&mut g, ir::infer::Mode::Check).unwrap();
    let mut c = toy();
    c.device.peak_flops.fp16 = Some(8e12);
    c.device.mem_bandwidth = 1e18;
    let time = |precision: Precision, op: usize| {
        let cm = CostModel::new(&g, &c, c.mesh(1).unwrap(), Options { precision, ..opts() });
        let n = cm.order()[op];
        cm.op_time(n, &[None])
    };
    let (mm32, mm16) = (time(Precision::Fp32, 0), time(Precision::Fp16, 0));
    let (th32, th16) = (time(Precision::Fp32, 1), time(Precision::Fp16, 1));
    // Forward 2·64·1024·4096 FLOPs at 1 TFLOP/s: 536.87 µs; at 8: 67.11 µs.
    assert!(close(mm32.fwd, 536_870_912.0 / 1e12), "{}", mm32.fwd);
    assert!(close(mm16.fwd, mm32.fwd / 8.0), "{} vs {}", mm16.fwd, mm32.fwd);
    assert!(th32.fwd > 0.0 && close(th16.fwd, th32.fwd), "{} vs {}", th16.fwd, th32.fwd);
}
