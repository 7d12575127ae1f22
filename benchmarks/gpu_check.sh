#!/usr/bin/env bash
# The GPU check (docs/gpu.md), in one run on one GPU machine with only this repository (no
# network; Python with CUDA torch, Triton, transformers and pytest already there). About 6-8
# minutes on an H200. Prints one summary table at the end; logs and JSON go to $OUT (default
# results/gpu_check).
#
#   bash benchmarks/gpu_check.sh            # everything
#   QUICK=1 bash benchmarks/gpu_check.sh    # fewer shapes and requests (about 4 minutes)
#
# 1. the Triton kernel tests, compiled (pytest -m gpu), the GPU memory sizing test, CUDA graphs
#    and swaps on the side stream;
# 2. greedy output of the default model's architecture (random weights: its file cannot travel)
#    on the GPU, equal to transformers on the GPU (float32; bfloat16 reported), with CUDA graphs
#    and without (--enforce-eager);
# 3. the autotuning sweep of the decode/prompt kernel's launch shapes (benchmarks/gpu_autotune.py),
#    whose table ($OUT/triton_tuning.json) the later steps read (PAGEDLLM_TRITON_TUNING); commit it
#    as pagedllm/kernels/tuning/<gpu>.json to make it the GPU's default;
# 4. pagedllm bench kernel: paged decode vs contiguous SDPA at contexts 256-4096, batch 1-256,
#    with GB/s against the GPU's measured copy bandwidth, timed alone and from CUDA graphs;
# 5. greedy output of the newer families (Qwen3, Gemma 3 with windows, Qwen3-MoE; random weights)
#    against transformers on the GPU, float32 (equal) and bfloat16 (agreement vs bfloat16 and
#    float32 transformers, first differences classified as rounding ties or not);
# 6. pagedllm bench latency on a ~1B Llama shape, decode steps with CUDA graphs and without;
# 7. pagedllm bench throughput --backend pagedllm hf hf-cb on the ~1B Llama shape;
# 8. speculative decoding on CUDA (pagedllm bench spec, float32, greedy): outputs identical with
#    and without speculation (lossless), and the single-stream speed-up on copy-heavy prompts, with
#    CUDA graphs (verify steps replay graphs of several query tokens per sequence) and without.
#    It needs a real model (random weights copy nothing): SPEC_MODEL=path/to/model.gguf (the
#    default model's file, carried to the machine), else the step is skipped; a `gguf` wheel in
#    $WHEELS (default results/carry) is installed first when gguf is missing.
# Each step has STEP_TIMEOUT seconds (default 300), so one that hangs does not take the rest.
# Through the device tool (at most 8 files come back, and a command past its limit is killed):
#   ARCHIVE=$OUT/gpu_check.tgz OUT=/tmp/gpu_check bash benchmarks/gpu_check.sh   (ARCHIVE first: its $OUT is the tool's)
# (no `| tail`: its output is lost when the command is cut off). Measured 2026-12-04 on an H200:
# models 20 s, greedy 30 s, tune 100 s, kernel 30 s, families ~60 s, throughput ~150 s (hf-cb's
# 64 requests alone ~120 s): QUICK=1 with every part but the tests and latency took over 540 s.
# ONLY="tests greedy" (or tune, kernel, families, latency, throughput, spec) runs those parts alone.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu_check}
MODELS=${MODELS:-/tmp/gpu_models}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET
status=()
want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
step() {  # step NAME LOG COMMAND...: run, keep the log, note pass/fail and seconds
  local name=$1 log=$2; shift 2
  local start=$SECONDS
  echo "== $name: $*"
  timeout "${STEP_TIMEOUT:-300}" "$@" 2>&1 | tee "$OUT/$log"
  local rc=${PIPESTATUS[0]}
  status+=("$name|$rc|$((SECONDS - start))|$log")
  echo "== $name: rc $rc in $((SECONDS - start)) s"
  # The device tool brings back at most 8 files: with ARCHIVE set, everything in $OUT so far is
  # packed into that one file after each step, so a run cut off by its time limit keeps its logs.
  [ -z "${ARCHIVE:-}" ] || tar czf "$ARCHIVE" -C "$OUT" .
}

nvidia-smi -L 2>&1 | tee "$OUT/gpu.txt"
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| triton', triton.__version__, '| transformers', transformers.__version__); print(torch.cuda.get_device_name())" 2>&1 | tee -a "$OUT/gpu.txt"

shapes="smollm2"; { want latency || want throughput; } && shapes="$shapes llama-1b"
FAMILIES="qwen3 gemma3 qwen3-moe"
want families && shapes="$shapes $FAMILIES"
step models models.log $PY benchmarks/gpu_models.py --out "$MODELS" --shapes $shapes
export PAGEDLLM_TEST_TOKENIZER_DIR="$MODELS/tokenizer"

want tests && step kernel-tests kernel_tests.log $PY -m pytest -q -p no:cacheprovider -m gpu -rs \
  tests/test_triton_attention.py tests/test_gpu_memory.py tests/test_cuda_graphs.py

want greedy && step greedy greedy.log $PY benchmarks/gpu_greedy.py --model "$MODELS/smollm2" --output-json "$OUT/greedy.json"

if want spec && [ -n "${SPEC_MODEL:-}" ] && [ -s "$SPEC_MODEL" ]; then
  if ! $PY -c "import gguf" 2>/dev/null; then
    pylib=${PYLIB:-/tmp/gpu_check_pylib}
    $PY -m pip install -q --no-deps --no-index --target "$pylib" "${WHEELS:-results/carry}"/gguf-*.whl 2>&1 | tail -2
    export PYTHONPATH="$PYTHONPATH:$pylib"
  fi
  for mode in ${SPEC_MODES:-graphs eager}; do
    flag=$([ $mode = eager ] && echo --enforce-eager)
    step "spec-$mode" "spec_$mode.log" $PY -m pagedllm bench spec "$SPEC_MODEL" --device cuda --dtype float32 \
      --max-tokens 128 --num-iters 2 $flag --output-json "$OUT/bench_spec_$mode.json"
  done
fi

if [ -n "${QUICK:-}" ]; then
  # transformers' static batches (hf) take minutes on this trace: QUICK compares with its
  # continuous batching (hf-cb), the peer docs/gpu.md quotes.
  CONTEXTS="256 1024 4096"; BATCHES="1 64 256"; PROMPTS=64; LATENCY_BATCHES="1 64"; HF="hf-cb"
else
  CONTEXTS="256 512 1024 2048 4096"; BATCHES="1 8 32 64 128 256"; PROMPTS=200; LATENCY_BATCHES="1 16 64 256"; HF="hf hf-cb"
fi
# The sweep's quick form by default (about a minute); TUNE_FULL=1 tries every shape and bucket.
if want tune; then
  step autotune autotune.log $PY benchmarks/gpu_autotune.py $([ -z "${TUNE_FULL:-}" ] && echo --quick) \
    --output "$OUT/triton_tuning.json" --records "$OUT/triton_tuning_records.json"
  [ -s "$OUT/triton_tuning.json" ] && export PAGEDLLM_TRITON_TUNING="$OUT/triton_tuning.json"
fi

want kernel && step bench-kernel bench_kernel.log $PY -m pagedllm bench kernel --device cuda --contexts $CONTEXTS \
  --batches $BATCHES --max-reference-tokens 16384 --output-json "$OUT/bench_kernel.json"

if want families; then
  for family in $FAMILIES; do
    step "greedy-$family" "greedy_$family.log" $PY benchmarks/gpu_greedy.py --model "$MODELS/$family" \
      --dtypes float32 bfloat16 --max-tokens 16 --output-json "$OUT/greedy_$family.json"
  done
fi

want latency || LATENCY_BATCHES=""
for batch in $LATENCY_BATCHES; do
  for mode in graphs eager; do
    flag=$([ $mode = eager ] && echo --enforce-eager)
    step "latency-$mode-b$batch" "latency_${mode}_b$batch.log" $PY -m pagedllm bench latency "$MODELS/llama-1b" \
      --device cuda --dtype bfloat16 --max-model-len 2048 --batch-size "$batch" --input-len 512 --output-len 64 \
      --num-iters 3 $flag --output-json "$OUT/latency_${mode}_b$batch.json"
  done
done

want throughput && step bench-throughput bench_throughput.log $PY -m pagedllm bench throughput "$MODELS/llama-1b" \
  --device cuda --max-model-len 2048 --num-prompts $PROMPTS --backend pagedllm $HF \
  --output-json "$OUT/bench_throughput.json"


echo
echo "== GPU check summary ($(head -1 "$OUT/gpu.txt"))"
printf '%-20s %-6s %6s  %s\n' step result secs "key line"
for entry in "${status[@]}"; do
  IFS='|' read -r name rc secs log <<<"$entry"
  case $name in
    kernel-tests) key=$(grep -E "passed|failed|error|skipped" "$OUT/$log" | tail -1) ;;
    greedy|greedy-*) key=$(grep -E "^greedy" "$OUT/$log" | sed 's/; [0-9]*\/[0-9]* identical with and.*//' | paste -sd ' ' -) ;;
    autotune) key=$(grep -E "candidates in" "$OUT/$log") ;;
    bench-kernel) key=$($PY - "$OUT/bench_kernel.json" <<'PYEOF' 2>/dev/null
import json, sys
rows = json.load(open(sys.argv[1]))["results"]
at = [r for r in rows if r["context"] == 1024 and r["batch"] == 64]
longest = max(r["context"] for r in rows)
best_long = max(r["paged_pct_of_copy"] for r in rows if r["context"] == longest)
if at:
    r = at[0]
    line = (f"ctx 1024 batch 64: paged {r['paged_ms']:.3f} ms vs sdpa {r['sdpa_ms']:.3f} ms ({r['paged_vs_sdpa']:.2f}x; "
            f"target <= 1.2x); ctx {longest}: best {best_long:.0f}% of copy bandwidth (target >= 60%)")
    if "paged_vs_sdpa_graph" in r:
        best_graph = max(x.get("paged_graph_pct_of_copy", 0) for x in rows if x["context"] == longest)
        line += (f"; from CUDA graphs: {r['paged_graph_ms']:.3f} vs {r['sdpa_graph_ms']:.3f} ms "
                 f"({r['paged_vs_sdpa_graph']:.2f}x), ctx {longest}: {best_graph:.0f}% of copy")
    print(line)
PYEOF
) ;;
    bench-throughput) key=$(grep -E "^(pagedllm|hf|hf-cb):" "$OUT/$log" | paste -sd ' ' -) ;;
    latency-*) key=$(grep -E "^best:" "$OUT/$log") ;;
    spec-*) key=$(grep -E "^ *(grounded|chat) +[0-9]+ +[0-9]+ " "$OUT/$log" | awk '{printf "%s %s->%s tok/s %sx (min %sx); ", $1, $4, $5, $6, $7}'; grep -o "OUTPUTS DIFFER.*" "$OUT/$log") ;;
    *) key="" ;;
  esac
  result=$([ "$rc" = 0 ] && echo ok || echo FAIL)
  printf '%-20s %-6s %6s  %s\n' "$name" "$result" "$secs" "$key"
done
failed=0
for entry in "${status[@]}"; do [ "$(cut -d'|' -f2 <<<"$entry")" = 0 ] || failed=$((failed + 1)); done
exit $failed
