//! The resharding algebra, executed: for random shapes, meshes of 1–3 axes (both link levels)
//! and pairs of layouts — nested splits and partial sums included — the steps
//! [`ir::reshard::reshard`] gives, emitted by the lowering and run on the CPU executor, turn a
//! real tensor held in the source layout into exactly the target layout's pieces; and the
//! bytes the lowered program sends per device equal the bytes the cost model prices.

use std::collections::HashMap;

use codegen::{Backend, RunOptions};
use ir::eval::Array;
use ir::reshard::Policy;
use ir::shard::{AxisShard, LinkLevel, Mesh, MeshAxis, Sharding};
use passes::cost::Cluster;
use proptest::prelude::*;
use shardc_tests::proptest_config;

fn mesh_strategy() -> impl Strategy<Value = Mesh> {
    prop::collection::vec((1usize..=4, any::<bool>()), 1..=3).prop_map(|axes| Mesh {
        axes: axes
            .into_iter()
            .enumerate()
            .map(|(i, (size, inter))| MeshAxis {
                name: format!("m{i}"),
                size,
                level: if inter { LinkLevel::Inter } else { LinkLevel::Intra },
            })
            .collect(),
    })
}

/// A layout over `axes` mesh axes for a tensor of rank `rank`: 0 = R, 1 = P, 2.. = S(d).
fn layout(choice: &[u8], rank: usize, partial: bool) -> Sharding {
    choice
        .iter()
        .map(|&c| match c % (rank as u8 + 2) {
            0 => AxisShard::Replicate,
            1 if partial => AxisShard::Partial,
            1 => AxisShard::Replicate,
            d => AxisShard::Split(d - 2),
        })
        .collect()
}

/// Dims every split of the layouts divides: per dim, a random factor times the product of
/// the sizes of the axes splitting it in either layout.
fn dims_for(rank: usize, factors: &[usize], mesh: &Mesh, a: &Sharding, b: &Sharding) -> Vec<usize> {
    (0..rank)
        .map(|d| {
            let f = |l: &Sharding| -> usize {
                l.iter()
                    .enumerate()
                    .filter(|(_, s)| **s == AxisShard::Split(d as u8))
                    .map(|(i, _)| mesh.axes[i].size)
                    .product()
            };
            factors[d] * f(a) * f(b)
        })
        .collect()
}

fn run_case(mesh: &Mesh, dims: &[usize], from: &Sharding, to: &Sharding, hier: bool) -> Result<(), String> {
    let policy = Policy { hierarchical_all_reduce: hier };
    let prog = codegen::lower::reshard_program(dims, from, to, mesh, policy).map_err(|e| e.to_string())?;
    let n: usize = dims.iter().product();
    let x = Array::float(ir::DType::Float, dims.to_vec(), (0..n).map(|i| ((i * 37 % 101) as f64) - 50.0).collect());
    let inputs: HashMap<String, Array> = [("x".to_string(), x.clone())].into_iter().collect();
    let out = codegen::run(&prog, &inputs, &RunOptions { backend: Backend::Cpu, ..Default::default() })
        .map_err(|e| e.to_string())?;
    shardc_tests::compare("x", &out.outputs[0].1, &x, 1e-5, 1e-4)?;
    // Priced = lowered, per device and kind.
    let cluster = Cluster::preset("a100-cluster-8").unwrap();
    let dims_i: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
    let priced = passes::cost::collective::reshard(&dims_i, 4.0, from, to, 1.0, mesh, &cluster, policy);
    let mut want: HashMap<String, f64> = HashMap::new();
    for s in &priced {
        *want.entry(s.kind.name().to_string()).or_insert(0.0) += s.moved;
    }
    for d in &prog.devices {
        let got = d.bytes_moved();
        for (k, v) in &got {
            let w = want.get(k).copied().unwrap_or(0.0);
            if (v - w).abs() > 1e-6 * w.max(1.0) {
                return Err(format!("device {}: {k} moves {v} B, priced {w} B", d.device));
            }
        }
        for (k, w) in &want {
            if got.get(k).copied().unwrap_or(0.0) == 0.0 && *w > 0.0 {
                return Err(format!("device {}: {k} priced {w} B, moves nothing", d.device));
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(proptest_config(96))]

    #[test]
    fn reshardings_run_to_the_target_pieces_and_move_what_is_priced(
        mesh in mesh_strategy(),
        rank in 1usize..=3,
        a in prop::collection::vec(any::<u8>(), 3),
        b in prop::collection::vec(any::<u8>(), 3),
        factors in prop::collection::vec(1usize..=3, 3),
        hier in any::<bool>(),
    ) {
        let k = mesh.axes.len();
        let from = layout(&a[..k], rank, true);
        let to = layout(&b[..k], rank, true);
        let dims = dims_for(rank, &factors, &mesh, &from, &to);
        prop_assert!(run_case(&mesh, &dims, &from, &to, hier).is_ok(),
            "{:?} → {:?} on {:?}, dims {dims:?}: {}", from, to,
            mesh.axes.iter().map(|x| (x.size, x.level)).collect::<Vec<_>>(),
            run_case(&mesh, &dims, &from, &to, hier).unwrap_err());
    }
}

#[test]
fn nested_splits_gather_only_the_axes_they_lose() {
    // Splits nest in mesh order (the first axis cuts, the next cuts each block), so on a 2×4
    // mesh [S(0), S(0)] → [S(0), R] is one all-gather over the inner axis of the pieces the
    // outer axis keeps: each device sends 3/4 of its 1/8 piece — not a gather of the whole
    // tensor and a slice.
    let mesh = Mesh {
        axes: vec![
            MeshAxis { name: "x".into(), size: 2, level: LinkLevel::Intra },
            MeshAxis { name: "y".into(), size: 4, level: LinkLevel::Intra },
        ],
    };
    let from = vec![AxisShard::Split(0), AxisShard::Split(0)];
    let to = vec![AxisShard::Split(0), AxisShard::Replicate];
    let steps = ir::reshard::reshard(&[64, 8], 4.0, &from, &to, &mesh, Policy::default());
    assert_eq!(steps.len(), 1, "{steps:?}");
    assert_eq!(steps[0].kind, ir::reshard::StepKind::AllGather { dim: 0 });
    assert_eq!(steps[0].axes, vec![1]);
    // Output 32×8 floats per device = 1024 B; it sends 3/4 of that.
    assert_eq!(steps[0].bytes_moved(&mesh), 768.0);
    run_case(&mesh, &[64, 8], &from, &to, false).unwrap();
}
