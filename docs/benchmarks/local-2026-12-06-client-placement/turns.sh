#!/bin/bash
# Taking turns: the bench client free (F) or pinned to CPU 1 once bare vLLM is up (P), c=16.
cd /work/main
for mode in F P P F F P; do
  out=/tmp/exp/client-$mode-$(date +%H%M%S)
  .venv/bin/serve-app bench --api-key $(cat /tmp/key) --baseline-vllm configs/local-bench.yaml \
     --concurrency 16 --ignore-eos --rounds 4 --region local --out-dir $out > $out.log 2>&1 &
  BP=$!
  if [ $mode = P ]; then
    for i in $(seq 300); do grep -q "bare vLLM ready" $out.log && break; sleep 1; done
    taskset -a -p -c 1 $BP >> $out.log 2>&1
  fi
  wait $BP
done
echo finished > /tmp/turns.done
