#!/bin/bash
# Taking turns: A = the router as at c35c716 (uvicorn's 0.1 s tick, per-model KV reads in a thread),
# B = HEAD. make run (configs/local.yaml), restarted for every sample, 30 s to settle, 60 s of idle.
cd /work/main
FILES="serve_app/router/ingress.py serve_app/hot_load/tracker.py serve_app/hot_load/state.py"
i=0
for v in B A B A; do
  i=$((i+1))
  if [ $v = A ]; then for f in $FILES; do git show c35c716:$f > $f; done; else git checkout -- $FILES; fi
  /tmp/exp/svc.sh start > /dev/null 2>&1
  sleep 30
  .venv/bin/serve-app idle --seconds 60 --json > /tmp/idle-turns/$i-$v.json 2>/dev/null
  /tmp/exp/svc.sh stop
done
git checkout -- $FILES
echo done > /tmp/idle-turns/done
