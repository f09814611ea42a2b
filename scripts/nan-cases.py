#!/usr/bin/env python3
"""Single-op models over inputs holding NaN, +Inf and -Inf beside ordinary values, with their
true outputs, for the NaN/Inf property test (tests/tests/golden.rs): element-wise ops, variadic
and binary folds, reductions and pooling. The truth is onnxruntime's, except for the max and
min reductions and max pooling, where onnxruntime's vectorized kernels give an answer that
depends on where the NaN sits (ReduceMax of [NaN,1,2,3] is NaN, of [1,NaN,2,3] is 2, of
[1,2,3,NaN] 3): there NaN propagates, as in numpy and torch. Writes NAME.onnx and
NAME.io.json (the golden format; non-finite values spelled "nan", "inf", "-inf") into OUT_DIR.
usage: nan-cases.py OUT_DIR SEED (needs onnx, onnxruntime, numpy)."""
import json, os, sys
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

out_dir, seed = sys.argv[1], int(sys.argv[2])
os.makedirs(out_dir, exist_ok=True)
rng = np.random.default_rng(seed)


def spell(x):
    x = float(x)
    if np.isnan(x):
        return "nan"
    if np.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def arr(a):
    return {"dtype": "float32", "shape": list(a.shape), "data": [spell(x) for x in a.ravel()]}


def data(shape):
    """Values with NaN, +Inf and -Inf at random places (at least one of each)."""
    a = rng.standard_normal(shape).astype(np.float32) * 2
    flat = a.reshape(-1)
    k = rng.permutation(flat.size)
    flat[k[0]], flat[k[1]], flat[k[2]] = np.nan, np.inf, -np.inf
    for j in k[3:]:
        r = rng.random()
        if r < 0.08:
            flat[j] = np.nan
        elif r < 0.14:
            flat[j] = np.inf if rng.random() < 0.5 else -np.inf
    return a


unary = ["Relu", "Abs", "Neg", "Sigmoid", "Tanh", "Exp", "Log", "Sqrt", "Floor", "Ceil", "Softsign", "Erf", "Sign"]
attr_unary = [
    ("LeakyRelu", {"alpha": 0.1}),
    ("HardSigmoid", {"alpha": 0.2, "beta": 0.5}),
    ("Elu", {"alpha": 1.0}),
    ("Softmax", {"axis": -1}),
]
binary = ["Add", "Sub", "Mul", "Div", "Max", "Min", "Sum", "Mean"]
reduce = ["ReduceMax", "ReduceMin", "ReduceSum", "ReduceMean"]
pools = [
    ("MaxPool", {"kernel_shape": [2, 2], "strides": [2, 2]}),
    ("MaxPool", {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1]}),
    ("AveragePool", {"kernel_shape": [2, 2], "strides": [2, 2]}),
    ("GlobalMaxPool", {}),
    ("GlobalAveragePool", {}),
]

def propagating(op, at, x):
    """Max and min reductions and max pooling where any NaN in the window makes NaN."""
    if op == "ReduceMax":
        return np.max(x, axis=1, keepdims=True)
    if op == "ReduceMin":
        return np.min(x, axis=1, keepdims=True)
    if op == "GlobalMaxPool":
        return np.max(x, axis=(2, 3), keepdims=True)
    kh, kw = at["kernel_shape"]
    sh, sw = at["strides"]
    p = at.get("pads", [0, 0, 0, 0])
    xp = np.pad(x, ((0, 0), (0, 0), (p[0], p[2]), (p[1], p[3])), constant_values=-np.inf)
    oh, ow = (xp.shape[2] - kh) // sh + 1, (xp.shape[3] - kw) // sw + 1
    y = np.empty(x.shape[:2] + (oh, ow), dtype=np.float32)
    for i in range(oh):
        for j in range(ow):
            y[:, :, i, j] = np.max(xp[:, :, i * sh:i * sh + kh, j * sw:j * sw + kw], axis=(2, 3))
    return y


cases = []
for op in unary:
    cases.append((op, {}, 1, (3, 8), 13))
for op, at in attr_unary:
    cases.append((op, at, 1, (3, 8), 13))
for op in binary:
    cases.append((op, {}, 2, (3, 8), 13))
for op in reduce:
    cases.append((op, {"keepdims": 1}, 1, (3, 8), 18))
for k, (op, at) in enumerate(pools):
    cases.append((op, at, 1, (1, 2, 6, 6), 13))
cases.append(("Clip", {}, 1, (3, 8), 13))

for k, (op, at, arity, shape, opset) in enumerate(cases):
    ins = [f"x{i}" for i in range(arity)]
    extra = []
    inits = []
    if op == "Clip":
        inits = [helper.make_tensor("lo", TensorProto.FLOAT, [], [-1.0]), helper.make_tensor("hi", TensorProto.FLOAT, [], [1.0])]
        extra = ["lo", "hi"]
    if op.startswith("Reduce"):
        inits = [helper.make_tensor("axes", TensorProto.INT64, [1], [1])]
        extra = ["axes"]
    node = helper.make_node(op, ins + extra, ["y"], **at)
    gi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(shape)) for n in ins]
    g = helper.make_graph([node], "g", gi, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    feeds = {n: data(shape) for n in ins}
    y = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    if op in ("ReduceMax", "ReduceMin", "MaxPool", "GlobalMaxPool"):
        y = propagating(op, at, feeds["x0"])
    name = f"nan{k:02}_{op}"
    onnx.save(m, os.path.join(out_dir, name + ".onnx"))
    doc = {"inputs": {n: arr(v) for n, v in feeds.items()}, "outputs": {"y": arr(np.asarray(y))}, "tolerance": {"rtol": 1e-4, "atol": 1e-5}}
    with open(os.path.join(out_dir, name + ".io.json"), "w") as f:
        json.dump(doc, f)
print(len(cases))
