#!/bin/bash
# svc.sh start [make vars...] | stop: `make run` on the benchmark's config in the background (its
# pid in /tmp/run.pid), started once /health says the chat model serves; stopped by the pid of the
# Python process make started (SIGTERM: `serve run` shuts Serve and Ray down).
cd /work/main
if [ "$1" = stop ]; then
  SH=$(ps -o pid= --ppid "$(cat /tmp/run.pid)" | head -1); SP=$(ps -o pid= --ppid $SH | head -1); kill -TERM $SP
  for i in $(seq 60); do kill -0 $SP 2>/dev/null || break; sleep 1; done; sleep 3; exit 0
fi
shift 2>/dev/null; true
(nohup make run "$@" > /tmp/run.log 2>&1 & echo $! > /tmp/run.pid)
sleep 30
for i in $(seq 60); do curl -s localhost:8000/health | grep -q '"qwen-3.6-35b-a3b":true' && break; sleep 3; done
curl -s localhost:8000/health | head -c 80; echo
