#!/usr/bin/env python3
"""More golden training-step cases, in the format of ../shared/golden-train (its README has
the format and the optimizer formulas), for architectures that folder does not have: group and
instance normalization, nearest and bilinear upsampling (a small U-Net), sub-pixel
convolution (PixelShuffle / PixelUnshuffle), einsum contractions, reflect/edge padding, 1-D
convolutions with batch normalization and ceil-mode average pooling, transposed
convolution with PReLU/ELU/Softplus and hand-written Huber/L1 losses, and four blocks of current
architectures: a LLaMA-style decoder (RMSNorm, rotary embeddings and an additive causal mask as
buffers, grouped-query attention, a SiLU-gated MLP), a pre-norm ViT encoder with a class token, a
ConvNeXt block (depthwise 7x7, channels-last LayerNorm, GELU, layer scale) and an EfficientNet
MBConv (SiLU, squeeze-and-excitation, batch normalization). Buffers (the rotary tables, the
mask) are float initializers that are not in `trainable`. Each torch module ends in its loss; it is exported
with torch.onnx.export(dynamo=False, opset_version=17, do_constant_folding=False,
training=TRAINING), printed with onnx.printer, and its loss, gradients, one momentum-SGD and one
Adam step and 10-step loss trajectories computed by torch (float32, CPU, one thread). The
tolerance is the tightest of the README's list that the same training in float64 stays within a
tenth of; onnxruntime's loss on the printed model is checked against torch's.

usage: gen-golden-train.py [OUT_DIR [CASE...]]   (only the cases named, when some are; needs torch, onnx, onnxruntime, numpy; not needed to build
or test shardc: the cases it wrote are in tests/data/golden-train-more)
"""
import copy, json, os, sys

import numpy as np
import onnx
import onnxruntime as ort
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.set_num_threads(1)
out_dir = sys.argv[1] if len(sys.argv) > 1 else "tests/data/golden-train-more"
only = set(sys.argv[2:])
os.makedirs(out_dir, exist_ok=True)
TOLS = [(1e-4, 1e-5), (1e-3, 1e-5), (1e-3, 1e-4), (1e-2, 1e-4), (1e-2, 1e-3)]


class GroupNormCnn(nn.Module):
    """Conv 3x3 (3->8) + GroupNorm(4 groups) + ReLU, Conv 3x3 stride 2 (8->8) + InstanceNorm2d
    (affine) + ReLU, GlobalAveragePool, Linear(8->5), cross-entropy."""

    def __init__(self):
        super().__init__()
        # No conv biases: a per-channel bias before instance normalization cancels (its exact
        # gradient is 0, a float32 one noise that Adam would turn into a step), and before group
        # normalization its mean per group does.
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.gn = nn.GroupNorm(4, 8)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False)
        self.inorm = nn.InstanceNorm2d(8, affine=True)
        self.fc = nn.Linear(8, 5)

    def forward(self, x, labels):
        h = F.relu(self.gn(self.conv1(x)))
        h = F.relu(self.inorm(self.conv2(h)))
        h = F.adaptive_avg_pool2d(h, 1).flatten(1)
        return F.cross_entropy(self.fc(h), labels)


class TinyUnet(nn.Module):
    """Encoder Conv+ReLU, MaxPool, Conv+ReLU; decoder: nearest x2 upsample concatenated with the
    skip, plus a bilinear x2 upsample (align_corners=False) added, Conv 1x1 to 3 channels; MSE
    against a target image."""

    def __init__(self):
        super().__init__()
        self.enc1 = nn.Conv2d(3, 6, 3, padding=1)
        self.enc2 = nn.Conv2d(6, 6, 3, padding=1)
        self.dec = nn.Conv2d(12, 3, 1)
        self.side = nn.Conv2d(6, 3, 1)

    def forward(self, x, target):
        e1 = F.relu(self.enc1(x))
        e2 = F.relu(self.enc2(F.max_pool2d(e1, 2)))
        up = F.interpolate(e2, scale_factor=2, mode="nearest")
        y = self.dec(torch.cat([up, e1], 1))
        y = y + F.interpolate(self.side(e2), scale_factor=2, mode="bilinear", align_corners=False)
        return F.mse_loss(y, target)


class SubPixel(nn.Module):
    """PixelUnshuffle(2), Conv 3x3 (12->12) + Tanh, Conv 3x3 (12->12), PixelShuffle(2) back to the
    image size, residual; MSE against a target image."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(12, 12, 3, padding=1)
        self.c2 = nn.Conv2d(12, 12, 3, padding=1)

    def forward(self, x, target):
        h = F.pixel_unshuffle(x, 2)
        h = self.c2(torch.tanh(self.c1(h)))
        return F.mse_loss(F.pixel_shuffle(h, 2) + x, target)


class EinsumAttention(nn.Module):
    """Single-head attention written with torch.einsum (exported as Einsum): Q/K/V Linear (d 8,
    K without bias), scores 'bqd,bkd->bqk' scaled, Softmax, 'bqk,bkd->bqd', output Linear,
    residual, a batched bilinear read-out 'bsd,de,bse->bs' summed to a score per class by a
    Linear(6->4) over the sequence; cross-entropy."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.k = nn.Linear(8, 8, bias=False)
        self.v = nn.Linear(8, 8)
        self.o = nn.Linear(8, 8)
        self.bil = nn.Parameter(torch.randn(8, 8) * 0.3)
        self.head = nn.Linear(6, 4)

    def forward(self, x, labels):
        q, k, v = self.q(x), self.k(x), self.v(x)
        a = torch.softmax(torch.einsum("bqd,bkd->bqk", q, k) / 8**0.5, dim=-1)
        h = x + self.o(torch.einsum("bqk,bkd->bqd", a, v))
        r = torch.einsum("bsd,de,bse->bs", h, self.bil, h)
        return F.cross_entropy(self.head(r), labels)


class PaddedCnn(nn.Module):
    """ReflectionPad2d(1) + Conv 3x3 (3->6) + ReLU, ReplicationPad2d((1, 2, 0, 1)) + Conv 3x3
    (6->6), GlobalAveragePool, Linear(6->5), cross-entropy."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 6, 3)
        self.c2 = nn.Conv2d(6, 6, 3)
        self.fc = nn.Linear(6, 5)

    def forward(self, x, labels):
        h = F.relu(self.c1(F.pad(x, (1, 1, 1, 1), mode="reflect")))
        h = self.c2(F.pad(h, (1, 2, 0, 1), mode="replicate"))
        return F.cross_entropy(self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1)), labels)


class Conv1dNet(nn.Module):
    """Conv1d dilated (no bias) + BatchNorm1d + LeakyReLU, AvgPool1d (ceil_mode,
    count_include_pad=False), grouped Conv1d + Hardswish, mean over time, Linear; BCE with logits."""

    def __init__(self):
        super().__init__()
        self.c = nn.Conv1d(3, 6, 3, padding=2, dilation=2, bias=False)
        self.bn = nn.BatchNorm1d(6)
        self.c2 = nn.Conv1d(6, 6, 3, groups=3)
        self.fc = nn.Linear(6, 2)

    def forward(self, x, y):
        h = F.avg_pool1d(F.leaky_relu(self.bn(self.c(x)), 0.1), 3, ceil_mode=True, count_include_pad=False)
        h = F.hardswish(self.c2(h)).mean(-1)
        return F.binary_cross_entropy_with_logits(self.fc(h), y)


class Deconv(nn.Module):
    """Conv stride 2 + PReLU, ConvTranspose2d (stride 2, output_padding 1) + ELU, plus SiLU(x)·Softplus(x);
    a Huber loss written with Where, plus a tenth of an L1 loss of its Tanh."""

    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(2, 4, 3, stride=2, padding=1)
        self.d = nn.ConvTranspose2d(4, 2, 3, stride=2, padding=1, output_padding=1)
        self.p = nn.PReLU(4)

    def forward(self, x, y):
        h = F.elu(self.d(self.p(self.c(x)))) + F.silu(x) * F.softplus(x)
        d = h - y
        huber = torch.where(d.abs() < 1, 0.5 * d * d, d.abs() - 0.5).mean()
        return huber + 0.1 * (torch.tanh(h) - y).abs().mean()


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.2 * torch.randn(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class RopeLlama(nn.Module):
    """LLaMA-style decoder layer: Embedding(32, 16), RMSNorm, Q (4 heads of 4) and K/V (2 heads,
    repeated to 4: grouped-query attention) without biases, rotary embeddings from cos/sin
    buffers (rotate-half), scores plus an additive causal mask buffer (-inf above the diagonal),
    Softmax, output projection, residual; RMSNorm, SiLU-gated MLP (16->32->16), residual; RMSNorm,
    LM head; cross-entropy over the tokens."""

    def __init__(self, vocab=32, d=16, heads=4, kv_heads=2, seq=6):
        super().__init__()
        self.h, self.kv, self.hd = heads, kv_heads, d // heads
        self.emb = nn.Embedding(vocab, d)
        self.n1, self.n2, self.n3 = RMSNorm(d), RMSNorm(d), RMSNorm(d)
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.v = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.gate = nn.Linear(d, 2 * d, bias=False)
        self.up = nn.Linear(d, 2 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)
        self.lm = nn.Linear(d, vocab, bias=False)
        inv = 1.0 / (10000 ** (torch.arange(0, self.hd, 2).float() / self.hd))
        f = torch.outer(torch.arange(seq).float(), inv)
        e = torch.cat([f, f], -1)
        self.register_buffer("cos", e.cos())
        self.register_buffer("sin", e.sin())
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), 1))

    def rope(self, x):
        half = x.shape[-1] // 2
        return x * self.cos + torch.cat([-x[..., half:], x[..., :half]], -1) * self.sin

    def forward(self, ids, labels):
        b, t = ids.shape
        x = self.emb(ids)
        y = self.n1(x)
        q = self.rope(self.q(y).view(b, t, self.h, self.hd).transpose(1, 2))
        k = self.rope(self.k(y).view(b, t, self.kv, self.hd).transpose(1, 2))
        v = self.v(y).view(b, t, self.kv, self.hd).transpose(1, 2)
        k = k.repeat_interleave(self.h // self.kv, 1)
        v = v.repeat_interleave(self.h // self.kv, 1)
        a = torch.softmax(q @ k.transpose(-1, -2) / self.hd**0.5 + self.mask, -1) @ v
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        y = self.n2(x)
        x = x + self.down(F.silu(self.gate(y)) * self.up(y))
        logits = self.lm(self.n3(x))
        return F.cross_entropy(logits.reshape(b * t, -1), labels.reshape(-1))


class MixtralMoe(nn.Module):
    """Mixtral's sparse mixture of experts, transformers' own `MixtralSparseMoeBlock` with its
    `batched_mm` experts (the static-shape form its ONNX export uses): Embedding(32, 16), RMSNorm,
    a router Linear(16->8) + Softmax + top-2 renormalised, 8 SiLU-gated experts (16->24->16,
    gate and up fused in one [8, 48, 16] weight, down [8, 16, 24]) gathered by the chosen
    experts' ids and weighted by their router probabilities, residual; RMSNorm, LM head;
    cross-entropy over the tokens."""

    def __init__(self, vocab=32, d=16):
        super().__init__()
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        cfg = MixtralConfig(hidden_size=d, intermediate_size=24, num_local_experts=8, num_experts_per_tok=2,
                            experts_implementation="batched_mm")
        self.emb = nn.Embedding(vocab, d)
        self.n1, self.n2 = RMSNorm(d), RMSNorm(d)
        self.moe = MixtralSparseMoeBlock(cfg)
        with torch.no_grad():
            for p in self.moe.parameters():
                p.copy_(0.3 * torch.randn_like(p))
        self.lm = nn.Linear(d, vocab, bias=False)

    def forward(self, ids, labels):
        b, t = ids.shape
        x = self.emb(ids)
        x = x + self.moe(self.n1(x))
        logits = self.lm(self.n2(x))
        return F.cross_entropy(logits.reshape(b * t, -1), labels.reshape(-1))


class MixtralAuxLoss(nn.Module):
    """transformers' whole `MixtralForCausalLM` from a small config (1 layer, hidden 16, 2 heads
    over 1 key/value head, 4 SiLU-gated experts of 24, top-2, vocabulary 32, `batched_mm`
    experts), its loss as the model computes it with labels: the shifted cross-entropy plus
    0.02 × the router's load-balancing auxiliary loss (`output_router_logits`)."""

    def __init__(self):
        super().__init__()
        from transformers import MixtralConfig, MixtralForCausalLM

        cfg = MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                            num_local_experts=4, num_experts_per_tok=2, attn_implementation="eager",
                            experts_implementation="batched_mm", output_router_logits=True,
                            router_aux_loss_coef=0.02)
        self.m = MixtralForCausalLM(cfg)
        with torch.no_grad():
            for p in self.m.parameters():
                if p.dim() > 1:
                    p.copy_(0.3 * torch.randn_like(p))

    def forward(self, ids, labels):
        return self.m(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels, use_cache=False).loss


class TinyVit(nn.Module):
    """ViT: Conv 4x4 stride 4 patch embedding (3->16) of an 8x8 image (4 patches), a class token
    concatenated in front, learned position embeddings added; one pre-norm TransformerEncoderLayer
    (d 16, 2 heads, feed-forward 32, GELU, no biases: a key bias's exact gradient is 0, a float32
    one noise that Adam would turn into a step); LayerNorm, Linear head on the class token;
    cross-entropy."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(3, 16, 4, 4)
        self.cls = nn.Parameter(0.3 * torch.randn(1, 1, 16))
        self.pos = nn.Parameter(0.3 * torch.randn(1, 5, 16))
        self.enc = nn.TransformerEncoderLayer(
            16, 2, 32, dropout=0.0, activation="gelu", batch_first=True, norm_first=True, bias=False
        )
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 5)

    def forward(self, x, labels):
        h = self.patch(x).flatten(2).transpose(1, 2)
        # The class token broadcast over the batch from a slice of the batch itself (the
        # tracer writes `expand(h.shape[0], ...)` with the batch as a constant).
        h = torch.cat([torch.zeros_like(h[:, :1]) + self.cls, h], 1) + self.pos
        h = self.enc(h)
        return F.cross_entropy(self.head(self.norm(h[:, 0])), labels)


class ConvNextBlock(nn.Module):
    """ConvNeXt: Conv 2x2 stride 2 stem (3->8) and a LayerNorm over channels (permuted to
    channels-last and back); one block: depthwise Conv 7x7 (pad 3, 8 groups), channels-last
    LayerNorm, Linear 8->32, GELU, Linear 32->8, layer scale (a trainable per-channel factor),
    residual; mean over the pixels, Linear(8->5); cross-entropy."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 2, 2)
        self.stem_norm = nn.LayerNorm(8)
        self.dw = nn.Conv2d(8, 8, 7, padding=3, groups=8)
        self.norm = nn.LayerNorm(8)
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 8)
        self.gamma = nn.Parameter(0.5 + 0.1 * torch.randn(8))
        self.head = nn.Linear(8, 5)

    def forward(self, x, labels):
        h = self.stem_norm(self.stem(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        y = self.norm(self.dw(h).permute(0, 2, 3, 1))
        y = self.fc2(F.gelu(self.fc1(y))) * self.gamma
        h = h + y.permute(0, 3, 1, 2)
        return F.cross_entropy(self.head(h.mean((2, 3))), labels)


class MbConvSe(nn.Module):
    """EfficientNet: Conv 3x3 stride 2 stem (3->8, no bias) + BatchNorm + SiLU; an MBConv block
    with expansion 4: Conv 1x1 (8->32, no bias) + BatchNorm + SiLU, depthwise Conv 3x3 (no bias)
    + BatchNorm + SiLU, squeeze-and-excitation (global average pool, Conv 1x1 32->8 + SiLU, Conv
    1x1 8->32, Sigmoid, scale), Conv 1x1 (32->8, no bias) + BatchNorm, residual; Conv 1x1 head
    (8->16) + SiLU, global average pool, Linear(16->5); cross-entropy. Batch normalization in
    training mode."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.SiLU())
        self.expand = nn.Sequential(nn.Conv2d(8, 32, 1, bias=False), nn.BatchNorm2d(32), nn.SiLU())
        self.dw = nn.Sequential(nn.Conv2d(32, 32, 3, 1, 1, groups=32, bias=False), nn.BatchNorm2d(32), nn.SiLU())
        self.se1 = nn.Conv2d(32, 8, 1)
        self.se2 = nn.Conv2d(8, 32, 1)
        self.project = nn.Sequential(nn.Conv2d(32, 8, 1, bias=False), nn.BatchNorm2d(8))
        self.head = nn.Conv2d(8, 16, 1)
        self.fc = nn.Linear(16, 5)

    def forward(self, x, labels):
        h = self.stem(x)
        y = self.dw(self.expand(h))
        y = y * torch.sigmoid(self.se2(F.silu(self.se1(F.adaptive_avg_pool2d(y, 1)))))
        h = h + self.project(y)
        h = F.silu(self.head(h))
        return F.cross_entropy(self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1)), labels)


def cases():
    g = torch.Generator().manual_seed(0)
    yield (
        "groupnorm_cnn",
        GroupNormCnn,
        {"x": torch.randn(4, 3, 8, 8, generator=g), "labels": torch.randint(0, 5, (4,), generator=g)},
        (0.1, 0.01),
        "CNN with normalization per group and per instance: Conv 3x3 (3->8, pad 1, no bias) + GroupNorm(4 groups, 8 channels) + ReLU, Conv 3x3 stride 2 (8->8, no bias) + InstanceNorm2d(8, affine) + ReLU, GlobalAveragePool, Linear(8->5), cross-entropy. x [4,3,8,8], labels [4]",
    )
    yield (
        "tiny_unet",
        TinyUnet,
        {"x": torch.randn(2, 3, 8, 8, generator=g), "target": torch.randn(2, 3, 8, 8, generator=g)},
        (0.05, 0.01),
        "U-Net: Conv 3x3 (3->6)+ReLU, MaxPool 2, Conv 3x3 (6->6)+ReLU, nearest x2 Resize concatenated with the skip, Conv 1x1 (12->3), plus a bilinear x2 Resize (half-pixel) of a Conv 1x1 (6->3) side branch; MSE against a target image. x, target [2,3,8,8]",
    )
    yield (
        "subpixel",
        SubPixel,
        {"x": torch.randn(2, 3, 8, 8, generator=g), "target": torch.randn(2, 3, 8, 8, generator=g)},
        (0.05, 0.01),
        "Sub-pixel convolution: PixelUnshuffle(2), Conv 3x3 (12->12)+Tanh, Conv 3x3 (12->12), PixelShuffle(2), residual; MSE against a target image. x, target [2,3,8,8]",
    )


    yield (
        "einsum_attention",
        EinsumAttention,
        {"x": torch.randn(4, 6, 8, generator=g), "labels": torch.randint(0, 4, (4,), generator=g)},
        (0.05, 0.01),
        "Attention written with einsum (exported as Einsum): Q/K/V Linear (d 8, K without bias), scores bqd,bkd->bqk scaled by 1/sqrt(8), Softmax, bqk,bkd->bqd, output Linear, residual; a bilinear read-out bsd,de,bse->bs with a trainable [8,8] matrix, Linear(6->4) over the sequence, cross-entropy. x [4,6,8], labels [4]",
    )
    yield (
        "padded_cnn",
        PaddedCnn,
        {"x": torch.randn(2, 3, 6, 6, generator=g), "labels": torch.randint(0, 5, (2,), generator=g)},
        (0.1, 0.01),
        "CNN with reflect and edge padding (Pad modes reflect and edge): ReflectionPad2d(1) + Conv 3x3 (3->6) + ReLU, ReplicationPad2d((1,2,0,1)) + Conv 3x3 (6->6), GlobalAveragePool, Linear(6->5), cross-entropy. x [2,3,6,6], labels [2]",
    )

    g = torch.Generator().manual_seed(3)
    yield (
        "conv1d_bce",
        Conv1dNet,
        {"x": torch.randn(4, 3, 10, generator=g), "y": torch.rand(4, 2, generator=g)},
        (0.1, 0.01),
        "Conv1d (3->6, k 3, dilation 2, no bias) + BatchNorm1d (training) + LeakyReLU(0.1), AvgPool1d(3, ceil_mode, count_include_pad=False), grouped Conv1d (6->6, 3 groups) + Hardswish, mean over time, Linear(6->2), BCE with logits against a float target. x [4,3,10], y [4,2]",
    )
    yield (
        "deconv_losses",
        Deconv,
        {"x": torch.randn(2, 2, 6, 6, generator=g), "y": torch.randn(2, 2, 6, 6, generator=g)},
        (0.05, 0.01),
        "Conv 3x3 stride 2 (2->4) + PReLU(4), ConvTranspose2d (4->2, stride 2, output_padding 1) + ELU, plus SiLU(x)*Softplus(x); Huber loss written with Where plus 0.1 x L1 of Tanh. x, y [2,2,6,6]",
    )

    g = torch.Generator().manual_seed(5)
    yield (
        "rope_llama",
        RopeLlama,
        {"ids": torch.randint(0, 32, (2, 6), generator=g), "labels": torch.randint(0, 32, (2, 6), generator=g)},
        (0.1, 0.01),
        "LLaMA-style decoder layer: Embedding(32,16), RMSNorm, Q (4 heads) and K/V (2 heads repeated: grouped-query) without biases, rotary embeddings from cos/sin buffers, additive causal mask buffer (-inf), Softmax, output projection, residual; RMSNorm, SiLU-gated MLP 16->32->16, residual; RMSNorm, LM head; cross-entropy over tokens. The buffers cos, sin and mask are float initializers that are not trainable. ids, labels [2,6]",
    )
    yield (
        "mixtral_moe",
        MixtralMoe,
        {"ids": torch.randint(0, 32, (2, 6), generator=g), "labels": torch.randint(0, 32, (2, 6), generator=g)},
        (0.1, 0.01),
        "Mixtral sparse mixture of experts (transformers' MixtralSparseMoeBlock, batched_mm experts): Embedding(32,16), RMSNorm, router Linear(16->8) + Softmax + top-2 renormalised, 8 SiLU-gated experts 16->24->16 (gate_up [8,48,16] and down [8,16,24] gathered by the chosen experts' ids), weighted by the router's probabilities and summed, residual; RMSNorm, LM head; cross-entropy over tokens. ids, labels [2,6]",
    )
    yield (
        "mixtral_aux_loss",
        MixtralAuxLoss,
        {"ids": torch.randint(0, 32, (2, 6), generator=g), "labels": torch.randint(0, 32, (2, 6), generator=g)},
        (0.1, 0.01),
        "transformers' MixtralForCausalLM (1 layer, hidden 16, 2 heads over 1 KV head, 4 SiLU-gated experts of 24, top-2, vocabulary 32, batched_mm experts) with labels: the shifted cross-entropy plus 0.02 x the router's load-balancing auxiliary loss (output_router_logits). ids, labels [2,6]",
    )
    yield (
        "tiny_vit",
        TinyVit,
        {"x": torch.randn(2, 3, 8, 8, generator=g), "labels": torch.randint(0, 5, (2,), generator=g)},
        (0.05, 0.01),
        "ViT: Conv 4x4 stride 4 patch embedding (3->16), class token concatenated, position embeddings added, one pre-norm TransformerEncoderLayer (d 16, 2 heads, feed-forward 32, GELU, no biases), LayerNorm, Linear head on the class token; cross-entropy. x [2,3,8,8], labels [2]",
    )
    yield (
        "convnext_block",
        ConvNextBlock,
        {"x": torch.randn(2, 3, 8, 8, generator=g), "labels": torch.randint(0, 5, (2,), generator=g)},
        (0.05, 0.01),
        "ConvNeXt: Conv 2x2 stride 2 stem (3->8) + channels-last LayerNorm; block: depthwise Conv 7x7, channels-last LayerNorm, Linear 8->32, GELU, Linear 32->8, layer scale, residual; mean pool, Linear(8->5); cross-entropy. x [2,3,8,8], labels [2]",
    )
    yield (
        "mbconv_se",
        MbConvSe,
        {"x": torch.randn(4, 3, 8, 8, generator=g), "labels": torch.randint(0, 5, (4,), generator=g)},
        (0.05, 0.01),
        "EfficientNet MBConv: Conv 3x3 stride 2 stem (no bias) + BatchNorm + SiLU; expansion Conv 1x1 8->32 + BatchNorm + SiLU, depthwise Conv 3x3 + BatchNorm + SiLU, squeeze-and-excitation (pool, Conv 1x1 32->8, SiLU, Conv 1x1 8->32, Sigmoid, scale), projection Conv 1x1 32->8 + BatchNorm, residual; Conv 1x1 head 8->16 + SiLU, pool, Linear(16->5); cross-entropy; BatchNorm in training mode. x [4,3,8,8], labels [4]",
    )


def tensor_json(t):
    a = t.detach().cpu().numpy()
    if a.dtype == np.float32 or a.dtype == np.float64:
        data = [float(np.float32(v)) for v in a.astype(np.float32).ravel()]
        return {"dtype": "float32", "shape": list(a.shape), "data": data}
    return {"dtype": "int64", "shape": list(a.shape), "data": [int(v) for v in a.ravel()]}


def train(model, inputs, opt, steps, dtype):
    """Losses over `steps` steps of `opt` (the loss before each step and after the last), the first
    gradients, and the parameters after the first step."""
    m = copy.deepcopy(model).to(dtype)
    ins = [v.to(dtype) if v.is_floating_point() else v for v in inputs.values()]
    kind, lr = opt
    if kind == "sgd":
        o = torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9, foreach=False)
    else:
        o = torch.optim.Adam(m.parameters(), lr=lr, foreach=False)
    losses, grads, after = [], None, None
    for k in range(steps):
        o.zero_grad()
        loss = m(*ins)
        losses.append(loss.item())
        if k == steps - 1:
            break
        loss.backward()
        if grads is None:
            grads = {n: p.grad.detach().clone() for n, p in m.named_parameters()}
        o.step()
        if after is None:
            after = {n: p.detach().clone() for n, p in m.named_parameters()}
    return losses, grads, after


def main():
    for name, cls, inputs, (sgd_lr, adam_lr), description in cases():
        if only and name not in only:
            continue
        torch.manual_seed(1)
        model = cls()
        # Normalization affine parameters randomised, as the shared cases do.
        with torch.no_grad():
            for mod in model.modules():
                if isinstance(mod, (nn.GroupNorm, nn.InstanceNorm2d)) and mod.weight is not None:
                    mod.weight.add_(0.2 * torch.randn_like(mod.weight))
                    mod.bias.add_(0.2 * torch.randn_like(mod.bias))
        path = os.path.join(out_dir, name + ".onnx")
        torch.onnx.export(
            model,
            tuple(inputs.values()),
            path,
            dynamo=False,
            opset_version=17,
            do_constant_folding=False,
            training=torch.onnx.TrainingMode.TRAINING,
            input_names=list(inputs.keys()),
            output_names=["loss"],
        )
        proto = onnx.load(path)
        os.remove(path)
        onnx.checker.check_model(proto, full_check=True)
        text = onnx.printer.to_text(proto)
        reparsed = onnx.parser.parse_model(text)
        assert onnx.printer.to_text(reparsed) == text, f"{name}: the text does not round-trip"
        inits = {i.name for i in proto.graph.initializer}
        params = dict(model.named_parameters())
        missing = [n for n in params if n not in inits]
        assert not missing, f"{name}: parameters not initializers: {missing}"
        with open(os.path.join(out_dir, name + ".onnxtxt"), "w") as f:
            f.write(text)
        opts = {"sgd": ("sgd", sgd_lr), "adam": ("adam", adam_lr)}
        runs = {k: train(model, inputs, o, 10, torch.float32) for k, o in opts.items()}
        runs64 = {k: train(model, inputs, o, 10, torch.float64) for k, o in opts.items()}
        loss = runs["sgd"][0][0]
        grads = runs["sgd"][1]
        # The tolerance: the tightest the float64 training stays within a tenth of.
        pairs = [(loss, runs64["sgd"][0][0])]
        for n in params:
            pairs += list(zip(grads[n].flatten().tolist(), runs64["sgd"][1][n].flatten().tolist()))
            for k in opts:
                pairs += list(zip(runs[k][2][n].flatten().tolist(), runs64[k][2][n].flatten().tolist()))
        for k in opts:
            pairs += list(zip(runs[k][0], runs64[k][0]))
        usage = lambda r, a: max(abs(x - y) / (a + r * abs(y)) for x, y in pairs)
        tol = next(((r, a) for r, a in TOLS if usage(r, a) <= 0.1), None)
        assert tol, f"{name}: float64 and float32 differ beyond every tolerance ({usage(*TOLS[-1]):.2f} of the loosest)"
        sess = ort.InferenceSession(
            reparsed.SerializeToString(), providers=["CPUExecutionProvider"]
        )
        ort_loss = float(sess.run(None, {k: v.numpy() for k, v in inputs.items()})[0])
        assert abs(ort_loss - loss) <= 1e-5 * abs(loss), f"{name}: onnxruntime {ort_loss} vs torch {loss}"
        case = {
            "inputs": {k: tensor_json(v) for k, v in inputs.items()},
            "loss": float(np.float32(loss)),
            "trainable": list(params.keys()),
            "gradients": {n: tensor_json(grads[n]) for n in params},
            "steps": [
                {
                    "optimizer": {"kind": "sgd", "lr": sgd_lr, "momentum": 0.9, "dampening": 0, "nesterov": False, "weight_decay": 0},
                    "parameters_after": {n: tensor_json(runs["sgd"][2][n]) for n in params},
                },
                {
                    "optimizer": {"kind": "adam", "lr": adam_lr, "beta1": 0.9, "beta2": 0.999, "eps": 1e-08, "weight_decay": 0, "amsgrad": False},
                    "parameters_after": {n: tensor_json(runs["adam"][2][n]) for n in params},
                },
            ],
            "losses_over_steps": {k: [float(np.float32(v)) for v in runs[k][0]] for k in opts},
            "tolerance": {"rtol": tol[0], "atol": tol[1]},
            "description": description,
        }
        with open(os.path.join(out_dir, name + ".train.json"), "w") as f:
            json.dump(case, f)
        ops = sorted({n.op_type for n in proto.graph.node})
        print(f"{name}: loss {loss:.6f} (onnxruntime {ort_loss:.6f}), tolerance {tol}, ops {ops}")


if __name__ == "__main__":
    main()
