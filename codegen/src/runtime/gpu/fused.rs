//! Fused element-wise kernels: a group of element-wise ops ([`crate::runtime::fuse`]) as one
//! kernel. Each member's own program is compiled first, as it would run alone; where every
//! one is a single element-wise launch ([`Pointwise`]) over the group's output shape, their
//! expressions become functions of one kernel that reads each outside value once and writes
//! only the root's output. Each member computes in the storage it has alone (its expression
//! and operand types unchanged), so the values are those of the members run one by one.

use std::collections::BTreeMap;

use super::Elem;
use super::compile::{Buf, Compiled, OutSpec, Pointwise, Step, groups};
use super::wgsl::{Access, Binding, MATH_FNS, broadcast_strides, merge_dims, source, unrolled_offsets};
use crate::runtime::fuse::{MAX_BINDINGS, Source};

/// Member `j`'s single element-wise launch, when its program is just that, writing its one
/// fresh output.
fn pointwise(p: &Compiled) -> Option<&Pointwise> {
    let [Step::Launch(l)] = p.steps.as_slice() else { return None };
    let pw = l.pointwise.as_deref()?;
    let fresh = p.outputs.len() == 1 && p.outputs[0].view_of.is_none() && p.temps.is_empty();
    (fresh && pw.out.0 == Buf::Out(0)).then_some(pw)
}

/// One kernel for the members' programs (`members`, in the group's order, the root last);
/// `sources[j][k]`: where member `j`'s input slot `k` comes from; `outputs`: the members
/// whose values it writes, its outputs in that order. The kernel's `Buf::In(o)` is outside
/// value `o`. `None` where some member is not one element-wise launch over the root's shape,
/// or the kernel would bind more than [`MAX_BINDINGS`] values.
pub fn compile_group(members: &[Compiled], sources: &[Vec<Option<Source>>], outputs: &[usize]) -> Option<Compiled> {
    let root = members.last()?;
    let shape = root.outputs.first()?.shape.clone();
    let count: usize = shape.iter().product();
    let mut fns = String::from(MATH_FNS);
    let mut calls = String::new();
    // Outside value → (its shape as read, storage), in binding order.
    let mut bound: BTreeMap<usize, (Vec<usize>, Elem)> = BTreeMap::new();
    let mut out_elems = Vec::new();
    for (j, p) in members.iter().enumerate() {
        let pw = pointwise(p)?;
        if pw.shape != shape {
            return None;
        }
        let mut params = Vec::new();
        let mut args = Vec::new();
        for (k, (buf, in_shape, elem)) in pw.ins.iter().enumerate() {
            let Buf::In(slot) = *buf else { return None };
            match sources.get(j)?.get(slot).copied().flatten()? {
                Source::Member(m) if m < j && *in_shape == shape => args.push(format!("v{m}")),
                Source::Member(_) => return None,
                Source::Outside(o) => {
                    if bound.get(&o).is_some_and(|b| b.0 != *in_shape || b.1 != *elem) {
                        return None;
                    }
                    bound.insert(o, (in_shape.clone(), *elem));
                    args.push(format!("x{o}"));
                }
            }
            params.push(format!("{}: {}", ["a", "b", "c"].get(k)?, elem.wgsl()));
        }
        out_elems.push(pw.out.1);
        fns.push_str(&format!(
            "fn f{j}({}) -> {} {{\n    return {};\n}}\n",
            params.join(", "),
            pw.out.1.wgsl(),
            pw.expr
        ));
        calls.push_str(&format!("    let v{j} = f{j}({});\n", args.join(", ")));
    }
    if bound.len() + outputs.len() > MAX_BINDINGS || count == 0 || outputs.last() != Some(&(members.len() - 1)) {
        return None;
    }
    let written: Vec<(usize, Elem)> = outputs.iter().map(|&j| Some((j, *out_elems.get(j)?))).collect::<Option<_>>()?;
    let src = fused_src(&bound, &shape, &fns, &calls, &written);
    let mut c = Compiled {
        outputs: outputs.iter().map(|&j| OutSpec { view_of: None, ..members[j].outputs[0].clone() }).collect(),
        ..Compiled::default()
    };
    let mut bufs: Vec<Buf> = bound.keys().map(|&o| Buf::In(o)).collect();
    bufs.extend((0..outputs.len()).map(Buf::Out));
    c.launch(src, bufs, vec![count as u32], groups(count));
    Some(c)
}

/// The kernel: outside values `bound` read as the members read them, the members' functions
/// `fns` called in order (`calls`), the values of the members `written` (with their storage)
/// written to `Y0`, `Y1`, ….
fn fused_src(
    bound: &BTreeMap<usize, (Vec<usize>, Elem)>,
    shape: &[usize],
    fns: &str,
    calls: &str,
    written: &[(usize, Elem)],
) -> String {
    let names: Vec<String> = bound.keys().map(|o| format!("X{o}")).collect();
    let outs: Vec<String> = (0..written.len()).map(|k| format!("Y{k}")).collect();
    let mut bindings: Vec<Binding<'_>> =
        bound.values().zip(&names).map(|((_, e), n)| (n.as_str(), *e, false)).collect();
    bindings.extend(written.iter().zip(&outs).map(|((_, e), n)| (n.as_str(), *e, true)));
    let access: Vec<Access> = bound.values().map(|(s, _)| Access::of(s, shape)).collect();
    let strided: Vec<usize> = (0..access.len()).filter(|&k| access[k] == Access::Strided).collect();
    let mut body = String::new();
    if !strided.is_empty() {
        let all: Vec<&Vec<usize>> = bound.values().map(|(s, _)| s).collect();
        let st: Vec<Vec<u32>> = strided.iter().map(|&k| broadcast_strides(all[k], shape)).collect();
        let (ms, mst) = merge_dims(shape, &st, &vec![false; shape.len()]);
        body.push_str(&unrolled_offsets(&ms, &mst, &|_, c| c.to_string()));
    }
    for (k, o) in bound.keys().enumerate() {
        let index = match access[k] {
            Access::Flat => "i".to_string(),
            Access::Scalar => "0u".to_string(),
            Access::Strided => format!("o{}", strided.iter().position(|&j| j == k).expect("strided")),
        };
        body.push_str(&format!("    let x{o} = X{o}[{index}];\n"));
    }
    body.push_str(calls);
    for (k, (j, _)) in written.iter().enumerate() {
        body.push_str(&format!("    Y{k}[i] = v{j};\n"));
    }
    source(&bindings, fns, &body)
}

#[cfg(test)]
mod tests {
    use ir::DType;

    use super::*;
    use crate::runtime::gpu::compile::{CompileCx, TensorDesc, compile};
    use crate::runtime::gpu::wgsl::validate;

    fn member(op: &str, ins: &[(&[usize], DType)], out: (&[usize], DType)) -> Compiled {
        let op = ir::Op::from_parts("", op, Vec::new()).expect("an op");
        let cx = CompileCx {
            ins: ins.iter().map(|(s, d)| Some(TensorDesc { shape: s.to_vec(), dtype: *d, value: None })).collect(),
            outs: vec![Some((out.0.to_vec(), out.1))],
            opset: 18,
            subgroup: None,
        };
        compile(&op, &cx).expect("compiles").expect("a kernel")
    }

    #[test]
    fn a_group_is_one_launch_reading_each_outside_value_once() {
        let f = DType::Float;
        let full: &[usize] = &[2, 3, 4];
        let members = [
            member("Add", &[(full, f), (&[4], f)], (full, f)),
            member("Sigmoid", &[(full, f)], (full, f)),
            member("Mul", &[(full, f), (full, f)], (full, f)),
            member("Greater", &[(full, f), (&[3, 1], f)], (full, DType::Bool)),
        ];
        let sources = vec![
            vec![Some(Source::Outside(0)), Some(Source::Outside(1))],
            vec![Some(Source::Member(0))],
            vec![Some(Source::Member(0)), Some(Source::Member(1))],
            vec![Some(Source::Member(2)), Some(Source::Outside(2))],
        ];
        let c = compile_group(&members, &sources, &[3]).expect("one kernel");
        let l: Vec<_> = c.launches().collect();
        assert_eq!(l.len(), 1);
        assert_eq!(l[0].bufs, vec![Buf::In(0), Buf::In(1), Buf::In(2), Buf::Out(0)]);
        assert_eq!((c.outputs[0].shape.as_slice(), c.outputs[0].dtype), (full, DType::Bool));
        validate("fused", &l[0].src);
        assert!(l[0].src.contains("fn f3(a: f32, b: f32) -> i32"), "{}", l[0].src);
        // The sigmoid's value written too, as the kernel's first output.
        let c = compile_group(&members, &sources, &[1, 3]).expect("one kernel");
        let l: Vec<_> = c.launches().collect();
        assert_eq!(l[0].bufs, vec![Buf::In(0), Buf::In(1), Buf::In(2), Buf::Out(0), Buf::Out(1)]);
        assert_eq!(c.outputs.iter().map(|o| o.dtype).collect::<Vec<_>>(), [DType::Float, DType::Bool]);
        assert!(l[0].src.contains("Y0[i] = v1;") && l[0].src.contains("Y1[i] = v3;"), "{}", l[0].src);
        validate("fused, two outputs", &l[0].src);
        // The root's value is always written.
        assert!(compile_group(&members, &sources, &[1]).is_none());
        // A member of another shape (read broadcast), or one that is not element-wise, is
        // not fused.
        let small = member("Sigmoid", &[(&[4], f)], (&[4], f));
        let sources = vec![vec![Some(Source::Outside(0))], vec![Some(Source::Outside(1)), Some(Source::Member(0))]];
        assert!(compile_group(&[small, members[0].clone()], &sources, &[1]).is_none());
        let reduce = member("ReduceSum", &[(full, f)], (&[1, 1, 1], f));
        let sources = vec![vec![Some(Source::Outside(0))], vec![Some(Source::Member(0))]];
        assert!(compile_group(&[reduce, members[1].clone()], &sources, &[1]).is_none());
    }
}
