//! Candidate device meshes: the ways to arrange `n` devices as 1–3 axes that follow the
//! cluster's hierarchy.

use ir::shard::{LinkLevel, Mesh, MeshAxis};

use crate::cost::Cluster;

/// The meshes the search tries for `n` devices, the cluster's natural one first.
///
/// Within one node: `[n]`, and `[a, b]` / `[a, b, c]` factorizations (all intra-node; axes of
/// one level are interchangeable, so factors are listed in non-decreasing order). Across
/// nodes: `[nodes, per-node]`, and `[nodes, a, b]` with `a·b` = devices per node, which lets
/// two different dims split inside a node.
pub fn candidates(cluster: &Cluster, n: usize) -> Result<Vec<Mesh>, String> {
    let natural = cluster.mesh(n)?;
    let mut out = vec![natural.clone()];
    let axis = |name: &str, size: usize, level: LinkLevel| MeshAxis { name: name.into(), size, level };
    let dpn = cluster.devices_per_node;
    if n <= dpn {
        for (a, b) in pairs(n) {
            out.push(Mesh { axes: vec![axis("x", a, LinkLevel::Intra), axis("y", b, LinkLevel::Intra)] });
        }
        if let Some((a, b, c)) = triple(n) {
            out.push(Mesh {
                axes: vec![
                    axis("x", a, LinkLevel::Intra),
                    axis("y", b, LinkLevel::Intra),
                    axis("z", c, LinkLevel::Intra),
                ],
            });
        }
    } else if let Some((a, b)) = pairs(dpn).last().copied() {
        out.push(Mesh {
            axes: vec![
                natural.axes[0].clone(),
                axis("gpus_x", a, LinkLevel::Intra),
                axis("gpus_y", b, LinkLevel::Intra),
            ],
        });
    }
    Ok(out)
}

/// Factor pairs `a ≤ b`, both at least 2, with `a·b = n`.
fn pairs(n: usize) -> Vec<(usize, usize)> {
    (2..n).take_while(|a| a * a <= n).filter(|a| n.is_multiple_of(*a)).map(|a| (a, n / a)).collect()
}

/// The most balanced factor triple `a ≤ b ≤ c`, each at least 2.
fn triple(n: usize) -> Option<(usize, usize, usize)> {
    let mut best: Option<(usize, usize, usize)> = None;
    for a in 2..n {
        if a * a * a > n {
            break;
        }
        if !n.is_multiple_of(a) {
            continue;
        }
        for (b, c) in pairs(n / a) {
            if b >= a && best.is_none_or(|x| c - a < x.2 - x.0) {
                best = Some((a, b, c));
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizes(m: &Mesh) -> Vec<usize> {
        m.axes.iter().map(|a| a.size).collect()
    }

    #[test]
    fn meshes_follow_the_hierarchy() {
        let c = Cluster::preset("dgx-a100").unwrap();
        let got: Vec<Vec<usize>> = candidates(&c, 8).unwrap().iter().map(sizes).collect();
        assert_eq!(got, vec![vec![8], vec![2, 4], vec![2, 2, 2]]);
        let got: Vec<Vec<usize>> = candidates(&c, 6).unwrap().iter().map(sizes).collect();
        assert_eq!(got, vec![vec![6], vec![2, 3]]);
        let c = Cluster::preset("a100-cluster-8").unwrap();
        let got: Vec<Vec<usize>> = candidates(&c, 64).unwrap().iter().map(sizes).collect();
        assert_eq!(got, vec![vec![8, 8], vec![8, 2, 4]]);
        assert_eq!(candidates(&c, 1).unwrap().len(), 1);
    }
}
