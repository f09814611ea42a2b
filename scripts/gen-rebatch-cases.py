#!/usr/bin/env python3
"""Real architectures exported by torch.onnx at a fixed batch, for rebatching tests: each
NAME.onnx is exported at batch EXPORT (no dynamic axes: the batch is baked into Reshape,
Expand, Range and Split constants, as default exports do), and NAME.io.json holds inputs at
batch RUN with torch's own outputs at that batch (the independent truth a rebatched model must
reproduce). Into tests/data/rebatch/. usage: gen-rebatch-cases.py (needs torch, torchvision,
onnx)."""
import json, os, warnings
import torch, torch.nn as nn, torch.nn.functional as F
import torchvision
warnings.filterwarnings("ignore")
out_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data", "rebatch")
os.makedirs(out_dir, exist_ok=True)
torch.manual_seed(0)


class MoE(nn.Module):
    """A Mixtral-style sparse MoE block over flattened tokens: router, softmax, top-2,
    renormalized weights, experts (SwiGLU MLPs) gathered per token by advanced indexing
    (GatherND over `arange(tokens)`), and the tokens split into two fixed halves for a shared
    expert (Split along the batch-carrying axis)."""

    def __init__(self, d=16, hidden=24, experts=4, k=2):
        super().__init__()
        self.k = k
        self.router = nn.Linear(d, experts, bias=False)
        self.w1 = nn.ModuleList([nn.Linear(d, hidden, bias=False) for _ in range(experts)])
        self.w3 = nn.ModuleList([nn.Linear(d, hidden, bias=False) for _ in range(experts)])
        self.w2 = nn.ModuleList([nn.Linear(hidden, d, bias=False) for _ in range(experts)])
        self.shared = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        b, s, d = x.shape
        t = self.norm(x).reshape(-1, d)
        n = t.shape[0]
        probs = F.softmax(self.router(t), dim=-1)
        w, idx = torch.topk(probs, self.k, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        outs = torch.stack([w2(F.silu(w1(t)) * w3(t)) for w1, w2, w3 in zip(self.w1, self.w2, self.w3)], dim=1)
        rows = torch.arange(n).unsqueeze(1).expand(n, self.k)
        picked = outs[rows, idx]
        y = (picked * w.unsqueeze(-1)).sum(dim=1)
        first, second = t.split([n // 2, n - n // 2], dim=0)
        y = y + torch.cat([self.shared(first), self.shared(second)], dim=0)
        return x + y.reshape(b, s, d)


def vit():
    return torchvision.models.VisionTransformer(
        image_size=16, patch_size=8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32, num_classes=5
    )


def swin():
    from torchvision.models.swin_transformer import SwinTransformer

    return SwinTransformer(
        patch_size=[2, 2], embed_dim=8, depths=[2, 1], num_heads=[1, 2], window_size=[2, 2], num_classes=5
    )


class SeqTransformer(nn.Module):
    """torch.nn's encoder and decoder layers (batch_first inputs; inside, multi-head attention
    works sequence-first: `[S·B, E]` rows and `[S, B·H, D]` heads, as pt_nn_transformer)."""

    def __init__(self, d=16):
        super().__init__()
        self.enc = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True)
        self.dec = nn.TransformerDecoderLayer(d, 2, 32, dropout=0.0, batch_first=True)

    def forward(self, src, tgt):
        return self.dec(tgt, self.enc(src))


CASES = [
    # name, model, input shapes at batch 1 (the batch is dim 0 of each), batch to run
    ("vit_tiny", vit, [(3, 16, 16)], 3),
    ("swin_tiny", swin, [(3, 8, 8)], 3),
    ("moe_tiny", lambda: MoE(), [(6, 16)], 3),
    ("seq_transformer_tiny", SeqTransformer, [(6, 16), (5, 16)], 3),
]


def arr(t):
    return {"dtype": "float32", "shape": list(t.shape), "data": [float(v) for v in t.detach().reshape(-1)]}


for name, make, shapes, run_batch in CASES:
    m = make().eval()
    export = tuple(torch.randn(1, *s) for s in shapes)
    names = [f"x{k}" for k in range(len(shapes))]
    path = os.path.join(out_dir, name + ".onnx")
    torch.onnx.export(m, export, path, input_names=names, output_names=["y"], opset_version=17, dynamo=False)
    inputs = tuple(torch.randn(run_batch, *s) for s in shapes)
    with torch.no_grad():
        y = m(*inputs)
    doc = {
        "inputs": {n: arr(t) for n, t in zip(names, inputs)},
        "outputs": {"y": arr(y)},
        "tolerance": {"rtol": 1e-4, "atol": 1e-5},
    }
    json.dump(doc, open(os.path.join(out_dir, name + ".io.json"), "w"))
    print(name, os.path.getsize(path), "bytes")
