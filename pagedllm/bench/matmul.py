"""`pagedllm bench matmul`: every projection of one decode step of the default model (each
layer's fused qkv, o, gate_up and down, and the LM head), on its real weights, for a range of
input row counts (sequences decoding together), through the three paths a layer can take
(`pagedllm.model.layers.linear`):

- the quantized kernel (`kernels/gguf.py`) reads the GGUF blocks (Q4_1: 0.75 bytes per weight,
  against 4 for float32). With few rows a step is bound by reading the weights, so it wins; with
  many, its tiled way (expanded weights broadcast against transposed panels of x) runs at the float
  products' rate or above. It serves every float32 product of a model that has the blocks; the
  table marks a row count where another path overtakes it, should one.
- the oneDNN product with the weight packed once at load time (`kernels/onednn.py`), the
  float32 path of models without quantized blocks;
- plain `F.linear` (MKL sgemm), which re-packs the weight on every call and is slow on the
  skinny products of decoding: the reason float32 projections go through packed oneDNN.
- `quant_no_amx` (on CPUs with AMX): the quantized kernel on its AVX-512 path (`gguf.set_isa`),
  no tiles at any row count: what the tiles (csrc/gguf_amx*.h) buy; informational, as the
  `quant` column takes the tiles where they pay.
- `int8`: the quantized blocks times int8-quantized activations (`int8_activations`), on the
  CPU's integer dot products (VNNI, or AVX2's VPMADDUBSW; the table's header names which): not
  float32's outputs, so it is not in the race; its column shows what it would buy.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from pagedllm.bench.hardware import best_time
from pagedllm.bench.report import format_table, write_json

PATHS = ("quant", "onednn", "linear", "quant_no_amx", "int8")
FLOAT_PATHS = PATHS[:3]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("matmul", help="one decode step's projections: quantized kernel vs packed oneDNN vs F.linear")
    p.add_argument("--model", default=None, help="GGUF model (default: the embedded SmolLM2-135M)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 14, 15, 16, 24, 32, 64])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--output-json", default="results/bench_matmul.json")
    p.set_defaults(func=run)


def step_layers(model) -> list[torch.nn.Module]:
    """The projection layers of one decode step, in the order the model applies them."""
    from pagedllm.model.quant import layer_of

    return [layer_of(model, w) for w in model.step_projection_weights()]


def _without_amx(fn):
    from pagedllm.kernels import gguf

    def run(xs):
        path = gguf.isa()  # (the best, or what PAGEDLLM_GGUF_ISA forced)
        gguf.set_isa("avx512")
        try:
            return fn(xs)
        finally:
            gguf.set_isa(path)

    return run


def path_fns(layers) -> dict:
    """Each path as fn(inputs by in_features) -> None running every projection once; the
    quantized kernel is called directly. The float paths multiply by dequantized copies made
    here (a GGUF-packed model holds none)."""
    from pagedllm.kernels import gguf, onednn

    floats = [m.quant_method.to_float(m).contiguous() for m in layers]
    in_features = [w.shape[1] for w in floats]

    def step(product, weights):
        return lambda xs: [product(xs[k], w) for k, w in zip(in_features, weights)]

    fns = {"linear": step(F.linear, floats)}
    if all(len(m.quant_method.fused_parts or ()) == 1 for m in layers):  # one packed GGUF part each
        packed = [m.quant_method.parts[0] for m in layers]
        fns["quant"] = step(gguf.matmul, packed)
        fns["int8"] = step(lambda x, w: gguf.matmul(x, w, int8=True), packed)
        if gguf.isa() == "amx":
            fns["quant_no_amx"] = _without_amx(fns["quant"])
    reordered = onednn.pack_all(floats)
    if all(w is not None for w in reordered):
        fns["onednn"] = step(onednn.packed_linear, reordered)
    return fns, floats


def run(args: argparse.Namespace) -> int:
    from pagedllm.attention.reference import ReferenceAttentionBackend
    from pagedllm.kernels import gguf
    from pagedllm.model import load_model
    from pagedllm.transformers_utils import resolve_model

    model = load_model(resolve_model(args.model), 64, ReferenceAttentionBackend(), torch.float32, torch.device("cpu"))
    layers = step_layers(model)
    fns, weights = path_fns(layers)
    flops_per_row = 2 * sum(w.numel() for w in weights)
    qtypes = sorted({q for m in layers for q in getattr(m.quant_method, "qtypes", [])})
    print(f"{len(weights)} projections per step, {flops_per_row / 2e6:.1f}M weights ({', '.join(qtypes) or 'not quantized'}); "
          f"paths: {', '.join(p for p in PATHS if p in fns)}; quantized kernels: {gguf.ISA_NAMES[gguf.isa()]}")

    gen = torch.Generator().manual_seed(0)
    rows = []
    with torch.inference_mode():
        for n in sorted(set(args.rows)):
            xs = {k: torch.randn(n, k, generator=gen) for k in {w.shape[1] for w in weights}}
            row = {"rows": n}
            for path in PATHS:
                if path in fns:
                    t = best_time(lambda: fns[path](xs), args.repeats)
                    row[f"{path}_ms"] = t * 1e3
                    row[f"{path}_GFLOPs"] = n * flops_per_row / t / 1e9
            row["fastest"] = min((p for p in FLOAT_PATHS if f"{p}_ms" in row), key=lambda p: row[f"{p}_ms"])
            rows.append(row)
            print(f"rows {n:3d}: " + ", ".join(f"{p} {row[f'{p}_ms']:.2f} ms" for p in PATHS if p in fns), flush=True)

    # Where the quantized kernel stops being fastest: the row count after the last one it wins
    # (None if it wins the largest), so that a noisy loss at a few rows does not move the mark.
    crossover = None
    if "quant" in fns:
        wins = [i for i, r in enumerate(rows) if r["fastest"] == "quant"]
        last = wins[-1] if wins else -1
        crossover = rows[last + 1]["rows"] if last + 1 < len(rows) else None
    for r in rows:
        r["note"] = "<- quant overtaken" if r["rows"] == crossover else ""
    columns = ["rows", *(f"{p}_ms" for p in PATHS if p in fns), *(f"{p}_GFLOPs" for p in PATHS if p in fns), "fastest", "note"]
    print(format_table(rows, columns))
    if "quant" not in fns:
        print("the model has no quantized blocks: no quantized kernel to compare")
    elif crossover is None:
        print("the quantized kernel is fastest at every row count measured (it serves every float32 product)")
    else:
        print(f"the quantized kernel stops being fastest at {crossover} rows (it serves every float32 product: "
              "see quant.GGUFLinear)")
    config = {k: v for k, v in vars(args).items() if k != "func"}
    config.update(quant_overtaken_at=crossover, isa=gguf.isa(),
                  num_projections=len(weights), flops_per_row=flops_per_row)
    path = write_json(args.output_json, "matmul", config, rows)
    print(f"wrote {path}")
    return 0
