#!/usr/bin/env python3
"""The memory tables of docs/memory.md: shardc's model-state memory under ZeRO against
DeepSpeed's estimators, and its activation memory per Megatron GPT layer against the closed
forms of Korthikanti et al. 2022. Usage: scripts/memory-tables.py [SHARDC] (default
target/release/shardc; the synthetic models come from the release examples)."""
import json, subprocess, sys, os

SHARDC = next((a for a in sys.argv[1:] if not a.startswith("--")), "target/release/shardc")
TMP = os.environ.get("TMPDIR", "/tmp")

def cost(model, strategy, devices, extra=()):
    out = subprocess.run([SHARDC, "cost", model, "--cluster", "a100-cluster-8", "--devices", str(devices),
                          "--strategy", strategy, "--precision", "fp16", "--json", *extra],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)

def synth(example, args, name):
    path = os.path.join(TMP, name)
    with open(path, "w") as f:
        subprocess.run(["target/release/examples/" + example, *map(str, args)], stdout=f, check=True)
    return path

def params(model):
    d = cost(model, "dp=1", 1)
    # fp16 weights: 2 bytes per parameter
    return d["memory_breakdown"]["parameters"] / 2, d

def zero_table():
    models = [
        ("GPT-2 124M (export)", "../shared/models/hf_gpt2_124m.onnxtxt", ["--batch", "8", "--input-shape", "input_ids=8x1024"]),
        ("Llama-3-8B shape", synth("synthetic_llama", ["8b", 8, 1024], "llama8b.onnxtxt"), []),
        ("ResNet-50 (export)", "../shared/models/tv_resnet50.onnxtxt", ["--batch", "256"]),
    ]
    n = 8
    print("| model | Ψ | stage | shardc GiB | shardc `fp32_grads` GiB | DeepSpeed estimator GiB | shardc/DeepSpeed | `fp32_grads`/DeepSpeed |")
    print("|---|---|---|---|---|---|---|---|")
    for name, path, extra in models:
        base = cost(path, "dp=8,zero=0", n, extra)
        psi = base["memory_breakdown"]["parameters"] / 2
        for stage in (1, 2, 3):
            states = []
            for grads in ("", ",fp32_grads"):
                d = cost(path, f"dp=8,zero={stage}{grads}", n, extra)
                m = d["memory_breakdown"]
                state = m["parameters"] + m["gradients"] + m["optimizer_state"]
                gathered = m["other"] - base["memory_breakdown"]["other"] if stage == 3 else 0
                states.append(state + gathered)  # stage 3: the gathered buffer
            largest = gathered / 4
            ds = 4 * psi + 16 * psi / n if stage < 3 else 18 * psi / n + 4 * largest
            a, b = states
            print(f"| {name} | {psi/1e6:.1f} M | {stage} | {a/2**30:.3f} | {b/2**30:.3f} | {ds/2**30:.3f} | {a/ds:.3f} | {b/ds:.3f} |")

def activation_table():
    # Megatron GPT layer: the 22B model's width (Korthikanti et al.'s Table 3 row), 4 layers.
    L, h, a, s, b, t = 4, 6144, 64, 2048, 4, 8
    path = synth("synthetic_gpt", [L, h, a, b, s, "--fused-gelu"], "megatron4.onnxtxt")
    sbh, s2 = s * b * h, a * s * s * b
    print("| recompute | sp | shardc GiB (4 layers, t=8) | closed form GiB | shardc/closed |")
    print("|---|---|---|---|---|")
    for sp in (False, True):
        r = 1 / t if sp else 1
        none = sbh * (8 * r + 24 / t) + 2 * s2 / t
        forms = {"none": L * none - 2 * sbh * r,
                 "selective": L * sbh * (8 * r + 24 / t) - 2 * sbh * r + 2 * s2 / t,
                 "full": L * 2 * sbh * r - 2 * sbh * r + none}
        for rc, want in forms.items():
            got = cost(path, f"tp={t},recompute={rc}" + (",sp" if sp else ""), t)["memory_breakdown"]["activations"]
            print(f"| {rc} | {'yes' if sp else 'no'} | {got/2**30:.3f} | {want/2**30:.3f} | {got/want:.4f} |")

if __name__ == "__main__":
    zero_table()
    if "--zero-only" not in sys.argv:
        print()
        activation_table()
