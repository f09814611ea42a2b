#!/usr/bin/env python3
"""Random GRU configurations with their true outputs, for the GRU property test
(tests/tests/golden.rs): direction, linear_before_reset, bias, initial_h, sequence_lens, layout
and sizes drawn from SEED; truth from onnxruntime (layout 0; it runs no other) checked against
onnx's reference implementation (which ignores sequence_lens), the truth for layout 1. Writes NAME.onnx and
NAME.io.json (the golden format) into OUT_DIR.
usage: gru-property.py OUT_DIR COUNT SEED (needs onnx, onnxruntime, numpy)."""
import json, os, sys
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

out_dir, count, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.makedirs(out_dir, exist_ok=True)
rng = np.random.default_rng(seed)


def arr(a):
    if a.dtype == np.int32:
        return {"dtype": "int32", "shape": list(a.shape), "data": [int(x) for x in a.ravel()]}
    return {"dtype": "float32", "shape": list(a.shape), "data": [float(x) for x in a.ravel()]}


for k in range(count):
    direction = ["forward", "reverse", "bidirectional"][rng.integers(3)]
    lbr, bias, init, lens, layout = (int(x) for x in rng.integers(2, size=5))
    # onnx's reference ignores sequence_lens, and onnxruntime runs layout 0 only: for layout 1
    # no implementation is the truth of shorter sequences.
    lens = int(lens and layout == 0)
    D = 2 if direction == "bidirectional" else 1
    S, B, I, H = (int(x) for x in (rng.integers(1, 7), rng.integers(1, 5), rng.integers(1, 8), rng.integers(1, 9)))
    X = rng.standard_normal((S, B, I) if layout == 0 else (B, S, I)).astype(np.float32)
    W = (rng.standard_normal((D, 3 * H, I)) * 0.5).astype(np.float32)
    R = (rng.standard_normal((D, 3 * H, H)) * 0.5).astype(np.float32)
    Bb = (rng.standard_normal((D, 6 * H)) * 0.5).astype(np.float32)
    H0 = rng.standard_normal((D, B, H) if layout == 0 else (B, D, H)).astype(np.float32)
    L = rng.integers(1, S + 1, size=B).astype(np.int32)
    ins = ["X", "W", "R", "B" if bias else "", "L" if lens else "", "H0" if init else ""]
    while ins[-1] == "":
        ins.pop()
    node = helper.make_node(
        "GRU", ins, ["Y", "Yh"], hidden_size=H, direction=direction, linear_before_reset=lbr, layout=layout
    )
    inits = [numpy_helper.from_array(W, "W"), numpy_helper.from_array(R, "R")]
    if bias:
        inits.append(numpy_helper.from_array(Bb, "B"))
    gi = [helper.make_tensor_value_info("X", TensorProto.FLOAT, list(X.shape))]
    feeds = {"X": X}
    if lens:
        gi.append(helper.make_tensor_value_info("L", TensorProto.INT32, [B]))
        feeds["L"] = L
    if init:
        gi.append(helper.make_tensor_value_info("H0", TensorProto.FLOAT, list(H0.shape)))
        feeds["H0"] = H0
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("Y", "Yh")]
    g = helper.make_graph([node], "gru", gi, outs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)])
    m.ir_version = 8
    name = f"gru{k:03}_{direction}_lbr{lbr}_b{bias}_h{init}_l{lens}_layout{layout}_s{S}b{B}i{I}h{H}"
    truth = ReferenceEvaluator(m).run(None, feeds)
    if layout == 0:
        got = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
        # onnxruntime is the truth; the reference must agree where it reads all inputs.
        for a, b in zip(got, truth):
            if not lens and not np.allclose(a, b, rtol=1e-4, atol=1e-5):
                sys.exit(f"{name}: onnxruntime and onnx's reference differ")
        truth = got
    onnx.save(m, os.path.join(out_dir, name + ".onnx"))
    doc = {
        "inputs": {k: arr(v) for k, v in feeds.items()},
        "outputs": {"Y": arr(np.asarray(truth[0])), "Yh": arr(np.asarray(truth[1]))},
        "tolerance": {"rtol": 1e-4, "atol": 1e-5},
    }
    with open(os.path.join(out_dir, name + ".io.json"), "w") as f:
        json.dump(doc, f)
print(count)
