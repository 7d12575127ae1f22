"""A Llama-3.2-1B layer's seven Q4_K projections (q, k, v, o, gate, up, down; random blocks) timed
through each way gguf_matmul has on this CPU (the AMX ones where it has AMX), at the row counts given: the FMA float way (path
'avx512'), the float way on AMX tiles (path 'amx': exact operands from 8 to 31 rows, the two
bfloat16 halves from 32), and int8 activations by AVX-512 VNNI (path 'avx512'; Q4_K: x per 256,
the sub-block scales applied to integer sums) and on the AMX-INT8 tiles (Q4_K: x per 256, csrc/gguf_amx_q8k.h). Best of three, torch's thread count. The
source of the figures in docs/gguf-kernels.md and docs/paper.md.

    python benchmarks/gguf_amx_ways.py 1 8 16 32 128
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from pagedllm.bench.hardware import best_time  # noqa: E402
from pagedllm.bench.report import cpu_description  # noqa: E402
from pagedllm.kernels import gguf  # noqa: E402

SHAPES = [(2048, 2048), (512, 2048), (512, 2048), (2048, 2048), (8192, 2048), (8192, 2048), (2048, 8192)]
WAYS = (("avx512", "avx512", False), ("amx", "amx", False), ("int8-vnni", "avx512", True), ("int8-amx", "amx", True))


def main(rows_list: list[int]) -> int:
    isas = gguf.available_isas()
    if "avx512" not in isas:
        print("this CPU has no AVX-512 VNNI: nothing to compare")
        return 1
    ways = [way for way in WAYS if way[1] in isas]
    gen = torch.Generator().manual_seed(0)
    weights = [gguf.random_weight("Q4_K", n, k, gen) for n, k in SHAPES]
    for rows in rows_list:
        xs = {k: torch.randn(rows, k, generator=gen) for k in (2048, 8192)}
        times = {}
        for label, isa, int8 in ways:
            gguf.set_isa(isa)
            times[label] = best_time(lambda: [gguf.matmul(xs[w.in_features], w, int8=int8) for w in weights], 3) * 1e3
        gguf.set_isa(None)
        print(f"rows {rows:3d}: " + "  ".join(f"{k} {v:6.2f} ms" for k, v in times.items()), flush=True)
    print(f"threads: {torch.get_num_threads()}; CPU: {cpu_description()[0]} ({' '.join(cpu_description()[1])}); gguf paths: {', '.join(isas)}")
    return 0


if __name__ == "__main__":
    sys.exit(main([int(r) for r in sys.argv[1:]] or [1, 8, 16, 32, 128]))
