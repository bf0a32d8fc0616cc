#!/bin/bash
# load_turns.sh OUTDIR ROUNDS -- B-make-vars...   Ours only, 16 and 32 streams, the service restarted
# for every sample; A is `make run` as shipped, B adds the make variables given (docs/benchmarks.md,
# "The control plane's intervals under load"). BENCH_KEY: a registry key with a budget.
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=$(realpath -m "$1"); ROUNDS=$2; shift 3; B="$@"
K=${BENCH_KEY:?a budgeted registry key (docs/benchmarks.md)}
mkdir -p "$OUT"; cd "$(git -C "$HERE" rev-parse --show-toplevel)"
for r in $(seq "$ROUNDS"); do
  if [ $((r % 2)) = 1 ]; then ORDER="A B"; else ORDER="B A"; fi
  for side in $ORDER; do
    if [ $side = A ]; then "$HERE/svc.sh" start > "$OUT/start_$side$r.log" 2>&1
    else "$HERE/svc.sh" start $B > "$OUT/start_$side$r.log" 2>&1; fi
    sleep 20
    .venv/bin/serve-app bench --api-key "$K" --concurrency 16,32 --ignore-eos --rounds 3 --region local \
      --out-dir "$OUT/$side$r" > "$OUT/bench_$side$r.txt" 2>&1
    "$HERE/svc.sh" stop
  done
done
