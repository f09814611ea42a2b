//! The checker rejects inconsistent programs before they run, saying what is wrong: a send
//! nobody receives, a receive nobody sends, mismatched collective sequences or shapes, halo
//! widths the neighbours disagree on, and deadlocks; it accepts the consistent variants.

use codegen::{Program, check};
use shardc_tests::one_stage_program;

/// A program of one stage whose device `k` runs the graph written as `bodies[k]` (nodes
/// of a graph `(float[4,8] x) => ()`).
fn program(bodies: &[&str]) -> Program {
    let graphs = bodies
        .iter()
        .enumerate()
        .map(|(k, body)| {
            let text = format!(
                "<\n ir_version: 8,\n opset_import: [\"\" : 17, \"shardc\" : 1]\n>\nd{k} (float[4,8] x) => ()\n{{\n{body}\n}}\n"
            );
            let mut m = frontend::parse(&text).unwrap_or_else(|e| panic!("{e:?}\n{text}")).model;
            ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap_or_else(|e| panic!("{e:?}"));
            m.graph
        })
        .collect();
    one_stage_program(graphs)
}

fn errors(bodies: &[&str]) -> String {
    match check(&program(bodies)) {
        Ok(()) => panic!("the checker accepted an inconsistent program: {bodies:#?}"),
        Err(e) => e.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"),
    }
}

fn accepts(bodies: &[&str]) {
    check(&program(bodies)).unwrap_or_else(|e| panic!("rejected a consistent program: {e:?}\n{bodies:#?}"));
}

const SEND_0_TO_1: &str = "  = shardc.Send <peer: int = 1, tag: int = 5> (x)";
const RECV_1_FROM_0: &str = "  r = shardc.Recv <dtype: int = 1, peer: int = 0, shape: ints = [4, 8], tag: int = 5> ()";

#[test]
fn sends_and_receives_must_pair_up() {
    accepts(&[SEND_0_TO_1, RECV_1_FROM_0]);
    let e = errors(&[SEND_0_TO_1, "  y = Relu (x)"]);
    assert!(e.contains("sends tag 5 to device 1, which never receives it"), "{e}");
    let e = errors(&["  y = Relu (x)", RECV_1_FROM_0]);
    assert!(e.contains("waits for tag 5 from device 0, which never sends it"), "{e}");
    // The receiver expects another shape.
    let e = errors(&[
        SEND_0_TO_1,
        "  r = shardc.Recv <dtype: int = 1, peer: int = 0, shape: ints = [2, 8], tag: int = 5> ()",
    ]);
    assert!(e.contains("sent [4, 8], received [2, 8]"), "{e}");
    // Another tag.
    let e = errors(&[
        SEND_0_TO_1,
        "  r = shardc.Recv <dtype: int = 1, peer: int = 0, shape: ints = [4, 8], tag: int = 6> ()",
    ]);
    assert!(e.contains("never receives") && e.contains("never sends"), "{e}");
}

#[test]
fn collective_groups_must_agree_on_sequence_and_shape() {
    let ar = "  y = shardc.AllReduce <group: ints = [0, 1]> (x)";
    accepts(&[ar, ar]);
    let e = errors(&[ar, "  y = Relu (x)"]);
    assert!(e.contains("device 1 never joins the collectives of group [0, 1]"), "{e}");
    let two = "  y = shardc.AllReduce <group: ints = [0, 1]> (x)\n  z = shardc.AllReduce <group: ints = [0, 1]> (y)";
    let e = errors(&[ar, two]);
    assert!(e.contains("device 1 meets 2 collectives, device 0 1"), "{e}");
    // Same count, different kinds.
    let ag = "  y = shardc.AllGather <axis: int = 0, group: ints = [0, 1]> (x)";
    let e = errors(&[ar, ag]);
    assert!(e.contains("collective 0 is"), "{e}");
    // Same kind, different shapes.
    let sliced = "  s = Slice (x, starts, ends)\n  starts = Constant <value: tensor = int64[1] {0}> ()\n  ends = Constant <value: tensor = int64[1] {2}> ()\n  y = shardc.AllReduce <group: ints = [0, 1]> (s)";
    let e = errors(&[ar, sliced]);
    assert!(e.contains("collective 0 is"), "{e}");
    // Different reductions.
    let e = errors(&[ar, "  y = shardc.AllReduce <group: ints = [0, 1], op: string = \"max\"> (x)"]);
    assert!(e.contains("collective 0 is"), "{e}");
    // A group that leaves out the device that runs it, or names a device that does not exist.
    let e = errors(&[
        "  y = shardc.AllReduce <group: ints = [1, 2]> (x)",
        "  y = shardc.AllReduce <group: ints = [1, 2]> (x)",
    ]);
    assert!(e.contains("does not include it") && e.contains("outside the program"), "{e}");
}

#[test]
fn halo_widths_must_agree_between_neighbours() {
    let top = "  y = shardc.HaloExchange <axis: int = 0, group: ints = [0, 1], widths: ints = [0, 0, 0, 1]> (x)";
    let bottom = "  y = shardc.HaloExchange <axis: int = 0, group: ints = [0, 1], widths: ints = [1, 0, 0, 0]> (x)";
    accepts(&[top, bottom]);
    let wrong = "  y = shardc.HaloExchange <axis: int = 0, group: ints = [0, 1], widths: ints = [2, 0, 0, 0]> (x)";
    let e = errors(&[top, wrong]);
    assert!(e.contains("halo 0 of group [0, 1]"), "{e}");
}

#[test]
fn deadlocks_are_found() {
    // Each device receives before it sends: both wait forever.
    let d0 = "  r = shardc.Recv <dtype: int = 1, peer: int = 1, shape: ints = [4, 8], tag: int = 1> ()\n  = shardc.Send <peer: int = 1, tag: int = 2> (r)";
    let d1 = "  r = shardc.Recv <dtype: int = 1, peer: int = 0, shape: ints = [4, 8], tag: int = 2> ()\n  = shardc.Send <peer: int = 0, tag: int = 1> (r)";
    let e = errors(&[d0, d1]);
    assert!(e.to_lowercase().contains("deadlock"), "{e}");
    // Sending first is fine (sends do not block).
    let d0 = "  = shardc.Send <peer: int = 1, tag: int = 2> (x)\n  r = shardc.Recv <dtype: int = 1, peer: int = 1, shape: ints = [4, 8], tag: int = 1> ()";
    let d1 = "  = shardc.Send <peer: int = 0, tag: int = 1> (x)\n  r = shardc.Recv <dtype: int = 1, peer: int = 0, shape: ints = [4, 8], tag: int = 2> ()";
    accepts(&[d0, d1]);
    // Two groups met in opposite orders by their common member.
    let a = "  y = shardc.AllReduce <group: ints = [0, 1]> (x)\n  z = shardc.AllReduce <group: ints = [0, 2]> (y)";
    let b = "  y = shardc.AllReduce <group: ints = [1, 2]> (x)\n  z = shardc.AllReduce <group: ints = [0, 1]> (y)";
    let c = "  y = shardc.AllReduce <group: ints = [0, 2]> (x)\n  z = shardc.AllReduce <group: ints = [1, 2]> (y)";
    let e = errors(&[a, b, c]);
    assert!(e.to_lowercase().contains("deadlock"), "{e}");
}
