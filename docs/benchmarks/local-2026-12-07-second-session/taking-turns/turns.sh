#!/bin/bash
# Taking turns: ours alone at one stream, HEAD (main) against 1170793, the service restarted each time.
cd /work/main
run() {  # $1 label
  head -1 /proc/stat > /tmp/turns/$1.stat0
  .venv/bin/serve-app bench --api-key $(cat /tmp/key) --concurrency 1 --ignore-eos --rounds 4 --region local \
    --out-dir /tmp/turns/$1 > /tmp/turns/$1.log 2>&1
  head -1 /proc/stat > /tmp/turns/$1.stat1
}
mkdir -p /tmp/turns
[ -z "$LABELS" ] && run new1
[ -z "$LABELS" ] && bash /tmp/exp/svc.sh stop
for label in ${LABELS:-old1 new2 old2 new3}; do
  case $label in old*) git checkout -q 1170793 ;; new*) git checkout -q main ;; esac
  bash /tmp/exp/svc.sh start SERVE_CONFIG=configs/local-bench.yaml > /tmp/turns/svc-$label.log 2>&1
  sleep 20
  run $label
  bash /tmp/exp/svc.sh stop
done
git checkout -q main
echo finished > /tmp/turns/done2
