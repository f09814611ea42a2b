#!/usr/bin/env bash
# Runs the whole test suite N times in a row (default 5) and reports every test whose outcome
# changed between runs (passed in one, failed or went missing in another), and every run's
# exit status. Exit 0 when every run had the same outcomes, 1 otherwise.
#
#   scripts/flaky.sh [N] [-- extra cargo test args]
#
# Property tests draw fresh seeds on every run here (SHARDC_PROPTEST_SEED=random), so a
# generator that can produce invalid programs shows up as a changed outcome.
set -uo pipefail
cd "$(dirname "$0")/.."
n=${1:-5}
shift || true
[ "${1:-}" = "--" ] && shift
out=$(mktemp -d)
export SHARDC_REQUIRE_GPU=${SHARDC_REQUIRE_GPU:-1}
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$(mktemp -d)}"
export SHARDC_PROPTEST_SEED=${SHARDC_PROPTEST_SEED:-random}
cargo test --workspace --locked --no-run "$@" >/dev/null 2>&1 || { echo "build failed" >&2; exit 2; }
for i in $(seq 1 "$n"); do
  start=$(date +%s)
  # --no-fail-fast: a failure in one test binary must not hide the outcomes of the others.
  cargo test --workspace --locked --no-fail-fast "$@" >"$out/run$i.log" 2>&1
  rc=$?
  echo "run $i: exit $rc, $(( $(date +%s) - start )) s"
  # "Running tests/foo.rs (target/...)" names the binary; "test name ... ok" its tests.
  awk '/^     Running /{bin=$2} /^test .* \.\.\. /{t=$2; r=$NF; print bin "::" t " " r}' "$out/run$i.log" \
    | sort >"$out/outcomes$i.txt"
done
status=0
sort -m "$out"/outcomes*.txt | awk '{k=$1; v=$2; seen[k]=seen[k] " " v; cnt[k]++}
  END {for (k in seen) print k "|" cnt[k] "|" seen[k]}' | sort >"$out/all.txt"
while IFS='|' read -r test count results; do
  uniq=$(tr ' ' '\n' <<<"$results" | sed '/^$/d' | sort -u | tr '\n' ' ')
  if [ "$count" -ne "$n" ] || [ "$(wc -w <<<"$uniq")" -ne 1 ]; then
    echo "CHANGED: $test — outcomes over $n runs:$results (seen in $count runs)"
    status=1
  fi
done <"$out/all.txt"
total=$(wc -l <"$out/all.txt")
if [ $status -eq 0 ]; then
  echo "no changed outcome: $total tests, $n runs (logs in $out)"
else
  echo "some outcomes changed (logs in $out)"
fi
exit $status
