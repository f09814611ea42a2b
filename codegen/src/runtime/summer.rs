//! Sums and scales of tensors on the device, through one-op graphs per value type.

use super::*;

/// Sums and scales tensors on the device, through one-op graphs per value type (the
/// executor's own Add and Mul kernels); `T` is the executor's tensor.
pub(super) struct Summer<T> {
    pub(super) graphs: HashMap<(ir::DType, Vec<i64>), (Graph, NodeId, NodeId)>,
    /// The scale factors uploaded so far, per dtype and factor (its bits).
    pub(super) factors: HashMap<(ir::DType, u64), T>,
}

impl<T> Default for Summer<T> {
    fn default() -> Self {
        Summer { graphs: HashMap::new(), factors: HashMap::new() }
    }
}

impl<T: Clone> Summer<T> {
    pub(super) fn graph(&mut self, g: &Graph, v: Value) -> Result<&(Graph, NodeId, NodeId), String> {
        let t = g.tensor_type(v).ok_or_else(|| format!("`{}` has no type", g.value_name(v)))?;
        let dims = t.static_dims().ok_or_else(|| format!("`{}` has no static shape", g.value_name(v)))?;
        let key = (t.dtype, dims.clone());
        if !self.graphs.contains_key(&key) {
            let mut s = Graph::new("accumulate");
            let ty = Some(ir::Type::Tensor(ir::TensorType::fixed(t.dtype, &dims)));
            let a = s.add_input("a", ty.clone());
            let b = s.add_input("b", ty.clone());
            let k = s.add_input("k", Some(ir::Type::Tensor(ir::TensorType::scalar(t.dtype))));
            let out = |name: &str| vec![ir::Output { name: name.into(), ty: ty.clone() }];
            let add = s.add_node(Op::Add(Default::default()), vec![Some(a), Some(b)], out("sum"));
            let mul = s.add_node(Op::Mul(Default::default()), vec![Some(a), Some(k)], out("scaled"));
            self.graphs.insert(key.clone(), (s, add, mul));
        }
        Ok(&self.graphs[&key])
    }

    /// `a + b` for tensors of `v`'s type.
    pub(super) fn add<E: Executor<Tensor = T>>(
        &mut self,
        e: &mut E,
        g: &Graph,
        v: Value,
        a: &T,
        b: &T,
    ) -> Result<T, String> {
        let (s, add, _) = self.graph(g, v)?;
        let (mut outs, _) = e.run(s, *add, &[Some(a), Some(b)], &[])?;
        outs.pop().ok_or_else(|| "Add gave no output".into())
    }

    /// `k · a` for a tensor of `v`'s type.
    pub(super) fn scale<E: Executor<Tensor = T>>(
        &mut self,
        e: &mut E,
        g: &Graph,
        v: Value,
        a: &T,
        k: f64,
    ) -> Result<T, String> {
        let dtype = g.tensor_type(v).map_or(ir::DType::Float, |t| t.dtype);
        let kt = match self.factors.get(&(dtype, k.to_bits())) {
            Some(t) => t.clone(),
            None => {
                let t = e.upload(&Array::float(dtype, vec![], vec![k]))?;
                self.factors.insert((dtype, k.to_bits()), t.clone());
                t
            }
        };
        let (s, _, mul) = self.graph(g, v)?;
        let (mut outs, _) = e.run(s, *mul, &[Some(a), Some(&kt)], &[])?;
        outs.pop().ok_or_else(|| "Mul gave no output".into())
    }
}
