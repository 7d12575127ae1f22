#!/bin/bash
# The 1B-shaped Q4_K_M against llama.cpp, one after the other, 2 threads, on a quiet machine.
cd /work/main
B=~/.cache/pagedllm/llama.cpp/0.3.36/build/bin
M=${M:-~/.cache/pagedllm/gguf-models/1b-q4_k_m.gguf}
O=${O:-/tmp/meas/out}; mkdir -p $O
P=.venv/bin/pagedllm
date; uptime; grep -m1 "model name" /proc/cpuinfo
$B/llama-bench -m $M -t 2 -p 512 -n 64 -r 2 -o md 2>/dev/null | tee $O/llama_bench_1.md
$P bench latency $M --batch-size 1 --input-len 512 --output-len 32 --num-iters 1 --profile --no-adapt-cpu-threads --max-model-len 1024 --output-json $O/latency_b1.json 2>&1 | grep -v "^INFO\|it/s\]" | tail -40
$P bench latency $M --batch-size 16 --input-len 64 --output-len 16 --num-iters 1 --profile --no-adapt-cpu-threads --max-model-len 1024 --output-json $O/latency_b16.json 2>&1 | grep -v "^INFO\|it/s\]" | tail -30
$P bench throughput $M --num-prompts 16 --max-model-len 1024 --backend pagedllm llama-cpp --llama-cpp-parallel 16 --llama-cpp-threads 2 --no-adapt-cpu-threads --output-json $O/throughput16.json 2>&1 | grep -v "it/s\]" | tail -12
$B/llama-bench -m $M -t 2 -p 512 -n 64 -r 2 -o md 2>/dev/null | tee $O/llama_bench_2.md
date; uptime
# kernels: every type, rows 1-64, 2 threads; the LM heads at 1 row
$P bench gguf-kernels --types Q4_K Q5_K Q6_K Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q2_K Q3_K IQ4_NL IQ4_XS --rows 1 2 4 8 16 32 64 --threads 2 --repeats 3 --output-json $O/kernels.json 2>&1 | grep -v "^INFO" | tail -110
$P bench gguf-kernels --shapes head-262k --types Q6_K Q8_0 --rows 1 4 --threads 2 --repeats 3 --output-json $O/head262k.json 2>&1 | grep -v "^INFO" | tail -12
$P bench gguf-kernels --shapes head-152k --types Q6_K Q8_0 --rows 1 4 --threads 2 --repeats 3 --output-json $O/head152k.json 2>&1 | grep -v "^INFO" | tail -12
date; uptime
