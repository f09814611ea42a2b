//! Exported plans launched in the frameworks they are for: `--export torch-tp` applied
//! unmodified with `parallelize_module` on 2 CPU processes (gloo) to HF Llama, Qwen2 and GPT-2
//! built from small configs and exported with both of torch's exporters, compared with the
//! single-process model (scripts/torch-tp-launch.py).
//!
//! Needs a Python with torch and transformers: `SHARDC_TORCH_PYTHON` (skipped with a note
//! without it; `SHARDC_REQUIRE_TORCH=1` makes that a failure).

use std::process::Command;

fn torch_python() -> Option<String> {
    let python = std::env::var("SHARDC_TORCH_PYTHON").ok();
    let ok = python.as_ref().is_some_and(|p| {
        Command::new(p).args(["-c", "import torch, transformers, onnx"]).output().is_ok_and(|o| o.status.success())
    });
    if !ok {
        assert!(
            std::env::var("SHARDC_REQUIRE_TORCH").is_err(),
            "SHARDC_REQUIRE_TORCH is set but SHARDC_TORCH_PYTHON is not a Python with torch, transformers and onnx"
        );
        eprintln!("note: skipped: set SHARDC_TORCH_PYTHON to a Python with torch, transformers and onnx");
        return None;
    }
    python
}

/// Every printed torch plan runs; none computes other logits or gradients than the model
/// (a wrong answer is worse than a refusal). Megatron's layout and `shardc plan`'s export run
/// and match on Llama and Qwen2 from both exporters; GPT-2's Conv1D modules are refused with
/// that reason.
#[test]
fn torch_tp_exports_run_in_torch_and_match_one_process() {
    let Some(python) = torch_python() else { return };
    let work = std::env::temp_dir().join(format!("shardc-torch-tp-{}", std::process::id()));
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/torch-tp-launch.py");
    let o = Command::new(python)
        .args([script, env!("CARGO_BIN_EXE_shardc"), work.to_str().unwrap()])
        .output()
        .expect("run the launch script");
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{text}\n{}", String::from_utf8_lossy(&o.stderr));
    let rows: Vec<serde_json::Value> = text
        .lines()
        // torch.onnx prints its progress on stdout too.
        .filter(|l| l.starts_with("{\"model\""))
        .map(|l| serde_json::from_str(l).expect("a JSON row"))
        .collect();
    let row = |model: &str, exporter: &str, command: &str| {
        rows.iter()
            .find(|r| r["model"] == model && r["exporter"] == exporter && r["command"] == command)
            .unwrap_or_else(|| panic!("no row for {model} {exporter} {command} in\n{text}"))
    };
    for r in &rows {
        assert_ne!(r["status"], "differs", "a printed plan computes something else: {r}");
        assert_ne!(r["status"], "export failed", "{r}");
    }
    // `plan --export torch-tp`: the searched plan when torch can run it, else Megatron's layout.
    for model in ["llama", "qwen2"] {
        for exporter in ["dynamo", "torchscript"] {
            for command in ["megatron", "plan"] {
                let r = row(model, exporter, command);
                assert_eq!(r["status"], "equal", "{r}");
            }
        }
    }
    for exporter in ["dynamo", "torchscript"] {
        let r = row("gpt2", exporter, "megatron");
        assert!(r["status"] == "refused" && r["detail"].as_str().unwrap().contains("Conv1D"), "{r}");
    }
    let _ = std::fs::remove_dir_all(&work);
}

/// `--export deepspeed` is a configuration DeepSpeed's own `DeepSpeedConfig` accepts, with the
/// plan's batch, accumulation, ZeRO stage, tensor degree (`autotp_size`) and bf16 read back.
/// Needs deepspeed beside torch in `SHARDC_TORCH_PYTHON` (skipped with a note without it).
#[test]
fn deepspeed_exports_are_accepted_by_deepspeed() {
    let Some(python) = torch_python() else { return };
    if !Command::new(&python).args(["-c", "import deepspeed"]).output().is_ok_and(|o| o.status.success()) {
        eprintln!("note: skipped: no deepspeed in SHARDC_TORCH_PYTHON (pip install deepspeed)");
        return;
    }
    let model = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/dynamo/qwen2_tiny.onnx");
    let o = Command::new(env!("CARGO_BIN_EXE_shardc"))
        .args(["cost", model, "--cluster", "dgx-a100", "--devices", "4", "--precision", "bf16"])
        .args(["--strategy", "tp=2,dp=2,zero=1", "--export", "deepspeed"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let check = r#"
import json, sys
import deepspeed.comm
from deepspeed.runtime.config import DeepSpeedConfig
deepspeed.comm.get_rank = lambda *a, **k: 0  # rank 0 of the launch, without starting its communicator
cfg = json.loads(sys.stdin.read())
class Mpu:  # the launcher's data-parallel group, as the plan sizes it
    def get_data_parallel_world_size(self):
        return cfg["shardc"]["data_parallel_size"]
c = DeepSpeedConfig(cfg, mpu=Mpu())
print(json.dumps([c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps,
                  c.zero_optimization_stage, c.tensor_parallel_config.autotp_size, c.bfloat16_config.enabled]))
"#;
    let mut child = Command::new(&python)
        .args(["-c", check])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child.stdin.take().unwrap().write_all(&o.stdout).unwrap();
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    let got: serde_json::Value = serde_json::from_str(text.lines().last().unwrap_or("")).unwrap();
    // Batch 2 over data 2: micro-batch 1, no accumulation; ZeRO-1, tensor 2, bf16.
    assert_eq!(got, serde_json::json!([2, 1, 1, 1, 2, true]), "{}", String::from_utf8_lossy(&o.stdout));
}
