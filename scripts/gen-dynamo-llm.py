#!/usr/bin/env python3
"""Llama and Qwen2 from small configs (seeded weights, no downloads), exported with torch's
default (dynamo) exporter at input_ids 2×16 — which folds the causal mask and the rotary
tables into initializers, kept as external data — with torch's logits at other sequence
lengths as truth, into tests/data/dynamo/ (NAME.onnx, NAME.data, NAME.sSEQ.io.json).
usage: gen-dynamo-llm.py [OUT_DIR] (needs torch, transformers, onnx, onnxscript, numpy)."""
import json, os, sys
import numpy as np
import onnx
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "tests", "data", "dynamo")
os.makedirs(out_dir, exist_ok=True)
small = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager")
models = {
    "llama_tiny": (LlamaForCausalLM, LlamaConfig(**small)),
    "qwen2_tiny": (Qwen2ForCausalLM, Qwen2Config(**small)),
}


class Logits(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, input_ids):
        return self.m(input_ids=input_ids, use_cache=False).logits


def arr(a):
    a = np.asarray(a)
    if a.dtype == np.int64:
        return {"dtype": "int64", "shape": list(a.shape), "data": [int(x) for x in a.ravel()]}
    return {"dtype": "float32", "shape": list(a.shape), "data": [float(x) for x in a.ravel()]}


for name, (cls, cfg) in models.items():
    torch.manual_seed(0)
    m = Logits(cls(cfg).eval())
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    path = os.path.join(out_dir, name + ".onnx")
    prog = torch.onnx.export(m, (ids,), dynamo=True, input_names=["input_ids"], output_names=["logits"])
    prog.save(path, external_data=True)
    # The external data file is NAME.onnx.data; the model names it.
    gen = torch.Generator().manual_seed(1)
    for seq in (8, 16, 24):
        x = torch.randint(0, cfg.vocab_size, (2, seq), generator=gen)
        with torch.no_grad():
            y = m(x)
        doc = {"inputs": {"input_ids": arr(x.numpy())}, "outputs": {"logits": arr(y.numpy())},
               "tolerance": {"rtol": 1e-4, "atol": 1e-4}}
        with open(os.path.join(out_dir, f"{name}.s{seq}.io.json"), "w") as f:
            json.dump(doc, f)
    print(name, os.path.getsize(path), [i.name for i in onnx.load(path, load_external_data=False).graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL][:6])
