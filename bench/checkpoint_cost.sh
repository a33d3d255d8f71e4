#!/bin/bash
# Checkpoint cost on the 5.8M MLP (configs/compare_job.yaml, 4 workers, 2 servers, loopback):
# alternating runs without checkpoints and with one every 100 steps; prints train_s, accuracy and
# the checkpoint log lines. Used for docs/log/benchmarks-2026-11.md ("Checkpoints and resume").
cd "$(dirname "${BASH_SOURCE[0]}")/.."
for rep in 1 2; do
  for mode in none every100; do
    d=/tmp/ckb-$mode-$rep; rm -rf $d
    extra=(); [[ $mode == every100 ]] && extra=(--set checkpoint.every_steps=100)
    deploy/launch.sh --config configs/compare_job.yaml --run-dir $d --quiet \
      --set train.max_steps=400 --set train.eval_every_steps=0 "${extra[@]}" >/dev/null 2>&1
    t=$(python3 -c "import json;s=json.load(open('$d/summary.json'));print(s['train_s'], s['final_test_accuracy'])")
    echo "$mode rep$rep train_s acc: $t"
    grep -h "checkpoint of iteration" $d/worker-*.log $d/server-*.log 2>/dev/null | sed -E 's/.*\] (checkpoint)/\1/' | sort | uniq -c | head -20
    du -sb $d/checkpoints/iter-* 2>/dev/null
  done
done
