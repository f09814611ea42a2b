#!/usr/bin/env python3
"""Runs shardc's `--export torch-tp` plans in PyTorch, unmodified, and checks them.

For each model (HF Llama, Qwen2 and GPT-2 built from small configs: seeded weights, no
downloads) and each exporter (torch's dynamo exporter and the TorchScript one), the model is
exported to ONNX, shardc prints a torch tensor-parallel plan for it on 2 devices (each command
of COMMANDS), and the plan is applied with `parallelize_module` on 2 CPU processes (gloo). The
logits and, after one backward of a cross-entropy loss, every parameter's gradient are compared
with the single-process model's (rtol 1e-5). A plan shardc refuses is reported with its reason.

Prints one JSON object per line (among torch.onnx's progress lines): {"model", "exporter", "command", "status": "equal" |
"refused" | "differs" | "failed", "detail"}.
usage: torch-tp-launch.py SHARDC WORK_DIR [MODEL ...]   (needs torch, transformers, onnx)
"""
import json
import os
import subprocess
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SEQ, BATCH, WORLD = 8, 2, 2
COMMANDS = {
    # Megatron's tensor parallelism, priced by name.
    "megatron": ["cost", "--strategy", "megatron"],
    # The same with sequence parallelism (norms split along the sequence).
    "tp2-sp": ["cost", "--strategy", "tp=2,sp"],
    # What the search chooses with its defaults.
    "plan": ["plan"],
}


def build(name):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    small = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                 attn_implementation="eager")
    torch.manual_seed(0)
    if name == "llama":
        m = LlamaForCausalLM(LlamaConfig(**small))
    elif name == "qwen2":
        m = Qwen2ForCausalLM(Qwen2Config(**small))
    elif name == "gpt2":
        m = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                       attn_implementation="eager"))
    else:
        raise SystemExit(f"unknown model {name}")
    return Logits(m.eval())


class Logits(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, input_ids):
        # An explicit mask keeps transformers' packed-sequence detection (`aten::diff`, which
        # the TorchScript exporter lacks) out of the graph; it is all ones, as without it.
        return self.m(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False).logits


def ids():
    return torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def export(model, exporter, path):
    x = ids()
    if exporter == "dynamo":
        prog = torch.onnx.export(model, (x,), dynamo=True, input_names=["input_ids"], output_names=["logits"])
        prog.save(path)
    else:
        torch.onnx.export(model, (x,), path, dynamo=False, input_names=["input_ids"], output_names=["logits"],
                          opset_version=17)


def loss_of(logits):
    labels = torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def reference(name):
    model = build(name)
    logits = model(ids())
    loss_of(logits).backward()
    return logits.detach(), {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def worker(rank, name, plan_src, ref_path, port, result_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor

        scope = {}
        exec(plan_src, scope)  # the printed plan, unmodified
        model = build(name)
        mesh = init_device_mesh("cpu", (WORLD,))
        scope["parallelize_module"](model, mesh, scope["plan"])
        logits = model(ids())
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        loss_of(logits).backward()
        ref_logits, ref_grads = torch.load(ref_path)
        worst = []
        ok = torch.allclose(logits, ref_logits, rtol=1e-5, atol=1e-6)
        worst.append(("logits", float((logits - ref_logits).abs().max())))
        for k, p in model.named_parameters():
            g = p.grad
            if g is None:
                ok = False
                worst.append((k + " (no gradient)", float("inf")))
                continue
            g = g.full_tensor() if isinstance(g, DTensor) else g
            if not torch.allclose(g, ref_grads[k], rtol=1e-5, atol=1e-6):
                ok = False
            worst.append((k, float((g - ref_grads[k]).abs().max())))
        if rank == 0:
            worst.sort(key=lambda w: -w[1])
            with open(result_path, "w") as f:
                json.dump({"status": "equal" if ok else "differs", "detail": f"largest differences: {worst[:3]}"}, f)
    except Exception as e:  # the plan did not run: report torch's error
        if rank == 0:
            with open(result_path, "w") as f:
                json.dump({"status": "failed", "detail": f"{type(e).__name__}: {e}".splitlines()[0][:400]}, f)
        raise
    finally:
        dist.destroy_process_group()


def main():
    shardc, work = sys.argv[1], sys.argv[2]
    models = sys.argv[3:] or ["llama", "qwen2", "gpt2"]
    os.makedirs(work, exist_ok=True)
    port = 29500 + os.getpid() % 1000
    for name in models:
        ref_path = os.path.join(work, f"{name}.ref.pt")
        torch.save(reference(name), ref_path)
        for exporter in ("dynamo", "torchscript"):
            path = os.path.join(work, f"{name}.{exporter}.onnx")
            try:
                export(build(name), exporter, path)
            except Exception as e:
                row = {"model": name, "exporter": exporter, "command": "-", "status": "export failed",
                       "detail": f"{type(e).__name__}: {e}".splitlines()[0][:400]}
                print(json.dumps(row), flush=True)
                continue
            for label, args in COMMANDS.items():
                cmd = [shardc, args[0], path, "--cluster", "dgx-a100", "--devices", str(WORLD), *args[1:],
                       "--export", "torch-tp"]
                out = subprocess.run(cmd, capture_output=True, text=True)
                row = {"model": name, "exporter": exporter, "command": label}
                if out.returncode != 0:
                    row.update(status="refused", detail=out.stderr.strip()[:600])
                    print(json.dumps(row), flush=True)
                    continue
                with open(os.path.join(work, f"{name}.{exporter}.{label}.py"), "w") as f:
                    f.write(out.stdout)
                result_path = os.path.join(work, f"{name}.{exporter}.{label}.json")
                if os.path.exists(result_path):
                    os.remove(result_path)
                port += 1
                try:
                    mp.spawn(worker, args=(name, out.stdout, ref_path, port, result_path), nprocs=WORLD)
                except Exception:
                    pass
                try:
                    with open(result_path) as f:
                        row.update(json.load(f))
                except OSError:
                    row.update(status="failed", detail=traceback.format_exc().splitlines()[-1])
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
