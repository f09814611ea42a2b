//! How another compiler plugs into shardc: build a graph with the API, define a pass of its
//! own, run it in the pass manager between shardc's passes, and print the IR.
//!
//! Run with `cargo run --example custom_pass`.

use shardc::ir::{self, DType, Graph, Model, Op, TensorType, Value, op};
use shardc::passes::{self, Changed, Pass, PassCx, PassError, PassManager};

/// `Relu(Relu(x)) == Relu(x)`: removes the outer Relu of a pair.
struct DropDoubleRelu;

impl Pass for DropDoubleRelu {
    fn name(&self) -> &'static str {
        "drop-double-relu"
    }

    fn run(&mut self, g: &mut Graph, cx: &mut PassCx<'_>) -> Result<Changed, PassError> {
        let mut changed = Changed::No;
        for n in g.op_nodes().map_err(|_| PassError::new(self.name(), passes::Located::global("cycle")))? {
            if !g.contains(n) || !matches!(g.node(n).op, Op::Relu(_)) {
                continue;
            }
            let Some(inner) = g.node(n).input(0) else { continue };
            let outer = Value::new(n, 0);
            if matches!(g.node(inner.node).op, Op::Relu(_)) && !g.outputs().iter().any(|o| o.value == outer) {
                g.replace_all_uses(outer, inner);
                g.remove_node(n);
                cx.stats.add("double relus removed", 1);
                changed = Changed::Yes;
            }
        }
        Ok(changed)
    }
}

fn main() {
    // A two-layer MLP with a redundant Relu, built through the API.
    let mut g = Graph::new("mlp");
    let x = g.add_input("x", Some(TensorType::fixed(DType::Float, &[8, 16]).into()));
    let w1 = g.add_initializer("w1", ir::Tensor::from_f32(vec![16, 32], vec![0.01; 16 * 32]));
    let w2 = g.add_initializer("w2", ir::Tensor::from_f32(vec![32, 4], vec![0.02; 32 * 4]));
    let h = g.add_simple(Op::MatMul(op::MatMul::default()), &[x, w1], "h");
    let a = g.add_simple(Op::Relu(op::Relu::default()), &[h], "a");
    let b = g.add_simple(Op::Relu(op::Relu::default()), &[a], "b");
    let y = g.add_simple(Op::MatMul(op::MatMul::default()), &[b, w2], "y");
    g.add_output(y, None);
    let mut model = Model::new(g, 17);

    let mut pm = PassManager::new().with_verify(true);
    pm.add(passes::InferShapes::default()).add(DropDoubleRelu).add(passes::Canonicalize);
    let report = pm.run(&mut model).expect("the pipeline runs");
    for t in &report.timings {
        eprintln!("{:>18}: {:?}", t.pass, t.time);
    }
    for (k, v) in report.stats.iter() {
        eprintln!("{k}: {v}");
    }
    println!("{}", ir::print::model_to_string(&model));
}
