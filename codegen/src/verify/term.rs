//! The prover's symbolic values: terms over the global graph's values, hash-consed, and the
//! facts that say which piece of a term a device holds.
//!
//! A term names a whole tensor of the single-device computation: a graph input or parameter
//! (a leaf), a literal (by its data), or an op applied to terms. Two computations build the
//! same term exactly when they apply the same ops, with the same attributes, to the same
//! terms: the device programs and the global graph are interpreted by the same rules, so a
//! device's value is the global value it claims to be when their terms are one.
//!
//! Normal forms, so that the lowering's rewritten forms meet the global ops they stand for:
//! `Identity` is its input; a product with (or quotient by) a scalar literal is a `Scaled`
//! term, scales multiplying out (in f32, as the kernels multiply); composite ops (softmax,
//! layer normalization, mean losses) are built from their definitions
//! ([`super::rules`]).

use std::collections::HashMap;

/// A term's index in [`Terms`].
pub type TermId = u32;

/// What a term is.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Head {
    /// A global input or trainable parameter, by name.
    Leaf(String),
    /// A literal: its type, shape and the bits of its data.
    Const(String),
    /// Output `slot` of an op (its type and the attributes that are not local shapes).
    Op { key: String, slot: u16 },
    /// A term times a scalar (f32 bits).
    Scaled(u32),
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Node {
    head: Head,
    inputs: Vec<TermId>,
    shape: Vec<i64>,
}

/// The hash-consed terms of one proof.
#[derive(Default)]
pub struct Terms {
    nodes: Vec<Node>,
    index: HashMap<Node, TermId>,
    /// Per term, the op terms that read it (for the ops whose global shape a device cannot
    /// know: a reshape's target).
    users: HashMap<TermId, Vec<TermId>>,
    /// The values of literals (those small enough to fold).
    values: HashMap<TermId, ir::eval::Array>,
}

impl Terms {
    fn intern(&mut self, node: Node) -> TermId {
        if let Some(&t) = self.index.get(&node) {
            return t;
        }
        let t = self.nodes.len() as TermId;
        for &i in &node.inputs {
            let u = self.users.entry(i).or_default();
            if !u.contains(&t) {
                u.push(t);
            }
        }
        self.nodes.push(node.clone());
        self.index.insert(node, t);
        t
    }

    /// A leaf.
    pub fn leaf(&mut self, name: &str, shape: &[i64]) -> TermId {
        self.intern(Node { head: Head::Leaf(name.to_string()), inputs: Vec::new(), shape: shape.to_vec() })
    }

    /// A literal, identified by `data` (type, shape and values), with its value.
    pub fn constant(&mut self, data: String, shape: &[i64], value: Option<&ir::eval::Array>) -> TermId {
        let t = self.intern(Node { head: Head::Const(data), inputs: Vec::new(), shape: shape.to_vec() });
        if let Some(v) = value {
            self.values.entry(t).or_insert_with(|| v.clone());
        }
        t
    }

    /// A literal's value, when it was given.
    pub fn value(&self, t: TermId) -> Option<&ir::eval::Array> {
        self.values.get(&t)
    }

    /// Output `slot` of op `key` on `inputs`, of `shape`.
    pub fn op(&mut self, key: &str, slot: u16, inputs: &[TermId], shape: &[i64]) -> TermId {
        self.intern(Node {
            head: Head::Op { key: key.to_string(), slot },
            inputs: inputs.to_vec(),
            shape: shape.to_vec(),
        })
    }

    /// `t` times `c`, scales multiplied out in f32; a scale of 1 is `t`.
    pub fn scaled(&mut self, t: TermId, c: f64) -> TermId {
        let (base, c0) = match self.nodes[t as usize].head {
            Head::Scaled(bits) => (self.nodes[t as usize].inputs[0], f32::from_bits(bits) as f64),
            _ => (t, 1.0),
        };
        let c = (c0 * c) as f32;
        if c == 1.0 {
            return base;
        }
        let shape = self.nodes[base as usize].shape.clone();
        self.intern(Node { head: Head::Scaled(c.to_bits()), inputs: vec![base], shape })
    }

    /// The global shape of `t`.
    pub fn shape(&self, t: TermId) -> &[i64] {
        &self.nodes[t as usize].shape
    }

    /// What `t` is.
    pub fn head(&self, t: TermId) -> &Head {
        &self.nodes[t as usize].head
    }

    /// The terms `t` is computed from.
    pub fn inputs(&self, t: TermId) -> &[TermId] {
        &self.nodes[t as usize].inputs
    }

    /// The op terms that read `t`.
    pub fn users(&self, t: TermId) -> &[TermId] {
        self.users.get(&t).map_or(&[], Vec::as_slice)
    }

    /// How many terms there are.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// A short description of `t`, for messages: its head and shape, and its inputs' heads.
    pub fn describe(&self, t: TermId) -> String {
        format!("{} {:?}", self.expression(t, 1), self.nodes[t as usize].shape)
    }

    /// `t` as an expression `depth` ops deep (deeper inputs by their head).
    pub fn expression(&self, t: TermId, depth: usize) -> String {
        let n = &self.nodes[t as usize];
        let head = match &n.head {
            Head::Leaf(s) => s.clone(),
            Head::Const(d) => format!("literal {}", d.chars().take(40).collect::<String>()),
            Head::Op { key, slot } => {
                let k = key.split('|').next().unwrap_or(key).trim_start_matches('.');
                if *slot == 0 { k.to_string() } else { format!("{k}#{slot}") }
            }
            Head::Scaled(b) => format!("×{}", f32::from_bits(*b)),
        };
        if n.inputs.is_empty() || depth == 0 {
            return head;
        }
        let ins: Vec<String> = n.inputs.iter().map(|&i| self.expression(i, depth - 1)).collect();
        format!("{head}({})", ins.join(", "))
    }
}

impl Terms {
    /// Where terms `a` and `b` first differ, following their first differing inputs: the
    /// two subterms described.
    pub fn difference(&self, a: TermId, b: TermId) -> String {
        let (mut a, mut b) = (a, b);
        loop {
            let (na, nb) = (&self.nodes[a as usize], &self.nodes[b as usize]);
            let next = (na.head == nb.head && na.inputs.len() == nb.inputs.len())
                .then(|| na.inputs.iter().zip(&nb.inputs).find(|(x, y)| x != y))
                .flatten();
            match next {
                Some((&x, &y)) => (a, b) = (x, y),
                None => return format!("{} vs {}", self.describe(a), self.describe(b)),
            }
        }
    }
}

/// A box: per dim, the `[start, end)` range held.
pub type Region = Vec<(i64, i64)>;

/// The whole of a tensor of `shape`.
pub fn whole(shape: &[i64]) -> Region {
    shape.iter().map(|&d| (0, d)).collect()
}

/// The extents of a box.
pub fn extents(r: &Region) -> Vec<i64> {
    r.iter().map(|(a, b)| b - a).collect()
}

fn volume(r: &Region) -> i64 {
    r.iter().map(|(a, b)| b - a).product()
}

pub(super) fn overlap(a: &Region, b: &Region) -> bool {
    a.iter().zip(b).all(|(x, y)| x.0 < y.1 && y.0 < x.1)
}

/// Part of a reduction: the local value sums (or takes the maximum over) only the terms of
/// `site`'s reduction whose indices lie in `held`.
#[derive(Clone, Debug, PartialEq)]
pub struct Share {
    /// The reduction (a term) whose sum is incomplete.
    pub site: TermId,
    /// The shape of its reduction index space.
    pub space: Vec<i64>,
    /// The boxes of that space held, disjoint.
    pub held: Vec<Region>,
    /// A maximum, not a sum.
    pub max: bool,
}

impl Share {
    /// Every index of the space held.
    pub fn complete(&self) -> bool {
        self.held.iter().map(volume).sum::<i64>() == self.space.iter().product::<i64>()
    }
}

/// What a device's value is: the box `region` of `term`, exact, or with the reductions of
/// `shares` incomplete (the term is linear in each of them).
#[derive(Clone, Debug, PartialEq)]
pub struct Fact {
    pub term: TermId,
    pub region: Region,
    pub shares: Vec<Share>,
    /// Other boxes of `term` the value equally is (a literal piece whose data repeats).
    pub alts: Vec<Region>,
}

impl Fact {
    /// The box `region` of `term`, exact.
    pub fn exact(term: TermId, region: Region) -> Fact {
        Fact { term, region, shares: Vec::new(), alts: Vec::new() }
    }

    /// All of `term`, exact.
    pub fn whole(terms: &Terms, term: TermId) -> Fact {
        Fact::exact(term, whole(terms.shape(term)))
    }

    /// No reduction incomplete.
    pub fn is_exact(&self) -> bool {
        self.shares.is_empty()
    }

    /// The fact with `region` chosen among its equal boxes, if it is one of them.
    pub fn at(&self, region: &Region) -> Option<Fact> {
        if &self.region == region || self.alts.contains(region) {
            Some(Fact { region: region.clone(), alts: Vec::new(), ..self.clone() })
        } else {
            None
        }
    }
}

/// The shares of a sum of `a` and `b`: the union, one site held the same way in both.
pub fn add_shares(a: &[Share], b: &[Share]) -> Result<Vec<Share>, String> {
    let mut out = a.to_vec();
    for s in b {
        match out.iter().find(|x| x.site == s.site) {
            Some(x) if x.held == s.held && x.max == s.max => {}
            Some(x) => {
                return Err(format!(
                    "adds two partial sums of one reduction holding different parts ({:?} and {:?} of {:?})",
                    x.held, s.held, s.space
                ));
            }
            None => out.push(s.clone()),
        }
    }
    Ok(out)
}

/// Joins the shares of the members of a sum (or max) over devices: per site, the parts
/// held (none where a member does not name the site), which must not overlap; complete
/// sites drop out.
pub fn join_shares(members: &[&[Share]], max: bool) -> Result<Vec<Share>, String> {
    let mut out: Vec<Share> = Vec::new();
    for m in members {
        for s in m.iter() {
            if s.max != max {
                return Err(format!(
                    "a {} all-reduce of a partial {}",
                    if max { "max" } else { "sum" },
                    if s.max { "maximum" } else { "sum" }
                ));
            }
            match out.iter_mut().find(|x| x.site == s.site) {
                None => out.push(s.clone()),
                Some(x) => {
                    for h in &s.held {
                        if x.held.iter().any(|y| overlap(y, h)) {
                            return Err(format!("the members' partial sums overlap at {h:?}: counted twice"));
                        }
                        x.held.push(h.clone());
                    }
                }
            }
        }
    }
    // A member without a site holds all of that reduction (its value completed it): the
    // others must hold none of it (they add zero: a value kept once), else it is counted
    // twice.
    for s in &mut out {
        let whole = members.iter().filter(|m| m.iter().all(|x| x.site != s.site)).count();
        match whole {
            0 => {}
            1 if s.held.is_empty() => s.held = vec![s.space.iter().map(|&d| (0, d)).collect()],
            _ => {
                return Err(format!(
                    "{whole} members hold a reduction whole and the others {:?} of it: counted twice",
                    s.held
                ));
            }
        }
    }
    out.retain(|s| !s.complete());
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share(held: Vec<Region>) -> Share {
        Share { site: 7, space: vec![8, 7], held, max: false }
    }

    // A value kept once (a shared weight's gradient added by one device of a pair): the member
    // that completed the reduction holds all of it, the other none, so the sum is complete;
    // a member also holding a part of it, or two holding all, count it twice.
    #[test]
    fn a_member_that_completed_a_reduction_holds_all_of_it() {
        let none = [share(Vec::new())];
        assert_eq!(join_shares(&[&[], &none], false), Ok(Vec::new()));
        let part = [share(vec![vec![(0, 4), (0, 7)]])];
        assert!(join_shares(&[&[], &part], false).unwrap_err().contains("counted twice"));
        assert!(join_shares(&[&[], &[], &none], false).unwrap_err().contains("counted twice"));
        // Without a member holding it whole, the parts join as before.
        let rest = [share(vec![vec![(4, 8), (0, 7)]])];
        assert_eq!(join_shares(&[&part, &rest], false), Ok(Vec::new()));
        assert_eq!(join_shares(&[&part, &none], false).map(|s| s.len()), Ok(1), "half of it is still missing");
    }
}
