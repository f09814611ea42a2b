//! The devices' programs interpreted in step, and their results checked against the graph.

use ir::NodeId;
use ir::op::Op;

use super::rules::{Cx, Why};
use super::term::{Fact, Region, Terms};
use super::{
    Delivered, Refutation, RefutationKind, Run, apply, comm, first_novel, from_why, inputs_of, is_comm, layout_region,
    record, refute,
};

/// What one step of a device did.
enum Step {
    Advanced,
    Blocked,
    Done,
}

impl Run<'_> {
    /// Runs every device to its end, collectives and transfers resolved as their members and
    /// senders reach them.
    pub(super) fn interpret(&mut self, terms: &mut Terms) -> Result<(), Refutation> {
        loop {
            let mut moved = false;
            let mut all_done = true;
            for d in 0..self.orders.len() {
                loop {
                    match self.step(terms, d)? {
                        Step::Advanced => moved = true,
                        Step::Blocked => {
                            all_done = false;
                            break;
                        }
                        Step::Done => break,
                    }
                }
            }
            if all_done {
                return Ok(());
            }
            if !moved {
                let d = (0..self.orders.len()).find(|&d| self.pos[d] < self.orders[d].len()).unwrap_or(0);
                let n = self.orders[d][self.pos[d]];
                return Err(refute(
                    RefutationKind::Wrong,
                    Some(d),
                    Some(self.p.devices[d].graph.describe(n)),
                    "waits forever: the programs do not meet at their communication".into(),
                ));
            }
        }
    }

    fn step(&mut self, terms: &mut Terms, d: usize) -> Result<Step, Refutation> {
        let Some(&n) = self.orders[d].get(self.pos[d]) else { return Ok(Step::Done) };
        let lg = &self.p.devices[d].graph;
        let node = lg.node(n);
        let here = || lg.describe(n);
        let ins =
            inputs_of(lg, n, &self.facts[d]).map_err(|m| refute(RefutationKind::Wrong, Some(d), Some(here()), m))?;
        let outs = if is_comm(&node.op) {
            let Some(out) = self.communicate(terms, d, n, &ins)? else { return Ok(Step::Blocked) };
            vec![Some(out)]
        } else {
            apply(&mut Cx { terms, g: lg, global: false }, n, &ins)
                .map_err(|w| self.located(terms, d, &ins, w, here()))?
        };
        for f in outs.iter().flatten() {
            if f.term as usize >= self.known && !super::dispatch::is_own(terms, f.term) {
                self.novel.entry(f.term).or_insert_with(|| (d, here()));
            }
        }
        record(&mut self.facts[d], n, outs);
        self.pos[d] += 1;
        Ok(Step::Advanced)
    }

    /// A rule's refusal, located at the first op that computed a value the graph never
    /// computes among those it read, where there is one.
    fn located(&self, terms: &Terms, d: usize, ins: &[Option<Fact>], w: Why, here: String) -> Refutation {
        let first = ins.iter().flatten().filter_map(|f| first_novel(terms, &self.novel, f.term)).min_by_key(|x| x.0);
        match (w, first) {
            (Why::Wrong(m), Some((t, at, op))) => refute(
                RefutationKind::Wrong,
                Some(at),
                Some(op),
                format!("computes {}, which the graph never computes; then {here}: {m}", terms.expression(t, 3)),
            ),
            (w, _) => from_why(w, Some(d), here),
        }
    }

    /// A communication op's output once it is known (`None`: wait).
    fn communicate(
        &mut self,
        terms: &mut Terms,
        d: usize,
        n: NodeId,
        ins: &[Option<Fact>],
    ) -> Result<Option<Fact>, Refutation> {
        let lg = &self.p.devices[d].graph;
        let op = &lg.node(n).op;
        let here = || Some(lg.describe(n));
        match op {
            Op::Send(s) => {
                let f = ins
                    .first()
                    .cloned()
                    .flatten()
                    .ok_or_else(|| refute(RefutationKind::Wrong, Some(d), here(), "sends nothing".into()))?;
                let peer = s.peer.unwrap_or(0) as usize;
                self.mailbox.insert((d, peer, s.tag.unwrap_or(0)), f.clone());
                Ok(Some(f))
            }
            Op::Recv(r) => Ok(self.mailbox.remove(&(r.peer.unwrap_or(0) as usize, d, r.tag.unwrap_or(0)))),
            _ => self.collective(terms, d, n, ins),
        }
    }

    fn collective(
        &mut self,
        terms: &mut Terms,
        d: usize,
        n: NodeId,
        ins: &[Option<Fact>],
    ) -> Result<Option<Fact>, Refutation> {
        if let Some(f) = self.ready.remove(&(d, n)) {
            return Ok(Some(f));
        }
        if self.arrived.contains(&(d, n)) {
            return Ok(None);
        }
        let lg = &self.p.devices[d].graph;
        let op = lg.node(n).op.clone();
        let here = || Some(lg.describe(n));
        let group: Vec<i64> = op
            .attributes()
            .into_iter()
            .find(|a| a.name == "group")
            .and_then(|a| if let ir::attr::AttrValue::Ints(v) = a.value { Some(v) } else { None })
            .unwrap_or_default();
        let Some(me) = group.iter().position(|&x| x as usize == d) else {
            return Err(refute(
                RefutationKind::Wrong,
                Some(d),
                here(),
                format!("joins group {group:?}, which it is not in"),
            ));
        };
        let f = ins
            .first()
            .cloned()
            .flatten()
            .ok_or_else(|| refute(RefutationKind::Wrong, Some(d), here(), "no operand".into()))?;
        let seq = self.joined.entry((group.clone(), d)).or_insert(0);
        let key = (group.clone(), *seq);
        *seq += 1;
        self.arrived.insert((d, n));
        let slots = self.pending.entry(key.clone()).or_insert_with(|| vec![None; group.len()]);
        slots[me] = Some((d, n, f));
        if slots.iter().all(Option::is_some) {
            let members: Vec<(usize, NodeId, Fact)> =
                self.pending.remove(&key).unwrap_or_default().into_iter().flatten().collect();
            self.resolve(terms, &op, members)?;
        }
        Ok(self.ready.remove(&(d, n)))
    }

    /// The members' outputs of one collective.
    fn resolve(&mut self, terms: &mut Terms, op: &Op, members: Vec<(usize, NodeId, Fact)>) -> Result<(), Refutation> {
        let (d0, n0) = (members[0].0, members[0].1);
        let at = |m: &(usize, NodeId, Fact)| self.p.devices[m.0].graph.describe(m.1);
        let key = collective_key(op);
        for m in &members[1..] {
            let other = &self.p.devices[m.0].graph.node(m.1).op;
            if collective_key(other) != key {
                return Err(refute(
                    RefutationKind::Wrong,
                    Some(m.0),
                    Some(at(m)),
                    format!("meets {} where device {d0} runs {}", other.op_type(), op.op_type()),
                ));
            }
        }
        let facts: Vec<Fact> = members.iter().map(|m| m.2.clone()).collect();
        let outs: Result<Vec<Fact>, String> = match op {
            Op::AllReduce(a) => {
                let max = a.op.as_deref() == Some("max");
                comm::all_reduce(terms, &facts, max).map(|f| vec![f; facts.len()])
            }
            Op::AllGather(a) => {
                comm::all_gather(terms, &facts, a.axis.unwrap_or(0) as usize).map(|f| vec![f; facts.len()])
            }
            Op::ReduceScatter(a) => comm::reduce_scatter(terms, &facts, a.axis.unwrap_or(0) as usize),
            Op::AllToAll(a) => {
                let (split, concat) = (a.split_axis.unwrap_or(0) as usize, a.concat_axis.unwrap_or(0) as usize);
                match super::dispatch::stack(terms, &facts, split, concat) {
                    Some(out) => Ok(out),
                    None => comm::all_to_all(terms, &facts, split, concat),
                }
            }
            Op::HaloExchange(h) => {
                let widths: Vec<Vec<i64>> = members
                    .iter()
                    .map(|m| match &self.p.devices[m.0].graph.node(m.1).op {
                        Op::HaloExchange(x) => x.widths.clone().unwrap_or_default(),
                        _ => Vec::new(),
                    })
                    .collect();
                comm::halo(terms, &facts, h.axis.unwrap_or(0) as usize, &widths)
            }
            other => {
                return Err(refute(
                    RefutationKind::Uncovered,
                    Some(d0),
                    Some(self.p.devices[d0].graph.describe(n0)),
                    format!("no rule for {}", other.op_type()),
                ));
            }
        };
        let outs =
            outs.map_err(|m| refute(RefutationKind::Wrong, Some(d0), Some(self.p.devices[d0].graph.describe(n0)), m))?;
        for (m, f) in members.iter().zip(outs) {
            self.ready.insert((m.0, m.1), f);
        }
        Ok(())
    }

    /// Every result is the piece of the graph's output it claims; together they cover every
    /// output. Returns how many results were checked.
    pub(super) fn results(&self, terms: &Terms) -> Result<usize, Refutation> {
        let mut delivered: Delivered = Delivered::new();
        let mut count = 0;
        for (i, d) in self.p.devices.iter().enumerate() {
            let (mesh, c) = self.mesh_of(d);
            for r in &d.results {
                let want = self.g.lookup(&r.global).and_then(|v| self.global.facts.get(&v)).ok_or_else(|| {
                    refute(RefutationKind::Wrong, Some(i), None, format!("result `{}` of no graph output", r.global))
                })?;
                let region = layout_region(&r.layout, mesh, &c, terms.shape(want.term));
                let got = d.graph.lookup(&r.local).and_then(|v| self.facts[i].get(&v)).ok_or_else(|| {
                    refute(RefutationKind::Wrong, Some(i), None, format!("result `{}` is not computed", r.local))
                })?;
                self.same(terms, i, &r.global, got, want.term, &region)?;
                delivered.entry(r.global.clone()).or_default().push((i, region));
                count += 1;
            }
        }
        for o in self.g.outputs() {
            let name = self.g.value_name(o.value);
            let shape = self.global.facts.get(&o.value).map(|f| terms.shape(f.term).to_vec()).unwrap_or_default();
            covered(name, &shape, delivered.get(name).map_or(&[][..], Vec::as_slice))?;
        }
        Ok(count)
    }

    fn same(
        &self,
        terms: &Terms,
        i: usize,
        name: &str,
        got: &Fact,
        want: super::TermId,
        region: &Region,
    ) -> Result<(), Refutation> {
        let ok_term = got.term == want;
        let ok_region = got.at(region).is_some();
        if ok_term && ok_region && got.is_exact() {
            return Ok(());
        }
        let message = if !ok_term {
            format!("result `{name}` is {} where {} is due", terms.describe(got.term), terms.describe(want))
        } else if !ok_region {
            format!("result `{name}` holds {:?} where its layout says {region:?}", got.region)
        } else {
            format!(
                "result `{name}` is a partial sum (of {}): a reduction is missing",
                terms.describe(got.shares[0].site)
            )
        };
        let (device, op) = match first_novel(terms, &self.novel, got.term) {
            Some((_, d, op)) if !ok_term => (d, Some(op)),
            _ => (i, None),
        };
        Err(refute(RefutationKind::Wrong, Some(device), op, message))
    }
}

/// What the members of a collective must agree on: its op and attributes, but a halo
/// exchange's widths (which differ at the borders).
fn collective_key(op: &Op) -> String {
    match op {
        Op::HaloExchange(h) => {
            super::rules::op_key(&Op::HaloExchange(ir::op::HaloExchange { widths: None, ..h.clone() }))
        }
        _ => super::rules::op_key(op),
    }
}

/// The boxes delivered of an output cover it once.
fn covered(name: &str, shape: &[i64], boxes: &[(usize, Region)]) -> Result<(), Refutation> {
    let mut distinct: Vec<&Region> = Vec::new();
    for (_, b) in boxes {
        if !distinct.contains(&b) {
            distinct.push(b);
        }
    }
    let vol = |r: &Region| r.iter().map(|(a, b)| b - a).product::<i64>();
    let total: i64 = shape.iter().product();
    let overlap = distinct
        .iter()
        .enumerate()
        .any(|(i, a)| distinct[i + 1..].iter().any(|b| a.iter().zip(b.iter()).all(|(x, y)| x.0 < y.1 && y.0 < x.1)));
    if overlap || distinct.iter().map(|r| vol(r)).sum::<i64>() != total {
        return Err(refute(
            RefutationKind::Wrong,
            None,
            None,
            format!("output `{name}` is not delivered whole: the devices deliver {distinct:?} of {shape:?}"),
        ));
    }
    Ok(())
}
