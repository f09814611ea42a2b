//! Recurrent layers: the input projections of every step in one GEMM per direction, then a
//! step kernel per time step (LSTM; GRU as gates then state; RNN), the hidden state
//! ping-ponging between two scratch buffers; the final states are stacked per direction.

use ir::DType;
use ir::op;

use super::Elem;
use super::compile::{Buf, CompileCx, CompileResult, Compiled, Kernel, OutSpec, Step, groups, nested};
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
            // Each invocation: per gate, a row of the recurrent weights.
            let trips = nested(&[4, h]);
            match gates {
                4 => {
                    let (c_prev, c_next) = (cp.expect("cell"), cn.expect("cell"));
                    let bufs = vec![xw, Buf::In(2), bias, hp, c_prev, hn, c_next, y];
                    c.launch_loop(lstm_step_src(), bufs, p[..7].to_vec(), grid, trips);
                }
                3 => {
                    let bufs = vec![xw, Buf::In(2), bias, hp, zg, rg];
                    c.launch_loop(gru_gates_src(), bufs, p.clone(), grid, trips);
                    let bufs = vec![xw, Buf::In(2), bias, hp, zg, rg, hn, y];
                    c.launch_loop(gru_state_src(), bufs, p, grid, trips);
                }
                _ => {
                    let bufs = vec![xw, Buf::In(2), bias, hp, hn, y];
                    c.launch_loop(rnn_step_src(), bufs, p[..7].to_vec(), grid, trips);
                }
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

impl Kernel for op::RecurrentGrad {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        let (Some(x), Some(w), Some(_)) = (cx.input(0), cx.input(1), cx.input(2)) else { return Ok(None) };
        let cell = match self.cell.as_deref() {
            Some("LSTM") | None => 0u32,
            Some("GRU") => 1,
            Some("RNN") => 2,
            _ => return Ok(None),
        };
        if x.elem() != Elem::F32
            || x.shape.len() != 3
            || w.shape.len() != 3
            || self.layout() != 0
            || self.activations.is_some()
            || self.activation_alpha.is_some()
            || self.activation_beta.is_some()
            || self.clip.is_some()
            || self.input_forget() != 0
            || cx.input(4).is_some()
            || cx.input(7).is_some()
            || cx.outs.len() != 7
        {
            return Ok(None);
        }
        let (seq, b, isz) = (x.shape[0], x.shape[1], x.shape[2]);
        let dirs = w.shape[0];
        let gh = w.shape[1];
        let g = [4, 3, 1][cell as usize];
        let h = gh / g;
        let mut c = Compiled::default();
        for out in &cx.outs {
            let (shape, dtype) = out.clone().ok_or("RecurrentGrad needs its outputs typed")?;
            c.outputs.push(OutSpec { shape, dtype, view_of: None });
        }
        let dbh = dirs * b * h;
        let bias = match cx.input(3) {
            Some(_) => Buf::In(3),
            None => {
                let z = c.temp(vec![dirs, 2 * gh], DType::Float);
                c.steps.push(Step::Zero(z));
                z
            }
        };
        // Initial states and final-state gradients, each as one [2, dirs·B·H] buffer.
        let pair = |c: &mut Compiled, a: usize, bk: usize| -> Buf {
            let t = c.temp(vec![2 * dbh], DType::Float);
            c.steps.push(Step::Zero(t));
            for (slot, off) in [(a, 0), (bk, dbh)] {
                if cx.input(slot).is_some() {
                    place(c, Buf::In(slot), Elem::F32, t, [dbh, dbh, 0, off]);
                }
            }
            t
        };
        let init = pair(&mut c, 5, 6);
        let dfin = pair(&mut c, 9, 10);
        let dy = match cx.input(8) {
            Some(_) => Buf::In(8),
            None => {
                let z = c.temp(vec![seq * dbh], DType::Float);
                c.steps.push(Step::Zero(z));
                z
            }
        };
        let da = c.temp(vec![seq * dirs * b * gh], DType::Float);
        let ra = c.temp(vec![seq * dirs * b * gh], DType::Float);
        let ops = c.temp(vec![seq * dbh * 2], DType::Float);
        let dinit = c.temp(vec![2 * dbh], DType::Float);
        let tape = c.temp(vec![dirs * b * seq * (gh + 2 * h)], DType::Float);
        let scr = c.temp(vec![dirs * b * 4 * h], DType::Float);
        let direction = self.direction();
        let p = vec![
            (dirs * b) as u32,
            seq as u32,
            b as u32,
            isz as u32,
            h as u32,
            g as u32,
            dirs as u32,
            u32::from(direction == "reverse"),
            u32::from(direction == "bidirectional"),
            u32::from(self.linear_before_reset() != 0),
            cell,
        ];
        if seq * dirs * b > 0 {
            let bufs = vec![Buf::In(0), Buf::In(1), Buf::In(2), bias, init, dy, dfin, da, ra, ops, dinit, tape, scr];
            // One invocation runs the whole sequence, forward (recomputed) then backward:
            // per step, the gate rows over the input and hidden sizes and the H×H products.
            let (hh, per_step) = (h as u64, (gh * (2 + isz + h) + h * gh) as u64);
            let trips = (seq as u64).saturating_mul(per_step + 3 * hh * hh + 20 * hh + 2) + 3 * hh;
            c.launch_loop(bptt_src(), bufs, p.clone(), groups(dirs * b), trips);
            let with = |n: usize| {
                let mut q = p.clone();
                q[0] = n as u32;
                q
            };
            let (nx, nw, nr, nb) = (seq * b * isz, dirs * gh * isz, dirs * gh * h, dirs * 2 * gh);
            // Over directions and gate rows (dX), or over steps and the batch (the weights).
            let t = nested(&[dirs, gh]).max(nested(&[seq, b]));
            c.launch_loop(recurrent_weight_grad_src(0), vec![da, Buf::In(1), Buf::Out(0)], with(nx), groups(nx), t);
            c.launch_loop(recurrent_weight_grad_src(1), vec![da, Buf::In(0), Buf::Out(1)], with(nw), groups(nw), t);
            c.launch_loop(recurrent_weight_grad_src(2), vec![ra, ops, Buf::Out(2)], with(nr), groups(nr), t);
            c.launch_loop(recurrent_weight_grad_src(3), vec![da, ra, Buf::Out(3)], with(nb), groups(nb), t);
            c.steps.push(Step::Copy { src: dinit, offset: 0, dst: Buf::Out(4), n: dbh });
            c.steps.push(Step::Copy { src: dinit, offset: dbh, dst: Buf::Out(5), n: dbh });
        } else {
            for k in 0..6 {
                c.steps.push(Step::Zero(Buf::Out(k)));
            }
        }
        c.steps.push(Step::Zero(Buf::Out(6)));
        Ok(Some(c))
    }
}

/// Back-propagation through time, one invocation per (direction, sequence): the forward
/// pass recomputed into a tape, then the steps in reverse, writing the gate pre-activation
/// gradients (`DA`), the gradients that multiply the recurrent weights (`RA`), the operands
/// of the recurrent weights (`OPS`: h_prev, and r∘h_prev or R_h·h_prev + Rb_h for GRU) and
/// the initial states' gradients. Default activations, layout 0.
/// `P = [dirs·B, seq, B, in, H, gates, dirs, reverse, bidirectional, linear_before_reset,
/// cell (0 LSTM, 1 GRU, 2 RNN)]`.
pub fn bptt_src() -> String {
    let body = "    let SEQ = P[1]; let Bn = P[2]; let IN = P[3]; let H = P[4]; let G = P[5]; let DIRS = P[6];
    let LBR = P[9] == 1u; let CELL = P[10];
    let GH = G * H; let TW = GH + 2u * H;
    let d = i / Bn; let b = i % Bn;
    let rev = P[7] == 1u || (P[8] == 1u && d == 1u);
    let sb = i * 4u * H;
    let wb = d * 2u * GH; let rb = d * 2u * GH + GH;
    for (var k = 0u; k < H; k = k + 1u) {
        SCR[sb + k] = INIT[(d * Bn + b) * H + k];
        SCR[sb + H + k] = INIT[DIRS * Bn * H + (d * Bn + b) * H + k];
    }
    // Forward, recorded.
    for (var step = 0u; step < SEQ; step = step + 1u) {
        let t = select(step, SEQ - 1u - step, rev);
        let tb = (i * SEQ + step) * TW;
        let ob = ((t * DIRS + d) * Bn + b) * 2u * H;
        for (var k = 0u; k < H; k = k + 1u) { OPS[ob + k] = SCR[sb + k]; }
        for (var j = 0u; j < GH; j = j + 1u) {
            let cand = CELL == 1u && j >= 2u * H;
            var acc = BI[wb + j];
            for (var q = 0u; q < IN; q = q + 1u) { acc = acc + X[(t * Bn + b) * IN + q] * W[(d * GH + j) * IN + q]; }
            if (!cand) {
                acc = acc + BI[rb + j];
                for (var q = 0u; q < H; q = q + 1u) { acc = acc + SCR[sb + q] * R[(d * GH + j) * H + q]; }
            }
            TAPE[tb + j] = acc;
        }
        if (CELL == 0u) {
            for (var k = 0u; k < H; k = k + 1u) {
                let ig = sigmoid_(TAPE[tb + k]); let og = sigmoid_(TAPE[tb + H + k]);
                let fg = sigmoid_(TAPE[tb + 2u * H + k]); let cg = tanh_(TAPE[tb + 3u * H + k]);
                let cp = SCR[sb + H + k];
                let cn = fg * cp + ig * cg;
                TAPE[tb + k] = ig; TAPE[tb + H + k] = og; TAPE[tb + 2u * H + k] = fg; TAPE[tb + 3u * H + k] = cg;
                TAPE[tb + GH + k] = cp; TAPE[tb + GH + H + k] = cn;
                SCR[sb + k] = og * tanh_(cn);
                SCR[sb + H + k] = cn;
            }
        } else if (CELL == 1u) {
            for (var k = 0u; k < 2u * H; k = k + 1u) { TAPE[tb + k] = sigmoid_(TAPE[tb + k]); }
            if (!LBR) {
                for (var q = 0u; q < H; q = q + 1u) { OPS[ob + H + q] = TAPE[tb + H + q] * SCR[sb + q]; }
            }
            for (var k = 0u; k < H; k = k + 1u) {
                let row = (d * GH + 2u * H + k) * H;
                var pre = TAPE[tb + 2u * H + k];
                if (LBR) {
                    var ghh = BI[rb + 2u * H + k];
                    for (var q = 0u; q < H; q = q + 1u) { ghh = ghh + SCR[sb + q] * R[row + q]; }
                    OPS[ob + H + k] = ghh;
                    pre = pre + TAPE[tb + H + k] * ghh;
                } else {
                    var rec = BI[rb + 2u * H + k];
                    for (var q = 0u; q < H; q = q + 1u) { rec = rec + OPS[ob + H + q] * R[row + q]; }
                    pre = pre + rec;
                }
                TAPE[tb + 2u * H + k] = tanh_(pre);
            }
            for (var k = 0u; k < H; k = k + 1u) {
                let z = TAPE[tb + k];
                SCR[sb + 2u * H + k] = (1.0 - z) * TAPE[tb + 2u * H + k] + z * SCR[sb + k];
            }
            for (var k = 0u; k < H; k = k + 1u) { SCR[sb + k] = SCR[sb + 2u * H + k]; }
        } else {
            for (var k = 0u; k < H; k = k + 1u) {
                let hv = tanh_(TAPE[tb + k]);
                TAPE[tb + k] = hv;
                SCR[sb + k] = hv;
            }
        }
    }
    // Backward.
    for (var k = 0u; k < H; k = k + 1u) {
        SCR[sb + 2u * H + k] = DFIN[(d * Bn + b) * H + k];
        SCR[sb + 3u * H + k] = DFIN[DIRS * Bn * H + (d * Bn + b) * H + k];
    }
    for (var s = 0u; s < SEQ; s = s + 1u) {
        let step = SEQ - 1u - s;
        let t = select(step, SEQ - 1u - step, rev);
        let tb = (i * SEQ + step) * TW;
        let ob = ((t * DIRS + d) * Bn + b) * 2u * H;
        let ab = ((t * DIRS + d) * Bn + b) * GH;
        let yo = ((t * DIRS + d) * Bn + b) * H;
        for (var k = 0u; k < H; k = k + 1u) { SCR[sb + 2u * H + k] = SCR[sb + 2u * H + k] + DY[yo + k]; }
        if (CELL == 0u) {
            for (var k = 0u; k < H; k = k + 1u) {
                let ig = TAPE[tb + k]; let og = TAPE[tb + H + k]; let fg = TAPE[tb + 2u * H + k]; let cg = TAPE[tb + 3u * H + k];
                let cp = TAPE[tb + GH + k]; let cn = TAPE[tb + GH + H + k];
                let dh = SCR[sb + 2u * H + k]; let dc = SCR[sb + 3u * H + k];
                let hc = tanh_(cn);
                let dao = dh * hc * og * (1.0 - og);
                let dcn = dc + dh * og * (1.0 - hc * hc);
                DA[ab + k] = dcn * cg * ig * (1.0 - ig);
                DA[ab + H + k] = dao;
                DA[ab + 2u * H + k] = dcn * cp * fg * (1.0 - fg);
                DA[ab + 3u * H + k] = dcn * ig * (1.0 - cg * cg);
                SCR[sb + 3u * H + k] = dcn * fg;
            }
            for (var j = 0u; j < GH; j = j + 1u) { RA[ab + j] = DA[ab + j]; }
        } else if (CELL == 1u) {
            for (var k = 0u; k < H; k = k + 1u) {
                let z = TAPE[tb + k]; let r = TAPE[tb + H + k]; let ht = TAPE[tb + 2u * H + k];
                let dh = SCR[sb + 2u * H + k];
                let hp = OPS[ob + k];
                let dhh = dh * (1.0 - z) * (1.0 - ht * ht);
                DA[ab + k] = dh * (hp - ht) * z * (1.0 - z);
                DA[ab + 2u * H + k] = dhh;
                RA[ab + k] = DA[ab + k];
                if (LBR) {
                    let dr = dhh * OPS[ob + H + k];
                    DA[ab + H + k] = dr * r * (1.0 - r);
                    RA[ab + H + k] = DA[ab + H + k];
                    RA[ab + 2u * H + k] = dhh * r;
                } else {
                    RA[ab + 2u * H + k] = dhh;
                }
            }
            if (!LBR) {
                for (var q = 0u; q < H; q = q + 1u) {
                    var drh = 0.0;
                    for (var k = 0u; k < H; k = k + 1u) { drh = drh + R[(d * GH + 2u * H + k) * H + q] * DA[ab + 2u * H + k]; }
                    let r = TAPE[tb + H + q];
                    DA[ab + H + q] = drh * OPS[ob + q] * r * (1.0 - r);
                    RA[ab + H + q] = DA[ab + H + q];
                    SCR[sb + 3u * H + q] = drh;
                }
            }
        } else {
            for (var k = 0u; k < H; k = k + 1u) {
                let hv = TAPE[tb + k];
                DA[ab + k] = SCR[sb + 2u * H + k] * (1.0 - hv * hv);
                RA[ab + k] = DA[ab + k];
            }
        }
        // dh_prev = Σ_j RA_j R_j (+ the GRU's direct and reset paths).
        for (var q = 0u; q < H; q = q + 1u) {
            var acc = 0.0;
            var jmax = GH;
            if (CELL == 1u) {
                acc = SCR[sb + 2u * H + q] * TAPE[tb + q];
                if (!LBR) {
                    jmax = 2u * H;
                    acc = acc + SCR[sb + 3u * H + q] * TAPE[tb + H + q];
                }
            }
            for (var j = 0u; j < jmax; j = j + 1u) { acc = acc + RA[ab + j] * R[(d * GH + j) * H + q]; }
            SCR[sb + q] = acc;
        }
        for (var q = 0u; q < H; q = q + 1u) { SCR[sb + 2u * H + q] = SCR[sb + q]; }
    }
    for (var k = 0u; k < H; k = k + 1u) {
        DINIT[(d * Bn + b) * H + k] = SCR[sb + 2u * H + k];
        DINIT[DIRS * Bn * H + (d * Bn + b) * H + k] = select(0.0, SCR[sb + 3u * H + k], CELL == 0u);
    }";
    source(
        &[
            ("X", Elem::F32, false),
            ("W", Elem::F32, false),
            ("R", Elem::F32, false),
            ("BI", Elem::F32, false),
            ("INIT", Elem::F32, false),
            ("DY", Elem::F32, false),
            ("DFIN", Elem::F32, false),
            ("DA", Elem::F32, true),
            ("RA", Elem::F32, true),
            ("OPS", Elem::F32, true),
            ("DINIT", Elem::F32, true),
            ("TAPE", Elem::F32, true),
            ("SCR", Elem::F32, true),
        ],
        MATH_FNS,
        body,
    )
}

/// The sums over time and batch of the BPTT kernel's gradients: `which` 0: dX (`A` = DA,
/// `B` = W); 1: dW (DA, X); 2: dR (RA, OPS); 3: dB (DA, RA). `P` as [`bptt_src`]'s with the
/// output count first.
pub fn recurrent_weight_grad_src(which: u32) -> String {
    let body = match which {
        0 => "    let q = i % IN; let b = (i / IN) % Bn; let t = i / (IN * Bn);
    var acc = 0.0;
    for (var d = 0u; d < DIRS; d = d + 1u) {
        for (var j = 0u; j < GH; j = j + 1u) { acc = acc + A[((t * DIRS + d) * Bn + b) * GH + j] * B[(d * GH + j) * IN + q]; }
    }
    Y[i] = acc;",
        1 => "    let q = i % IN; let j = (i / IN) % GH; let d = i / (IN * GH);
    var acc = 0.0;
    for (var t = 0u; t < SEQ; t = t + 1u) {
        for (var b = 0u; b < Bn; b = b + 1u) { acc = acc + A[((t * DIRS + d) * Bn + b) * GH + j] * B[(t * Bn + b) * IN + q]; }
    }
    Y[i] = acc;",
        2 => "    let q = i % H; let j = (i / H) % GH; let d = i / (H * GH);
    let off = select(0u, H, P[10] == 1u && P[9] == 0u && j >= 2u * H);
    var acc = 0.0;
    for (var t = 0u; t < SEQ; t = t + 1u) {
        for (var b = 0u; b < Bn; b = b + 1u) {
            let s = (t * DIRS + d) * Bn + b;
            acc = acc + A[s * GH + j] * B[s * 2u * H + off + q];
        }
    }
    Y[i] = acc;",
        _ => "    let m = i % (2u * GH); let d = i / (2u * GH);
    let j = m % GH;
    var acc = 0.0;
    for (var t = 0u; t < SEQ; t = t + 1u) {
        for (var b = 0u; b < Bn; b = b + 1u) {
            let s = ((t * DIRS + d) * Bn + b) * GH + j;
            acc = acc + select(A[s], B[s], m >= GH);
        }
    }
    Y[i] = acc;",
    };
    let head = "    let SEQ = P[1]; let Bn = P[2]; let IN = P[3]; let H = P[4]; let G = P[5]; let DIRS = P[6];
    let GH = G * H;
";
    source(&[("A", Elem::F32, false), ("B", Elem::F32, false), ("Y", Elem::F32, true)], "", &format!("{head}{body}"))
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
        validate("bptt", &bptt_src());
        for which in 0..4 {
            validate("recurrent weight grad", &recurrent_weight_grad_src(which));
        }
    }
}
