#!/usr/bin/env bash
# The CPU benchmarks of docs/benchmarks.md, in one sequential run on an otherwise idle machine
# (nothing else running: two cores shared with a test run make every figure meaningless).
# Throughput uses --max-model-len 1024, which scales the ShareGPT-shaped lengths to the manual's
# workload (64 requests: ~5k prompt and ~12k output tokens); without it they are twice as long.
cd "$(dirname "$0")/.."
P=.venv/bin/pagedllm
mkdir -p results
set -x
date
$P bench throughput --num-prompts 64 --max-model-len 1024 --backend pagedllm hf hf-cb --output-json results/throughput_64_sharegpt.json > results/throughput_64_sharegpt.log 2>&1
date
$P bench latency --batch-size 1 --input-len 128 --output-len 64 --output-json results/latency_b1.json > results/latency_b1.log 2>&1
$P bench latency --batch-size 64 --input-len 512 --output-len 32 --num-iters 2 --output-json results/latency_b64_ctx512.json > results/latency_b64_ctx512.log 2>&1
$P bench latency --batch-size 64 --input-len 512 --output-len 32 --num-iters 2 --kv-cache-dtype bfloat16 --output-json results/latency_b64_ctx512_bf16kv.json > results/latency_b64_ctx512_bf16kv.log 2>&1
date
$P bench kernel --output-json results/kernel_scattered.json > results/kernel_scattered.log 2>&1
$P bench kernel --contiguous-blocks --output-json results/kernel_contiguous.json > results/kernel_contiguous.log 2>&1
date
$P bench dtype --output-json results/dtype.json > results/dtype.log 2>&1
date
$P bench preemption --output-json results/preemption.json > results/preemption.log 2>&1
date
$P bench sharing --datasets alpaca --output-json results/sharing_alpaca.json --skip-prefix > results/sharing_alpaca.log 2>&1
$P bench sharing --datasets sharegpt --max-output-len 256 --skip-prefix --output-json results/sharing_sharegpt.json > results/sharing_sharegpt.log 2>&1
$P bench sharing --skip-memory --output-json results/sharing_prefix.json > results/sharing_prefix.log 2>&1
date
$P bench throughput --num-prompts 16 --tensor-parallel-size 3 --output-json results/throughput_tp3.json > results/throughput_tp3.log 2>&1
$P bench throughput --num-prompts 16 --output-json results/throughput_tp1_16.json > results/throughput_tp1_16.log 2>&1
date
$P bench throughput --output-json results/throughput_200_sharegpt.json > results/throughput_200_sharegpt.log 2>&1
date
