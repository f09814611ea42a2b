//! The search problem on one mesh, as tables: per op its admissible strategies and the
//! layouts they need and produce; per tensor its producer and consumers.
//!
//! Everything here is owned (no borrows of the graph), so the e-graph rules can share it.

use rustc_hash::FxHashMap as HashMap;

use ir::shard::{AxisShard, DimKind, DimRole, OpStrategy, Sharding, strategy_shardings, strategy_valid};
use ir::{NodeId, Op, Value};

use crate::cost::CostModel;
use crate::cost::model::{is_host, is_view};

/// A tensor's index in [`Problem::values`].
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ValueId(pub u32);

/// A layout's index in [`Problem::layouts`].
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LayoutId(pub u32);

impl ValueId {
    /// As an index.
    pub fn ix(self) -> usize {
        self.0 as usize
    }
}

impl LayoutId {
    /// As an index.
    pub fn ix(self) -> usize {
        self.0 as usize
    }
}

/// Where a tensor comes from.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Origin {
    /// Output `slot` of the op at `op` (a position in [`Problem::ops`]).
    Op { op: usize, slot: usize },
    /// A graph input, parameter or constant.
    Source { param: bool, data_input: bool },
}

/// One tensor.
#[derive(Clone, Debug)]
pub(crate) struct ValueInfo {
    /// The graph value.
    pub value: Value,
    pub origin: Origin,
    /// Bytes in the training precision.
    pub bytes: f64,
    pub float: bool,
    /// Has a name (unnamed outputs are not kept for backward).
    pub named: bool,
    /// Gradients flow back into it.
    pub needs_grad: bool,
    /// (op position, input index) of every consumer that needs a layout, in order.
    pub consumers: Vec<(usize, usize)>,
}

/// One op and its admissible strategies.
#[derive(Clone, Debug)]
pub(crate) struct OpInfo {
    pub node: NodeId,
    /// Per input: the tensor, when the op needs it in a layout.
    pub inputs: Vec<Option<ValueId>>,
    /// Per output: the tensor (outputs nobody reads are still listed).
    pub outputs: Vec<ValueId>,
    /// Every admissible strategy; `[0]` is the replicated one.
    pub strategies: Vec<OpStrategy>,
    pub index: HashMap<OpStrategy, u32>,
    /// Per strategy, per input: the layout it needs.
    pub needs: Vec<Vec<Option<LayoutId>>>,
    /// Per strategy, per input: the layout of the gradient it sends back (partial along the
    /// axes it splits while the input is replicated on them).
    pub grads: Vec<Vec<Option<LayoutId>>>,
    /// Per strategy, per output: the layout it produces.
    pub makes: Vec<Vec<LayoutId>>,
    /// Per strategy: compute + halo + statistics seconds (forward and backward).
    pub time: Vec<f64>,
    /// The role of each iteration dim.
    pub roles: Vec<DimRole>,
    /// Keeps its outputs for the backward pass (computes something).
    pub keeps_outputs: bool,
}

/// The tables of one mesh.
pub(crate) struct Problem {
    pub ops: Vec<OpInfo>,
    pub values: Vec<ValueInfo>,
    pub value_ids: HashMap<Value, ValueId>,
    pub layouts: Vec<Sharding>,
    pub layout_ids: HashMap<Sharding, LayoutId>,
    /// Per layout: the same with pending sums settled (`P` → `R`).
    pub settled: Vec<LayoutId>,
    pub axes: usize,
}

impl Problem {
    /// Builds the tables of `cm`'s graph on `cm`'s mesh.
    pub fn new(cm: &CostModel<'_>) -> Problem {
        let g = cm.g;
        let axes = cm.mesh.axes.len();
        let mut p = Problem {
            ops: Vec::new(),
            values: Vec::new(),
            value_ids: HashMap::default(),
            layouts: Vec::new(),
            layout_ids: HashMap::default(),
            settled: Vec::new(),
            axes,
        };
        let pos: HashMap<NodeId, usize> = cm.order().iter().enumerate().map(|(i, &n)| (n, i)).collect();
        for (i, &n) in cm.order().iter().enumerate() {
            let node = g.node(n);
            let sp = cm.space(n);
            let strategies = enumerate(cm, n);
            let mut info = OpInfo {
                node: n,
                inputs: Vec::new(),
                outputs: Vec::new(),
                index: strategies.iter().enumerate().map(|(k, s)| (s.clone(), k as u32)).collect(),
                strategies,
                needs: Vec::new(),
                grads: Vec::new(),
                makes: Vec::new(),
                time: Vec::new(),
                roles: sp.dims.iter().map(|d| d.role).collect(),
                keeps_outputs: !is_view(&node.op) && !is_host(&node.op),
            };
            for slot in 0..node.num_outputs() {
                let v = Value::new(n, slot as u16);
                let id = p.value(cm, v, Origin::Op { op: i, slot });
                info.outputs.push(id);
            }
            let (first_ins, _) = strategy_shardings(sp, &vec![None; axes]);
            for (j, v) in node.inputs().iter().enumerate() {
                let needs_layout = first_ins.get(j).is_some_and(Option::is_some);
                let id = match v {
                    Some(v) if needs_layout => {
                        let origin = match pos.get(&v.node) {
                            Some(&op) => Origin::Op { op, slot: v.slot as usize },
                            None => Origin::Source {
                                param: ir::cost::is_param(g, *v),
                                data_input: matches!(g.node(v.node).op, Op::Input { default: None }),
                            },
                        };
                        let id = p.value(cm, *v, origin);
                        p.values[id.ix()].consumers.push((i, j));
                        Some(id)
                    }
                    _ => None,
                };
                info.inputs.push(id);
            }
            for s in info.strategies.clone() {
                let (ins, outs) = strategy_shardings(sp, &s);
                let need: Vec<Option<LayoutId>> =
                    ins.into_iter()
                        .enumerate()
                        .map(|(j, l)| {
                            if info.inputs.get(j).copied().flatten().is_some() { l.map(|l| p.layout(l)) } else { None }
                        })
                        .collect();
                let grad: Vec<Option<LayoutId>> =
                    need.iter()
                        .map(|l| {
                            l.map(|l| {
                                let g: Sharding = p.layouts[l.ix()]
                                    .iter()
                                    .zip(&s)
                                    .map(|(x, a)| {
                                        if *x == AxisShard::Replicate && a.is_some() { AxisShard::Partial } else { *x }
                                    })
                                    .collect();
                                p.layout(g)
                            })
                        })
                        .collect();
                info.grads.push(grad);
                let make: Vec<LayoutId> = outs.into_iter().map(|l| p.layout(l)).collect();
                let t = cm.op_time(n, &s);
                info.time.push(t.fwd + t.bwd + t.halo + t.stats);
                info.needs.push(need);
                info.makes.push(make);
            }
            p.ops.push(info);
        }
        p
    }

    fn value(&mut self, cm: &CostModel<'_>, v: Value, origin: Origin) -> ValueId {
        if let Some(&id) = self.value_ids.get(&v) {
            return id;
        }
        let g = cm.g;
        let float = g.tensor_type(v).is_some_and(|t| t.dtype.is_float());
        let needs_grad = cm.needs_grad(v);
        let id = ValueId(self.values.len() as u32);
        self.values.push(ValueInfo {
            value: v,
            origin,
            bytes: cm.value_bytes(v),
            float,
            named: !g.value_name(v).is_empty(),
            needs_grad,
            consumers: Vec::new(),
        });
        self.value_ids.insert(v, id);
        id
    }

    /// Interns a layout.
    pub fn layout(&mut self, s: Sharding) -> LayoutId {
        if let Some(&id) = self.layout_ids.get(&s) {
            return id;
        }
        let id = LayoutId(self.layouts.len() as u32);
        self.layouts.push(s.clone());
        self.layout_ids.insert(s.clone(), id);
        self.settled.push(id);
        if s.contains(&AxisShard::Partial) {
            let settled = s.iter().map(|x| if *x == AxisShard::Partial { AxisShard::Replicate } else { *x }).collect();
            let sid = self.layout(settled);
            self.settled[id.ix()] = sid;
        }
        id
    }

    /// The number of devices a layout divides a tensor over.
    pub fn split_factor(&self, cm: &CostModel<'_>, l: LayoutId) -> f64 {
        self.layouts[l.ix()]
            .iter()
            .enumerate()
            .filter(|(_, x)| matches!(x, AxisShard::Split(_)))
            .map(|(a, _)| cm.mesh.axes[a].size as f64)
            .product()
    }

    /// The strategies of an assignment as indices into each op's table (replicated where the
    /// assignment has none or an inadmissible one).
    pub fn indices_of(&self, asg: &crate::cost::Assignment) -> Vec<u32> {
        self.ops
            .iter()
            .map(|o| asg.strategies.get(&o.node).and_then(|s| o.index.get(s).copied()).unwrap_or(0))
            .collect()
    }

    /// The assignment of per-op strategy indices.
    pub fn assignment(&self, choice: &[u32]) -> crate::cost::Assignment {
        let mut asg = crate::cost::Assignment::default();
        for (o, &c) in self.ops.iter().zip(choice) {
            asg.strategies.insert(o.node, o.strategies[c as usize].clone());
        }
        asg
    }
}

/// Every admissible strategy of `n`: per mesh axis, no split or one splittable iteration dim
/// (a sum's [`DimKind::Linear`] dim where [`CostModel::linear_dim`] has it).
/// Ops computed on the host, and ops without splittable dims, only run replicated.
pub(crate) fn enumerate(cm: &CostModel<'_>, n: NodeId) -> Vec<OpStrategy> {
    let axes = cm.mesh.axes.len();
    let replicated = vec![None; axes];
    let node = cm.g.node(n);
    let sp = cm.space(n);
    let splittable: Vec<usize> = (0..sp.dims.len())
        .filter(|&i| match sp.dims[i].kind {
            DimKind::Fixed => false,
            DimKind::Linear => cm.linear_dim(n) == Some(i),
            _ => true,
        })
        .collect();
    if is_host(&node.op) || splittable.is_empty() {
        return vec![replicated];
    }
    let mut out = vec![replicated];
    let mut cur: Vec<Option<usize>> = vec![None; axes];
    // Mixed-radix count over (None, dims…) per axis.
    let radix = splittable.len() + 1;
    let total = radix.pow(axes as u32);
    for code in 1..total {
        let mut c = code;
        for slot in cur.iter_mut() {
            let d = c % radix;
            c /= radix;
            *slot = if d == 0 { None } else { Some(splittable[d - 1]) };
        }
        if strategy_valid(sp, &cur, &cm.mesh, cm.g, n) {
            out.push(cur.clone());
        }
    }
    out
}
