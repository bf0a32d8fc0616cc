#!/bin/bash
# The gloo plugin taking turns on the idle service: "on" as installed, "off" with VLLM_PLUGINS
# listing every vLLM plugin but serve_app_gloo. Restart per sample, 30 s settle, 90 s of
# `serve-app idle`. SIDES="off on off on" (03:20), then "on off on off" (03:34).
cd "$(git rev-parse --show-toplevel)"
SVC=docs/benchmarks/local-2026-12-06-intervals-under-load/svc.sh
OUT=docs/benchmarks/local-2026-12-06-gloo-one-device/idle
for side in ${SIDES:-off on off on}; do
  $SVC stop
  if [ $side = off ]; then export VLLM_PLUGINS=serve_app_amx,lora_filesystem_resolver,lora_hf_hub_resolver
  else unset VLLM_PLUGINS; fi
  $SVC start > /dev/null
  sleep 30
  W=$(pgrep -f "^VLLM::Worker" | head -1)
  echo "$side loops $(grep -l gloo_tcp_loop /proc/$W/task/*/comm | wc -l)"
  .venv/bin/serve-app idle --seconds 90 --json > $OUT/$(date +%H%M%S)-$side.json
done
