#!/usr/bin/env python3
"""Hand calculation of a Megatron-LM tensor-parallel training step (forward, backward, Adam)
of the Hugging Face GPT-2 124M export (batch 8, sequence 128, fp32) on p GPUs of a DGX A100,
to compare with `shardc cost tests/data/models/hf_gpt2_124m.onnxtxt --strategy megatron
--cluster dgx-a100 --devices P --batch 8`.

Written from the model's dimensions and the published device numbers only (nothing is read
from shardc): A100 fp32 peak 19.5 TFLOP/s, large GEMMs at 60% of it, 128-wide output tiles
(a 192-wide GEMM fills 192/256 of its tiles) and K/(K+32) for the reduction loop, HBM 2039
GB/s for element-wise kernels, 5 us per kernel launch; NVSwitch 240 GB/s per GPU with 3 us
per message, ring all-reduce 2(p-1)/p·n/β + 2(p-1)α, all-gather (p-1)/p·n/β + (p-1)α.
Backward GEMMs use their own shapes (dX = dY·Wᵀ, dW = Xᵀ·dY); element-wise backward costs
twice its forward; communication is not overlapped with compute.

Two kernel lists:
  A. Megatron-LM as it runs GPT-2: one fused QKV GEMM, fused scale-mask-softmax, fused
     bias-GeLU, vocabulary padded to a multiple of 128·p so the LM head is column-parallel
     and its logits are all-gathered.
  B. Megatron's sharding of the exported graph as written: every ONNX op one kernel (GeLU as
     8 element-wise ops, the mask as Add/IsNaN/Where, the head's weight transposed each step),
     Q, K and V as three GEMMs (shardc's `algebra` pass un-fuses them), the 50257-word head
     row-parallel (no padding: a compiler may not change the model) with its logits
     all-reduced.
When p does not divide the 12 heads (p = 8) Megatron-LM refuses; both lists then run the
attention core replicated after all-gathering Q, K and V (their backward: a slice).
"""
import math
import sys

PEAK, EFF, TILE, KOV, HBM, LAUNCH, BW, ALPHA = 19.5e12, 0.6, 128, 32, 2039e9, 5e-6, 240e9, 3e-6
b, s, d, L, h, V = 8, 128, 768, 12, 12, 50257
T = b * s


def q(x):
    return x / (math.ceil(x / TILE) * TILE)


def gemm(m, n, k, batch=1):
    return batch * 2 * m * n * k / (PEAK * EFF * q(m) * q(n) * k / (k + KOV)) + LAUNCH


def weight_gemm(m, n, k):
    """Forward and backward (dX and dW) of Y[m,n] = X[m,k]·W[k,n]."""
    return gemm(m, n, k), gemm(m, k, n) + gemm(k, n, m)


def ew(elems, reads=1, writes=1):
    return elems * 4 * (reads + writes) / HBM + LAUNCH


def all_reduce(nbytes, p):
    return 0.0 if p == 1 else 2 * (p - 1) / p * nbytes / BW + 2 * (p - 1) * ALPHA


def all_gather(nbytes_out, p):
    return 0.0 if p == 1 else (p - 1) / p * nbytes_out / BW + (p - 1) * ALPHA


def step(p, kind):
    split = h % p == 0
    hp = h // p if split else h          # heads each device computes
    act = T * d // p if split else T * d  # one of Q, K, V on a device
    fwd = bwd = comm = 0.0

    def add(f, bw):
        nonlocal fwd, bwd
        fwd += f
        bwd += bw

    for _ in range(L):
        # Weighted GEMMs: QKV column-parallel, attention output row-parallel, MLP fc1 column, fc2 row.
        qkv = [(3 * d // p, d)] if kind == "A" else [(d // p, d)] * 3
        for n, k in qkv + [(d, d // p), (4 * d // p, d), (d, 4 * d // p)]:
            add(*weight_gemm(T, n, k))
        # Attention core: QKᵀ and AV, batched over (batch, heads).
        for m, n, k in [(s, s, d // h), (s, d // h, s)]:
            f = gemm(m, n, k, b * hp)
            add(f, 2 * f)
        if not split:
            comm += 3 * all_gather(T * d * 4, p)
        # Element-wise kernels (elements, tensors read).
        scores = b * hp * s * s
        if kind == "A":
            kernels = [(T * d, 1), (T * d, 1), (T * d, 2), (T * d, 2), (scores, 1), (T * 4 * d // p, 1)]
            kernels += [(act, 1)] * 4  # the [b,s,h,64] ↔ [b,h,s,64] transposes of Q, K, V and the output
        else:
            kernels = [(T * d, 1), (T * d, 1), (T * d, 2), (T * d, 2)]  # 2 layer norms, 2 residual adds
            kernels += [(act, 1)] * 5  # transposes: Q, K, V, Kᵀ, output
            kernels += [(act, 1)] * 2  # Q and K scaled
            kernels += [(s * s, 2), (scores, 2), (scores, 1), (scores, 1), (scores, 3)]  # mask, add, softmax, isnan, where
            kernels += [(T * 4 * d // p, r) for r in (1, 1, 1, 2, 1, 1, 1, 2)]  # GeLU (tanh form) as 8 ops
        for e, r in kernels:
            f = ew(e, r)
            add(f, 2 * f)
        comm += 4 * all_reduce(T * d * 4, p)  # 2 row-parallel outputs forward, 2 column-parallel inputs backward
    # Embeddings (token embedding vocabulary-parallel, + its all-reduce), position add, final LN.
    add(3 * ew(T * d), 2 * ew(T * d))
    comm += all_reduce(T * d * 4, p)
    if kind == "A":
        vp = math.ceil(V / (128 * p)) * 128 * p
        add(*weight_gemm(T, vp // p, d))
        comm += all_gather(T * V * 4, p) + all_reduce(T * d * 4, p)
    else:
        add(ew(V * d // p), 0.0)  # the head's weight transposed (its shard)
        add(*weight_gemm(T, V, d // p))
        comm += all_reduce(T * V * 4, p)
    # Adam over this device's parameters: 7 fp32 streams (param, grad, m, v read; param, m, v written).
    params = (124.4e6 - 0.1e6) / p + 0.1e6
    update = params * 4 * 7 / HBM + 4 * LAUNCH
    return fwd, bwd, comm, update


if __name__ == "__main__":
    for p in map(int, sys.argv[1:] or ["8", "4"]):
        for kind in "AB":
            f, bw, c, u = step(p, kind)
            print(
                f"p={p} {kind}: forward {f * 1e3:.2f} ms, backward {bw * 1e3:.2f} ms, "
                f"communication {c * 1e3:.2f} ms, update {u * 1e3:.2f} ms -> step {(f + bw + c + u) * 1e3:.2f} ms"
            )
