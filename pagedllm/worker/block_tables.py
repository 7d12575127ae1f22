"""Block tables as the kernels read them: one int32 row per sequence."""

from __future__ import annotations

import numpy as np


def block_table_array(tables: list[list[int | None]], num_rows: int | None = None, width: int | None = None) -> np.ndarray:
    """[num_rows (len(tables)), width (the longest)] int32 block tables. Freed entries (None:
    before a sliding window, always a leading run) and the padding past a short table or past
    the tables hold block 0, which no kernel reads."""
    array = np.zeros((num_rows or len(tables), width or max(map(len, tables))), dtype=np.int32)
    for i, table in enumerate(tables):
        if table and table[0] is None:
            freed = table.count(None)
            array[i, freed : len(table)] = table[freed:]
        else:
            array[i, : len(table)] = table
    return array
