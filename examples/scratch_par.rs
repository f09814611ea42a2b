use shardc::calibrate::{one_op, time_node};
use shardc::codegen::runtime::gpu::GpuExecutor;
use shardc::ir::eval::Array;

fn main() {
    let mut e = GpuExecutor::new().unwrap();
    let total = 1usize << 21;
    for rows in [4usize, 16, 64, 128, 256, 512, 1024, 4096, 32768] {
        let len = total / rows;
        let (m, node) = one_op(
            &format!("(float[{rows},{len}] a) => (y)"),
            "y = ReduceSum <axes: ints = [1], keepdims: int = 0> (a)",
        )
        .unwrap();
        let a = Array::f32(vec![rows, len], (0..total).map(|i| (i % 7) as f32).collect());
        let t = time_node(&mut e, &m.graph, node, &[a], 9).unwrap();
        println!("ReduceSum {rows}×{len}: {:.2} ms", t * 1e3);
    }
}
