#!/usr/bin/env python3
"""Mixtral from a small config (2 layers, hidden 32, 4 heads, 2 KV heads, 8 experts of
intermediate 48, top-2; vocab 64; seeded weights, nothing downloaded) with transformers'
static-shape `batched_mm` experts, exported at input_ids 8×8 (a batch 8 devices divide: the exports bake the token count into the experts' reshapes, so it cannot be changed) twice: by torch's dynamo exporter
(mixtral_tiny_dynamo.onnx) and by the TorchScript exporter (mixtral_tiny_ts.onnx, opset 17, an
all-ones attention mask passed so that transformers does not look for packed sequences), with
torch's logits for other token ids as truth (NAME.io.json), into tests/data/moe/.
usage: gen-moe.py [OUT_DIR] (needs torch, transformers, onnx, onnxscript, numpy)."""
import json, os, sys
import numpy as np
import onnx
import torch
from transformers import MixtralConfig, MixtralForCausalLM

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "tests", "data", "moe")
os.makedirs(out_dir, exist_ok=True)
cfg = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64, num_local_experts=8, num_experts_per_tok=2,
                    attn_implementation="eager", experts_implementation="batched_mm")


class Logits(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, input_ids):
        mask = torch.ones_like(input_ids)
        return self.m(input_ids=input_ids, attention_mask=mask, use_cache=False).logits


def arr(a):
    a = np.asarray(a)
    if a.dtype == np.int64:
        return {"dtype": "int64", "shape": list(a.shape), "data": [int(x) for x in a.ravel()]}
    return {"dtype": "float32", "shape": list(a.shape), "data": [float(x) for x in a.ravel()]}


torch.manual_seed(0)
m = Logits(MixtralForCausalLM(cfg).eval())
ids = torch.randint(0, cfg.vocab_size, (8, 8))
for name, dynamo in (("mixtral_tiny_dynamo", True), ("mixtral_tiny_ts", False)):
    path = os.path.join(out_dir, name + ".onnx")
    if dynamo:
        prog = torch.onnx.export(m, (ids,), dynamo=True, input_names=["input_ids"], output_names=["logits"])
        prog.save(path)
    else:
        torch.onnx.export(m, (ids,), path, dynamo=False, opset_version=17, input_names=["input_ids"],
                          output_names=["logits"])
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (8, 8), generator=gen)
    with torch.no_grad():
        y = m(x)
    doc = {"inputs": {"input_ids": arr(x.numpy())}, "outputs": {"logits": arr(y.numpy())},
           "tolerance": {"rtol": 1e-4, "atol": 1e-4}}
    with open(os.path.join(out_dir, name + ".io.json"), "w") as f:
        json.dump(doc, f)
    model = onnx.load(path)
    print(name, os.path.getsize(path), sorted({n.op_type for n in model.graph.node}))
