"""Times torch eager training steps and GEMMs on the CPU, for `cargo bench --bench cpu`.

Prints one JSON object: per case its warm-step median (seconds) on one thread. The models are
the ones the bench runs through shardc's CPU executor: torchvision's ResNet-18 at 8x3x32x32 and
GPT-2 (4 layers, width 256, 4 heads, dropout off) at 4x32 tokens, each with SGD (lr 0.01) on a
softmax cross-entropy over random labels; GEMMs of n x n float32 matrices.
usage: torch-train-step.py STEPS WARMUP
"""
import json
import statistics
import sys
import time

import torch

torch.set_num_threads(1)
torch.manual_seed(0)
steps, warmup = int(sys.argv[1]), int(sys.argv[2])


def step_times(model, x, labels, logits_of):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = logits_of(model, x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times[warmup:])


def resnet18():
    import torchvision

    model = torchvision.models.resnet18(weights=None)
    x = torch.randn(8, 3, 32, 32)
    return step_times(model, x, torch.randint(0, 1000, (8,)), lambda m, x: m(x))


def gpt2_small4():
    import transformers

    cfg = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, cfg.vocab_size, (4, 32))
    return step_times(model, ids, torch.randint(0, cfg.vocab_size, (4, 32)), lambda m, x: m(x).logits)


def gemm(n):
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times) / 1e9


print(json.dumps({
    "torch": torch.__version__,
    "resnet18": resnet18(),
    "gpt2_small4": gpt2_small4(),
    "gemm512_gflops": gemm(512),
    "gemm2048_gflops": gemm(2048),
}))
