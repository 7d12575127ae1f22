"""The figures of the paper's evaluation (section 6), by number.

Each `figN(ctx)` runs what its figure needs, draws `figN_<tag>.png` and returns its data with a
`summary`: rows of (quantity, the paper's number, ours, target met or not) for the report. The
tag is the profile (`a100-opt13b`, `cpu`) or `real`. What they share (the `Context`, the
paper's numbers, sustained rates) is in `context.py`; the figures themselves in
`memory_figures.py` (2, 11, 12, 13), `decoding_figures.py` (14, 15, 16, 18b, 19) and, on the
real clock, `real_figures.py`.
"""

from __future__ import annotations

from pagedllm.bench.paper.decoding_figures import fig14, fig15, fig16, fig18, fig19
from pagedllm.bench.paper.memory_figures import fig2, fig11, fig12, fig13

FIGURES = {
    "2": fig2, "11": fig11, "12": fig12, "13": fig13, "14": fig14, "15": fig15, "16": fig16, "18b": fig18, "19": fig19,
}
