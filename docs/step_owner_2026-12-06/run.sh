#!/bin/bash
# Issue 49: the engine's per-step overhead before (BASE: a checkout of 318766e) and after (NEW: this
# one), `bench latency --profile` alternating in one script on one machine; results.json holds
# the engine's parts (scheduler, outputs) per step. Usage: BASE=... NEW=... OUT=... bash run.sh
set -e
cd $NEW
for round in 1 2 3; do
  for side in base new; do
    if [ $side = base ]; then dir=$BASE; else dir=$NEW; fi
    for bs in 1 8 32; do
      (cd $dir && PYTHONPATH=$dir $NEW/.venv/bin/python -m pagedllm bench latency --batch-size $bs --input-len 32 --output-len 32 --num-iters 1 --profile --profile-steps 60 --output-json $OUT/ab2_${side}_bs${bs}_r${round}.json > $OUT/ab2_${side}_bs${bs}_r${round}.log 2>&1)
      echo "$side bs=$bs round=$round done"
    done
  done
done
