//! What the collectives make of the members' pieces, stated from their definitions: an
//! all-reduce sums (or maxes) the members' values, an all-gather concatenates them in group
//! order, a reduce-scatter gives member `i` the `i`-th part of the sum, an all-to-all gives
//! member `j` the `j`-th parts of every member, concatenated in group order.

use super::term::{Fact, Region, Terms, join_shares};

/// The members' facts, in group order, brought to one term and (but for `axis`) one box.
fn same_value(terms: &Terms, facts: &[Fact], axis: Option<usize>) -> Result<Vec<Fact>, String> {
    let first = &facts[0];
    let mut out = vec![Fact { alts: Vec::new(), ..first.clone() }];
    for (i, f) in facts.iter().enumerate().skip(1) {
        if f.term != first.term {
            return Err(format!(
                "the members hold different values: member 0 {}, member {i} {} (first difference: {})",
                terms.describe(first.term),
                terms.describe(f.term),
                terms.difference(first.term, f.term)
            ));
        }
        let fits = |r: &Region| {
            r.len() == first.region.len() && (0..r.len()).all(|d| Some(d) == axis || r[d] == first.region[d])
        };
        let Some(r) = std::iter::once(&f.region).chain(&f.alts).find(|r| fits(r)) else {
            return Err(format!(
                "the members hold different parts: member 0 {:?}, member {i} {:?}",
                first.region, f.region
            ));
        };
        let alts = if axis.is_some() { f.alts.iter().filter(|r| fits(r)).cloned().collect() } else { Vec::new() };
        out.push(Fact { region: r.clone(), alts, ..f.clone() });
    }
    if let Some(a) = axis {
        // A literal piece equal to several parts: the part that follows the one before.
        for i in 1..out.len() {
            let end = out[i - 1].region[a].1;
            if out[i].region[a].0 != end
                && let Some(r) = out[i].alts.iter().find(|r| r[a].0 == end).cloned()
            {
                out[i].region = r;
            }
        }
        for f in &mut out {
            f.alts.clear();
        }
    }
    Ok(out)
}

/// An all-reduce: the sum (or maximum) of the members' values.
pub fn all_reduce(terms: &mut Terms, facts: &[Fact], max: bool) -> Result<Fact, String> {
    let members = same_value(terms, facts, None)?;
    let first = &members[0];
    if members.iter().all(Fact::is_exact) {
        // Every member holds the whole sum already: the sum counts it once per member.
        let term = if max { first.term } else { terms.scaled(first.term, members.len() as f64) };
        return Ok(Fact { term, ..first.clone() });
    }
    let shares: Vec<&[super::term::Share]> = members.iter().map(|f| f.shares.as_slice()).collect();
    let joined = join_shares(&shares, max)?;
    Ok(Fact { shares: joined, ..first.clone() })
}

/// The members' boxes along `axis`, adjacent in group order: their union.
fn adjacent(facts: &[Fact], axis: usize) -> Result<(i64, i64), String> {
    for (i, w) in facts.windows(2).enumerate() {
        if w[0].region[axis].1 != w[1].region[axis].0 {
            return Err(format!(
                "members {i} and {} hold {:?} and {:?} of dim {axis}: not adjacent in group order",
                i + 1,
                w[0].region[axis],
                w[1].region[axis]
            ));
        }
    }
    Ok((facts[0].region[axis].0, facts[facts.len() - 1].region[axis].1))
}

/// An all-gather along `axis`.
pub fn all_gather(terms: &Terms, facts: &[Fact], axis: usize) -> Result<Fact, String> {
    let members = same_value(terms, facts, Some(axis))?;
    if members.iter().any(|f| f.shares != members[0].shares) {
        return Err("the members hold different partial sums".into());
    }
    let span = adjacent(&members, axis)?;
    let mut f = members[0].clone();
    f.region[axis] = span;
    Ok(f)
}

/// Part `i` of `p` of a box along `axis`.
fn part(r: &Region, axis: usize, i: usize, p: usize) -> Result<Region, String> {
    let (a, b) = r[axis];
    let len = b - a;
    if len % p as i64 != 0 {
        return Err(format!("{len} elements of dim {axis} do not split {p} ways"));
    }
    let k = len / p as i64;
    let mut out = r.clone();
    out[axis] = (a + k * i as i64, a + k * (i as i64 + 1));
    Ok(out)
}

/// A reduce-scatter along `axis`: member `i` gets the `i`-th part of the sum.
pub fn reduce_scatter(terms: &mut Terms, facts: &[Fact], axis: usize) -> Result<Vec<Fact>, String> {
    let sum = all_reduce(terms, facts, false)?;
    (0..facts.len()).map(|i| Ok(Fact { region: part(&sum.region, axis, i, facts.len())?, ..sum.clone() })).collect()
}

/// An all-to-all: member `j` gets part `j` (along `split`) of every member, concatenated
/// along `concat` in group order.
pub fn all_to_all(terms: &Terms, facts: &[Fact], split: usize, concat: usize) -> Result<Vec<Fact>, String> {
    let p = facts.len();
    let mut out = Vec::new();
    for j in 0..p {
        let chunks: Vec<Fact> = facts
            .iter()
            .map(|f| Ok(Fact { region: part(&f.region, split, j, p)?, alts: Vec::new(), ..f.clone() }))
            .collect::<Result<_, String>>()?;
        let members = same_value(terms, &chunks, Some(concat))?;
        let span = adjacent(&members, concat)?;
        let mut f = members[0].clone();
        f.region[concat] = span;
        out.push(f);
    }
    Ok(out)
}

/// A halo exchange along `axis`: member `i` (widths `[from_prev, from_next, to_prev,
/// to_next]`) gets the last `from_prev` elements of member `i − 1`'s block before its own and
/// the first `from_next` of member `i + 1`'s after it; what each sends is what its neighbour
/// takes.
pub fn halo(terms: &Terms, facts: &[Fact], axis: usize, widths: &[Vec<i64>]) -> Result<Vec<Fact>, String> {
    let members = same_value(terms, facts, Some(axis))?;
    let w = |i: usize, k: usize| widths.get(i).and_then(|x| x.get(k)).copied().unwrap_or(0);
    let mut out = Vec::new();
    for (i, f) in members.iter().enumerate() {
        let (lo, hi) = f.region[axis];
        let (from_prev, from_next) = (w(i, 0), w(i, 1));
        if from_prev > 0 {
            let Some(p) = i.checked_sub(1).map(|j| &members[j]) else {
                return Err(format!("member {i} takes {from_prev} from before it, where there is no member"));
            };
            if p.region[axis].1 != lo || w(i - 1, 3) != from_prev || p.region[axis].1 - p.region[axis].0 < from_prev {
                return Err(format!(
                    "member {i} takes {from_prev} from member {} , which holds {:?} and sends {}",
                    i - 1,
                    p.region[axis],
                    w(i - 1, 3)
                ));
            }
        }
        if from_next > 0 {
            let Some(nx) = members.get(i + 1) else {
                return Err(format!("member {i} takes {from_next} from after it, where there is no member"));
            };
            if nx.region[axis].0 != hi || w(i + 1, 2) != from_next || nx.region[axis].1 - nx.region[axis].0 < from_next
            {
                return Err(format!(
                    "member {i} takes {from_next} from member {}, which holds {:?} and sends {}",
                    i + 1,
                    nx.region[axis],
                    w(i + 1, 2)
                ));
            }
        }
        let mut g = f.clone();
        g.region[axis] = (lo - from_prev, hi + from_next);
        out.push(g);
    }
    Ok(out)
}
