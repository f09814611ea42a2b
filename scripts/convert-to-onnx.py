#!/usr/bin/env python3
"""Converts the bundled text models to binary ONNX with the `onnx` package's own parser and
writer (`onnx.parser.parse_model`, `onnx.save`), into tests/data/onnx/: the independent truth
the binary reader is tested against (tests/tests/binary.rs).

usage: convert-to-onnx.py   (from anywhere; needs `pip install onnx`)
"""
import glob
import os

import onnx
import onnx.parser

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
out = os.path.join(root, "tests", "data", "onnx")
os.makedirs(out, exist_ok=True)
n = 0
for kind in ("models", "golden", "golden-train"):
    for path in sorted(glob.glob(os.path.join(root, "tests", "data", kind, "*.onnxtxt"))):
        model = onnx.parser.parse_model(open(path).read())
        name = os.path.basename(path).replace(".onnxtxt", ".onnx")
        onnx.save(model, os.path.join(out, name))
        n += 1
print(f"wrote {n} models to {out} with onnx {onnx.__version__}")
