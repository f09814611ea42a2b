//! Recurrent layers: the input projections of every step in one GEMM per direction, then a
//! step kernel per time step (LSTM; GRU as gates then state; RNN), the hidden state
//! ping-ponging between two scratch buffers; the final states are stacked per direction.

use ir::DType;
use ir::op;

use super::Elem;
use super::compile::{Buf, CompileCx, CompileResult, Compiled, Kernel, OutSpec, Step, groups};
use super::gemm::{GemmSpec, gemm};
use super::wgsl::{MATH_FNS, place, source};

/// What the step kernels cover: layout 0, default activations, no clip, no sequence lengths,
/// no peepholes, no coupled input-forget gate.
struct Cell {
    gates: usize,
    reverse_second: bool,
    reverse: bool,
    linear_before_reset: bool,
}

fn compile_recurrent(cx: &CompileCx<'_>, cell: Cell) -> CompileResult {
    let (Some(x), Some(w), Some(_)) = (cx.input(0), cx.input(1), cx.input(2)) else { return Ok(None) };
    if x.elem() != Elem::F32 || x.shape.len() != 3 || w.shape.len() != 3 {
        return Ok(None);
    }
    let gates = cell.gates;
    let (seq, b, isz) = (x.shape[0], x.shape[1], x.shape[2]);
    let dirs = w.shape[0];
    let h = w.shape[1] / gates;
    let mut c = Compiled::default();
    for (k, out) in cx.outs.iter().enumerate() {
        let (shape, dtype) = match out {
            Some(o) => o.clone(),
            None if k == 0 => (vec![seq, dirs, b, h], DType::Float),
            None => (vec![dirs, b, h], DType::Float),
        };
        c.outputs.push(OutSpec { shape, dtype, view_of: None });
    }
    let y = if c.outputs.is_empty() { c.temp(vec![seq, dirs, b, h], DType::Float) } else { Buf::Out(0) };
    let bias = match cx.input(3) {
        Some(_) => Buf::In(3),
        None => {
            let z = c.temp(vec![dirs, 2 * gates * h], DType::Float);
            c.steps.push(Step::Zero(z));
            z
        }
    };
    let mut last_h = Vec::new();
    let mut last_c = Vec::new();
    for dir in 0..dirs {
        let reverse = cell.reverse || (cell.reverse_second && dir == 1);
        // XW[t·B + b, q] = Σ_k X[t, b, k] · W[dir, q, k].
        let xw = c.temp(vec![seq * b, gates * h], DType::Float);
        let spec = GemmSpec {
            a: Buf::In(0),
            b: Buf::In(1),
            c: None,
            m: seq * b,
            n: gates * h,
            k: isz,
            a_st: (isz, 1),
            b_st: (1, isz),
            c_st: (0, 0),
            batch: vec![],
            a_bst: vec![],
            b_bst: vec![],
            c_bst: vec![],
            bases: (0, dir * gates * h * isz, 0),
            alpha: 1.0,
            beta: 0.0,
        };
        gemm(&mut c, &spec, xw)?;
        // Initial states.
        let init = |c: &mut Compiled, k: usize| -> Buf {
            let t = c.temp(vec![b, h], DType::Float);
            match cx.input(k) {
                Some(_) => c.steps.push(Step::Copy { src: Buf::In(k), offset: dir * b * h, dst: t, n: b * h }),
                None => c.steps.push(Step::Zero(t)),
            }
            t
        };
        let mut hp = init(&mut c, 5);
        let mut hn = c.temp(vec![b, h], DType::Float);
        let (mut cp, mut cn) = if gates == 4 {
            let cp = init(&mut c, 6);
            (Some(cp), Some(c.temp(vec![b, h], DType::Float)))
        } else {
            (None, None)
        };
        let zg = c.temp(vec![b, h], DType::Float);
        let rg = c.temp(vec![b, h], DType::Float);
        for step in 0..seq {
            let t = if reverse { seq - 1 - step } else { step };
            let p = vec![
                (b * h) as u32,
                h as u32,
                b as u32,
                t as u32,
                dir as u32,
                dirs as u32,
                1,
                cell.linear_before_reset as u32,
            ];
            let grid = groups(b * h);
            match gates {
                4 => {
                    let (c_prev, c_next) = (cp.expect("cell"), cn.expect("cell"));
                    let bufs = vec![xw, Buf::In(2), bias, hp, c_prev, hn, c_next, y];
                    c.launch(lstm_step_src(), bufs, p[..7].to_vec(), grid);
                }
                3 => {
                    c.launch(gru_gates_src(), vec![xw, Buf::In(2), bias, hp, zg, rg], p.clone(), grid);
                    c.launch(gru_state_src(), vec![xw, Buf::In(2), bias, hp, zg, rg, hn, y], p, grid);
                }
                _ => c.launch(rnn_step_src(), vec![xw, Buf::In(2), bias, hp, hn, y], p[..7].to_vec(), grid),
            }
            std::mem::swap(&mut hp, &mut hn);
            if let (Some(a), Some(n)) = (cp.as_mut(), cn.as_mut()) {
                std::mem::swap(a, n);
            }
        }
        last_h.push(hp);
        last_c.extend(cp);
    }
    // Y_h and Y_c: [dirs, B, H] from the per-direction states.
    for (slot, parts) in [(1, &last_h), (2, &last_c)] {
        if slot < c.outputs.len() {
            for (d, &part) in parts.iter().enumerate() {
                place(&mut c, part, Elem::F32, Buf::Out(slot), [b * h, b * h, dirs * b * h, d * b * h]);
            }
        }
    }
    Ok(Some(c))
}

/// `Name: gates, linear_before_reset`; attributes the step kernels do not cover run on the
/// host.
macro_rules! recurrent_kernels {
    ($($name:ident: $gates:expr, |$s:ident, $cx:ident| $lbr:expr, $unsupported:expr;)*) => {$(
        impl Kernel for op::$name {
            fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
                let ($s, $cx) = (self, cx);
                if self.layout() != 0
                    || cx.input(4).is_some()
                    || self.activations.is_some()
                    || self.clip.is_some()
                    || self.activation_alpha.is_some()
                    || self.activation_beta.is_some()
                    || $unsupported
                {
                    return Ok(None);
                }
                let direction = self.direction();
                compile_recurrent(
                    cx,
                    Cell {
                        gates: $gates,
                        reverse: direction == "reverse",
                        reverse_second: direction == "bidirectional",
                        linear_before_reset: $lbr,
                    },
                )
            }
        }
    )*};
}

recurrent_kernels! {
    LSTM: 4, |s, cx| false, s.input_forget() != 0 || cx.input(7).is_some();
    GRU: 3, |s, _cx| s.linear_before_reset() != 0, false;
    RNN: 1, |_s, _cx| false, false;
}

/// One LSTM step for one direction: thread per (batch, unit). Gates `iofc`. `XW` holds the
/// input projections `[seq, batch, 4H]`. `P = [count=B·H, H, B, t, dir, dirs, has_bias,
/// has_y]`.
pub fn lstm_step_src() -> String {
    let body = "    let Hs = P[1]; let Bn = P[2]; let t = P[3]; let dir = P[4]; let dirs = P[5];
    let b = i / Hs; let j = i % Hs;
    var g = array<f32, 4>(0.0, 0.0, 0.0, 0.0);
    for (var q = 0u; q < 4u; q = q + 1u) {
        var acc = XW[(t * Bn + b) * 4u * Hs + q * Hs + j];
        if (P[6] != 0u) { acc = acc + BI[dir * 8u * Hs + q * Hs + j] + BI[dir * 8u * Hs + 4u * Hs + q * Hs + j]; }
        let rrow = (dir * 4u * Hs + q * Hs + j) * Hs;
        for (var k = 0u; k < Hs; k = k + 1u) { acc = acc + HP[b * Hs + k] * R[rrow + k]; }
        g[q] = acc;
    }
    let ig = sigmoid_(g[0]); let og = sigmoid_(g[1]); let fg = sigmoid_(g[2]); let cg = tanh_(g[3]);
    let c = fg * CP[b * Hs + j] + ig * cg;
    let h = og * tanh_(c);
    CN[b * Hs + j] = c;
    HN[b * Hs + j] = h;
    Y[((t * dirs + dir) * Bn + b) * Hs + j] = h;";
    source(
        &[
            ("XW", Elem::F32, false),
            ("R", Elem::F32, false),
            ("BI", Elem::F32, false),
            ("HP", Elem::F32, false),
            ("CP", Elem::F32, false),
            ("HN", Elem::F32, true),
            ("CN", Elem::F32, true),
            ("Y", Elem::F32, true),
        ],
        MATH_FNS,
        body,
    )
}

/// GRU step, first half: update and reset gates, and the reset hidden state (`r ⊙ h` before
/// the recurrence, or the recurrence of `h` for `linear_before_reset`).
/// `P = [count, H, B, t, dir, dirs, has_bias, linear_before_reset]`.
pub fn gru_gates_src() -> String {
    let body = "    let Hs = P[1]; let Bn = P[2]; let t = P[3]; let dir = P[4];
    let b = i / Hs; let j = i % Hs;
    var zr = array<f32, 2>(0.0, 0.0);
    for (var q = 0u; q < 2u; q = q + 1u) {
        var acc = XW[(t * Bn + b) * 3u * Hs + q * Hs + j];
        if (P[6] != 0u) { acc = acc + BI[dir * 6u * Hs + q * Hs + j] + BI[dir * 6u * Hs + 3u * Hs + q * Hs + j]; }
        let rrow = (dir * 3u * Hs + q * Hs + j) * Hs;
        for (var k = 0u; k < Hs; k = k + 1u) { acc = acc + HP[b * Hs + k] * R[rrow + k]; }
        zr[q] = sigmoid_(acc);
    }
    Z[b * Hs + j] = zr[0];
    RG[b * Hs + j] = zr[1];";
    source(
        &[
            ("XW", Elem::F32, false),
            ("R", Elem::F32, false),
            ("BI", Elem::F32, false),
            ("HP", Elem::F32, false),
            ("Z", Elem::F32, true),
            ("RG", Elem::F32, true),
        ],
        MATH_FNS,
        body,
    )
}

/// GRU step, second half: the candidate state and the new hidden state.
pub fn gru_state_src() -> String {
    let body = "    let Hs = P[1]; let Bn = P[2]; let t = P[3]; let dir = P[4]; let dirs = P[5];
    let b = i / Hs; let j = i % Hs;
    var acc = XW[(t * Bn + b) * 3u * Hs + 2u * Hs + j];
    var wb = 0.0; var rb = 0.0;
    if (P[6] != 0u) { wb = BI[dir * 6u * Hs + 2u * Hs + j]; rb = BI[dir * 6u * Hs + 5u * Hs + j]; }
    let rrow = (dir * 3u * Hs + 2u * Hs + j) * Hs;
    var rec = 0.0;
    if (P[7] != 0u) {
        for (var k = 0u; k < Hs; k = k + 1u) { rec = rec + HP[b * Hs + k] * R[rrow + k]; }
        rec = RG[b * Hs + j] * (rec + rb);
    } else {
        for (var k = 0u; k < Hs; k = k + 1u) { rec = rec + RG[b * Hs + k] * HP[b * Hs + k] * R[rrow + k]; }
        rec = rec + rb;
    }
    let hc = tanh_(acc + wb + rec);
    let z = Z[b * Hs + j];
    let h = (1.0 - z) * hc + z * HP[b * Hs + j];
    HN[b * Hs + j] = h;
    Y[((t * dirs + dir) * Bn + b) * Hs + j] = h;";
    source(
        &[
            ("XW", Elem::F32, false),
            ("R", Elem::F32, false),
            ("BI", Elem::F32, false),
            ("HP", Elem::F32, false),
            ("Z", Elem::F32, false),
            ("RG", Elem::F32, false),
            ("HN", Elem::F32, true),
            ("Y", Elem::F32, true),
        ],
        MATH_FNS,
        body,
    )
}

/// Plain RNN step (tanh). `P = [count, H, B, t, dir, dirs, has_bias]`.
pub fn rnn_step_src() -> String {
    let body = "    let Hs = P[1]; let Bn = P[2]; let t = P[3]; let dir = P[4]; let dirs = P[5];
    let b = i / Hs; let j = i % Hs;
    var acc = XW[(t * Bn + b) * Hs + j];
    if (P[6] != 0u) { acc = acc + BI[dir * 2u * Hs + j] + BI[dir * 2u * Hs + Hs + j]; }
    let rrow = (dir * Hs + j) * Hs;
    for (var k = 0u; k < Hs; k = k + 1u) { acc = acc + HP[b * Hs + k] * R[rrow + k]; }
    let h = tanh_(acc);
    HN[b * Hs + j] = h;
    Y[((t * dirs + dir) * Bn + b) * Hs + j] = h;";
    source(
        &[
            ("XW", Elem::F32, false),
            ("R", Elem::F32, false),
            ("BI", Elem::F32, false),
            ("HP", Elem::F32, false),
            ("HN", Elem::F32, true),
            ("Y", Elem::F32, true),
        ],
        MATH_FNS,
        body,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::gpu::wgsl::validate;

    #[test]
    fn recurrent_step_kernels_validate() {
        validate("lstm", &lstm_step_src());
        validate("gru gates", &gru_gates_src());
        validate("gru state", &gru_state_src());
        validate("rnn", &rnn_step_src());
    }
}
