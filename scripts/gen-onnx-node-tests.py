#!/usr/bin/env python3
"""Writes the ONNX backend node-test suite to a directory, as the onnx repository lays it out
(`NAME/model.onnx`, `NAME/test_data_set_K/{input,output}_J.pb`), plus `meta.json` with each
case's tolerances. The `onnx` wheel ships the generators (onnx/backend/test/case/node), not the
data; this runs them. Inputs or outputs that are not tensors (sequences, maps, optionals) are
not written, and meta.json says so: shardc's test counts such a case as unsupported.

usage: gen-onnx-node-tests.py OUT_DIR
"""
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")
import numpy as np  # noqa: E402
from onnx import TensorProto, numpy_helper  # noqa: E402
from onnx.backend.test.case import node as node_test  # noqa: E402


def main() -> None:
    out = sys.argv[1]
    np.seterr(all="ignore")
    cases = node_test.collect_testcases(None)
    for c in cases:
        d = os.path.join(out, c.name)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "model.onnx"), "wb") as f:
            f.write(c.model.SerializeToString())
        non_tensor = []
        for i, (ins, outs) in enumerate(c.data_sets or []):
            dd = os.path.join(d, f"test_data_set_{i}")
            os.makedirs(dd, exist_ok=True)
            for kind, values, infos in (("input", ins, c.model.graph.input), ("output", outs, c.model.graph.output)):
                for j, x in enumerate(values):
                    vi = infos[j]
                    if not vi.type.HasField("tensor_type"):
                        non_tensor.append(f"{kind} {vi.name}")
                        continue
                    p = x if isinstance(x, TensorProto) else numpy_helper.from_array(np.asarray(x), vi.name)
                    with open(os.path.join(dd, f"{kind}_{j}.pb"), "wb") as f:
                        f.write(p.SerializeToString())
        meta = {"rtol": float(c.rtol), "atol": float(c.atol), "non_tensor": sorted(set(non_tensor))}
        with open(os.path.join(d, "meta.json"), "w") as f:
            json.dump(meta, f, sort_keys=True)
    print(f"wrote {len(cases)} node tests to {out}")


if __name__ == "__main__":
    main()
