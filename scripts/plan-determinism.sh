#!/usr/bin/env bash
# Plans every shared model twice — once on an idle machine, once with every core busy — and
# checks that the plan documents are byte-identical outside `timings`. Prints each model's
# search time (from `timings.search_s`) and whether the safety net fired.
#
#   scripts/plan-determinism.sh [--cluster C] [--devices N] [--batch B]   (defaults: dgx-a100, 8, 8)
set -uo pipefail
cd "$(dirname "$0")/.."
cluster=dgx-a100 devices=8 batch=8
while [ $# -gt 0 ]; do
  case "$1" in
    --cluster) cluster=$2; shift 2 ;;
    --devices) devices=$2; shift 2 ;;
    --batch) batch=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
cargo build --release --locked -q || exit 2
bin=target/release/shardc
out=$(mktemp -d)
models=$(ls tests/data/models/*.onnxtxt)
[ -d ../shared/models ] && models=$(ls tests/data/models/*.onnxtxt ../shared/models/*.onnxtxt | awk -F/ '!seen[$NF]++')
strip() { python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); t=d.pop("timings"); print(json.dumps(d, sort_keys=True)); print("%.2f %s %s" % (t["search_s"], d["search"]["time_limit_hit"], ",".join(d["search"]["budget_cut"])), file=sys.stderr)' "$1"; }
status=0
for m in $models; do
  name=$(basename "$m" .onnxtxt)
  "$bin" plan "$m" --cluster "$cluster" --devices "$devices" --batch "$batch" --json >"$out/$name.idle.json" 2>"$out/$name.idle.err"
  rc1=$?
  # Load every core with busy loops for the second run.
  pids=()
  for _ in $(seq "$(nproc)"); do (while :; do :; done) & pids+=($!); done
  "$bin" plan "$m" --cluster "$cluster" --devices "$devices" --batch "$batch" --json >"$out/$name.busy.json" 2>"$out/$name.busy.err"
  rc2=$?
  kill "${pids[@]}" 2>/dev/null; wait "${pids[@]}" 2>/dev/null
  if [ $rc1 -ne 0 ] || [ $rc2 -ne 0 ]; then
    echo "$name: exit $rc1 / $rc2: $(tail -1 "$out/$name.idle.err")"
    [ $rc1 -ne $rc2 ] && status=1
    continue
  fi
  a=$(strip "$out/$name.idle.json" 2>"$out/$name.idle.t") b=$(strip "$out/$name.busy.json" 2>"$out/$name.busy.t")
  if [ "$a" == "$b" ]; then same=identical; else same=DIFFERENT; status=1; fi
  printf '%-28s %-9s idle %6s s  busy %6s s  (net fired: %s / %s)\n' "$name" "$same" \
    "$(cut -d' ' -f1 "$out/$name.idle.t")" "$(cut -d' ' -f1 "$out/$name.busy.t")" \
    "$(cut -d' ' -f2- "$out/$name.idle.t")" "$(cut -d' ' -f2- "$out/$name.busy.t")"
done
echo "documents in $out"
exit $status
