#!/usr/bin/env bash
# The process's peak resident set against the memory `shardc train` promised (its
# `host_memory` in --json), over three real models on 1 and 4 devices, with and without
# --check. Usage: [BACKEND=wgpu] scripts/memory-promise.sh [path/to/shardc] (default: a release
# build; the cpu backend).
set -euo pipefail
cd "$(dirname "$0")/.."
S=${1:-target/release/shardc}
B=${BACKEND:-cpu}
[ -x "$S" ] || cargo build --release --locked
M=tests/data/models
out=$(mktemp)
trap 'rm -f "$out"' EXIT
row() { # model, shapes, devices, check flag
  local model=$1 shapes=$2 devices=$3 check=$4 args=()
  for s in $shapes; do args+=(--input-shape "$s"); done
  "$S" train "$M/$model" "${args[@]}" --loss softmax-cross-entropy --devices "$devices" --steps 2 \
    --backend "$B" $check --json >"$out"
  python3 - "$model" "$devices" "${check:-no check}" "$out" <<'PY'
import json, sys
model, devices, check, path = sys.argv[1:]
d = json.load(open(path))
h = d["host_memory"]
alloc = max(x["memory_allocated_bytes"] for x in d["devices"])
pred = d.get("memory_predicted_bytes") or 0
print(f"{model:26} {devices} dev {check:8}  device {alloc/1e6:7.1f} MB of {pred/1e6:7.1f} predicted"
      f"  process {h['peak_rss_bytes']/1e6:7.1f} MB of {h['promised_bytes']/1e6:7.1f} promised"
      f"  ({h['peak_rss_bytes']/h['promised_bytes']:.2f}x)")
PY
}
for devices in 1 4; do
  for check in "" --check; do
    row tv_resnet18.onnxtxt "input=8x3x64x64" "$devices" "$check"
    row hf_gpt2_small4.onnxtxt "input_ids=4x64" "$devices" "$check"
    row pt_lstm_lm.onnxtxt "tokens=4x35 h0=2x4x650 c0=2x4x650" "$devices" "$check"
  done
done
