"""The native GGUF kernels (kernels/gguf.py, csrc/gguf_matmul.cpp): for every block type and
every ISA path this machine runs, products against gguf-py's dequantization of the same blocks
followed by a float64 product, the int8 path against the float64 product of the activations it
quantized, dequantize_rows bit for bit gguf-py's, and pack/from_data."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from pagedllm.kernels import gguf as kernels

TYPES = list(kernels.GGUF_TYPES)
ISAS = kernels.available_isas()
# 1..64 rows (decode steps) and a prompt; out_features not a multiple of 16; legacy types with a
# row of 11 blocks (the kernels take 8 at a time, then pairs, then a lone one; 352 weights, not a
# multiple of 64), K-quants with two super-blocks.
ROWS = list(range(1, 65)) + [300]
OUT_FEATURES = 45
EPS32 = float(np.finfo(np.float32).eps)


def in_features(qtype: str) -> int:
    return 512 if kernels.GGUF_TYPES[qtype][0] == 256 else 352


def gguf_dense(w: kernels.PackedWeight) -> np.ndarray:
    """gguf-py's float32 weights of the same blocks."""
    return quants.dequantize(w.data.numpy(), getattr(GGMLQuantizationType, w.qtype))


@pytest.fixture(autouse=True)
def one_thread():
    """Hundreds of tiny products: one thread each (on a loaded machine, an OpenMP team's barrier
    waits for a descheduled thread); test_threads_split_the_rows_without_changing_a_bit runs two."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=ISAS)
def isa(request):
    kernels.set_isa(request.param)
    yield request.param
    kernels.set_isa(None)


def weight(qtype: str, seed: int = 0) -> kernels.PackedWeight:
    return kernels.random_weight(qtype, OUT_FEATURES, in_features(qtype), torch.Generator().manual_seed(seed))


class Reference:
    """x64 @ w64.T and its float32-accumulation bound (a multiple of eps times the sum of |w x|),
    computed once for the most rows; a product of the first `rows` rows compares to its rows."""

    def __init__(self, x64: np.ndarray, w64: np.ndarray):
        self.expected = x64 @ w64.T
        self.bound = 64 * EPS32 * (np.abs(x64) @ np.abs(w64).T) + 1e-30

    def check(self, y: torch.Tensor, extra: np.ndarray | float = 0.0) -> None:
        rows = y.shape[0]
        err = np.abs(y.double().numpy() - self.expected[:rows])
        bound = self.bound[:rows] + (extra if np.isscalar(extra) else extra[:rows])
        assert (err <= bound).all(), f"{rows} rows: worst error {err.max():.3e} at bound {bound.flat[err.argmax()]:.3e}"


@pytest.mark.parametrize("qtype", TYPES)
def test_float_product_matches_gguf_dequantize_then_float64(qtype, isa):
    w = weight(qtype)
    x = torch.randn(max(ROWS), w.in_features, generator=torch.Generator().manual_seed(1))
    reference = Reference(x.double().numpy(), gguf_dense(w).astype(np.float64))
    for rows in ROWS:
        reference.check(kernels.matmul(x[:rows], w))


@pytest.mark.parametrize("qtype", TYPES)
def test_int8_product_is_the_float64_product_of_its_quantized_activations(qtype, isa):
    w = weight(qtype, seed=2)
    w64 = gguf_dense(w).astype(np.float64)
    x = torch.randn(max(ROWS), w.in_features, generator=torch.Generator().manual_seed(3))
    q, d = kernels.quantize_activations(x, qtype)  # per row: the first rows of x quantize alike
    xq = (q.double().numpy().reshape(len(x), -1, 32) * d.double().numpy()[..., None]).reshape(len(x), -1)
    quantized, exact = Reference(xq, w64), Reference(x.double().numpy(), w64)
    # each activation moves by at most half its block's step
    half_steps = 1.001 * np.repeat(d.double().numpy() / 2, 32, axis=1) @ np.abs(w64).T
    for rows in ROWS:
        y = kernels.matmul(x[:rows], w, int8=True)
        quantized.check(y)
        exact.check(y, extra=half_steps)


@pytest.mark.parametrize("qtype, block", [("Q8_0", 32), ("Q4_0", 32), ("Q4_K", 256), ("Q6_K", 256)])
def test_activations_are_quantized_per_block_to_127_steps(qtype, block):
    """Per 32 for the legacy types, per 256 for the K-quants (llama.cpp's Q8_0 and Q8_K)."""
    x = torch.randn(3, 768, generator=torch.Generator().manual_seed(4))
    x[1, 300] = 40.0  # an outlier: its whole block (and only it) takes a coarser step
    assert kernels.activation_block(qtype) == block
    q, d = kernels.quantize_activations(x, qtype)
    blocks = x.view(3, 768 // block, block)
    step = blocks.abs().amax(-1) / 127
    assert torch.allclose(d, step.repeat_interleave(block // 32, dim=1), rtol=1e-6)
    assert int(q.abs().max()) == 127
    assert torch.all((q.view(3, -1, block) * step[..., None] - blocks).abs() <= step[..., None] / 2 * 1.0001)
    with pytest.raises(ValueError, match="per 256"):
        kernels.quantize_activations(torch.randn(2, 96), "Q4_K")


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K"])
def test_int8_product_of_an_odd_number_of_super_blocks(qtype, isa):
    """Three super-blocks a row: the AMX way (csrc/gguf_amx_q8k.h) takes them two at a time."""
    gen = torch.Generator().manual_seed(12)
    w = kernels.random_weight(qtype, 33, 768, gen)
    w64 = gguf_dense(w).astype(np.float64)
    x = torch.randn(40, 768, generator=gen)
    q, d = kernels.quantize_activations(x, qtype)
    xq = (q.double().numpy().reshape(len(x), -1, 32) * d.double().numpy()[..., None]).reshape(len(x), -1)
    reference = Reference(xq, w64)
    for rows in (1, 4, 5, 16, 17, 40):
        reference.check(kernels.matmul(x[:rows], w, int8=True))


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_rows_is_gguf_dequantize_bit_for_bit(qtype):
    w = weight(qtype, seed=5)
    dense = gguf_dense(w)
    assert np.array_equal(kernels.dequantize_rows(w).numpy(), dense)
    rows = torch.tensor([44, 0, 7, 7])
    assert np.array_equal(kernels.dequantize_rows(w, rows).numpy(), dense[rows.numpy()])


@pytest.mark.parametrize("bad", [-1, OUT_FEATURES, 10**9])
def test_dequantize_rows_refuses_an_index_outside_the_table(bad):
    """The lookup's bounds are checked in the kernel (no tensor operations on the decode path):
    a bad token id is a clear error and nothing is read outside the weight."""
    w = weight("Q8_0", seed=5)
    with pytest.raises(ValueError, match=rf"rows must be in \[0, {OUT_FEATURES}\)"):
        kernels.dequantize_rows(w, torch.tensor([3, bad, 5]))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_blocks_from_gguf_quantizer(qtype, isa):
    """Blocks written by gguf-py's own quantizer, not only random bytes."""
    gen = torch.Generator().manual_seed(6)
    dense = torch.randn(OUT_FEATURES, 96, generator=gen).numpy()
    raw = quants.quantize(dense, getattr(GGMLQuantizationType, qtype))
    w = kernels.pack(qtype, torch.from_numpy(raw), 96)
    x = torch.randn(5, 96, generator=gen)
    Reference(x.double().numpy(), gguf_dense(w).astype(np.float64)).check(kernels.matmul(x, w))


@pytest.mark.parametrize("qtype", TYPES)
def test_pack_keeps_the_file_bytes_and_from_data_rebuilds_it(qtype):
    w = weight(qtype, seed=7)
    bw, nbytes = kernels.GGUF_TYPES[qtype]
    assert w.nbytes == OUT_FEATURES * w.in_features // bw * nbytes  # the file's size, no float copy
    again = kernels.from_data(qtype, w.out_features, w.in_features, w.data.clone())
    x = torch.randn(3, w.in_features)
    assert torch.equal(kernels.matmul(x, again), kernels.matmul(x, w))
    assert torch.equal(kernels.pack(qtype, w.data.flatten(), w.in_features).data, w.data)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0", "Q4_1", "Q5_0"])
@pytest.mark.parametrize("int8", [False, True])
def test_threads_split_the_rows_without_changing_a_bit(isa, int8, qtype):
    """Nor does where a row of W sits: the few-rows int8 way takes rows of W four at a time
    (csrc/gguf_vnni_wrows.h), and a table that starts a row later groups every row otherwise."""
    w = kernels.random_weight(qtype, 301, 512, torch.Generator().manual_seed(8))
    shifted = kernels.from_data(qtype, 299, 512, w.data[1:300].clone())
    for rows in (1, 2, 7, 40):
        x = torch.randn(rows, 512)
        alone = kernels.matmul(x, w, int8)
        assert torch.equal(kernels.matmul(x, shifted, int8), alone[:, 1:300])
        torch.set_num_threads(2)
        assert torch.equal(kernels.matmul(x, w, int8), alone)
        torch.set_num_threads(1)


@pytest.mark.skipif("amx" not in ISAS, reason="this CPU (or its kernel) gives no AMX tiles: the path is not built or not granted")
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K"])
def test_amx_exact_way_of_8_to_31_rows_is_float32_exact_and_row_independent(qtype):
    """Products of 8-31 rows of the types with one scale per 32 weights run on AMX tiles with
    exact operands (csrc/amx_exact.h): their error stays within 4 float32 roundings of sum |w x|
    (the FMA ways' bound here is 64; the two-halves way of 32 rows and more is about 25 on this
    data), and a row's bits do not depend on the rows that share its product."""
    kernels.set_isa("amx")
    try:
        w = weight(qtype, seed=5)
        x = torch.randn(31, w.in_features, generator=torch.Generator().manual_seed(5))
        x64, w64 = x.double().numpy(), gguf_dense(w).astype(np.float64)
        full = kernels.matmul(x, w)
        err = np.abs(full.double().numpy() - x64 @ w64.T)
        assert (err <= 4 * EPS32 * (np.abs(x64) @ np.abs(w64).T) + 1e-30).all()
        for start, rows in ((0, 8), (3, 16), (5, 17), (20, 11)):
            assert torch.equal(kernels.matmul(x[start : start + rows], w), full[start : start + rows])
    finally:
        kernels.set_isa(None)


@pytest.mark.skipif("amx" not in ISAS, reason="this CPU (or its kernel) gives no AMX tiles: the path is not built or not granted")
def test_amx_path_gives_back_another_librarys_tiles():
    """oneDNN (torch's bfloat16 products) keeps its own tile configuration on the same threads:
    after an AMX product (float32 on AMX-BF16, both ways; int8 on AMX-INT8), its products still run and give
    the same result, on one thread and two."""
    gen = torch.Generator().manual_seed(9)
    a, b = torch.randn(64, 512, generator=gen).bfloat16(), torch.randn(512, 256, generator=gen).bfloat16()
    w = kernels.random_weight("Q4_K", 96, 512, gen)
    x = torch.randn(64, 512, generator=gen)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        before, y, y8, y16 = a @ b, kernels.matmul(x, w), kernels.matmul(x, w, int8=True), kernels.matmul(x[:16], w)
        for _ in range(3):
            assert torch.equal(a @ b, before)
            assert torch.equal(kernels.matmul(x, w), y)
            assert torch.equal(a @ b, before)
            assert torch.equal(kernels.matmul(x[:16], w), y16)  # the exact way's tiles
            assert torch.equal(a @ b, before)
            assert torch.equal(kernels.matmul(x, w, int8=True), y8)
    assert kernels.isa() == "amx"


def test_isa_paths_are_selectable():
    assert kernels.isa() == ISAS[-1]
    kernels.set_isa("portable")
    try:
        assert kernels.isa() == "portable"
    finally:
        kernels.set_isa(None)
    with pytest.raises(ValueError, match="isa"):
        kernels.set_isa("neon")


def test_the_environment_variable_forces_a_path():
    import os
    import subprocess
    import sys

    env = {**os.environ, "PAGEDLLM_GGUF_ISA": "portable"}
    out = subprocess.run([sys.executable, "-c", "from pagedllm.kernels import gguf; print(gguf.isa())"],
                         env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "portable"


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="qtype"):
        kernels.pack("IQ2_XS", torch.zeros(1, 74, dtype=torch.uint8), 256)
    with pytest.raises(ValueError, match="in_features"):
        kernels.pack("Q4_K", torch.zeros(1, 144, dtype=torch.uint8), 100)
    w = weight("Q4_0")
    with pytest.raises(ValueError, match="x must be"):
        kernels.matmul(torch.zeros(2, 32), w)
    with pytest.raises(ValueError, match="cached data"):
        kernels.from_data("Q4_0", 44, 96, w.data)


def test_the_peak_loop_and_the_read_loop_report_their_work():
    """The benchmark's bounds: the int8 peak loop counts 8 chains of its instruction's
    multiply-adds per iteration and thread, and the read loop reads every byte (its checksum moves
    with any byte of the buffer)."""
    from pagedllm.kernels.build import load

    lib = load()
    per_instruction = {"avx2": 32, "avx512": 64, "amx": 64}.get(kernels.isa(), 0)
    assert lib.gguf_int8_peak(1000, 2) == 2 * 1000 * 8 * per_instruction
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    base = lib.gguf_read_sum(buf.data_ptr(), buf.numel(), 2)
    for at in (0, 255, 30000, (1 << 16) - 1):
        buf[at] = 1
        assert lib.gguf_read_sum(buf.data_ptr(), buf.numel(), 2) != base, at
        buf[at] = 0
    assert kernels.read_bandwidth(16, threads=1, repeats=1) > 0
    if per_instruction:
        assert kernels.int8_peak(threads=1, seconds=0.01) > 0


def test_the_int8_way_of_a_row_count_is_chosen_per_type():
    """Where a path has two int8 ways (AVX-512, AMX: its own and the AVX2 one), set_int8_way
    sends a type's products of a bucket of row counts to the one chosen, whose outputs are then
    the AVX2 path's bit for bit; other buckets and types keep the path's own. A way the path does
    not have is refused."""
    gen = torch.Generator().manual_seed(13)
    w = kernels.random_weight("Q4_K", 40, 512, gen)
    x = torch.randn(9, 512, generator=gen)
    with pytest.raises(ValueError, match="int8 way"):
        kernels.set_int8_way("Q4_K", 8, "sse")
    for path in ISAS:
        kernels.set_isa(path)
        ways = kernels.int8_ways()
        assert ways == {"portable": ["portable"], "avx2": ["avx2", "avx2_rows"]}.get(path) or \
            ways == [{"avx512": "vnni", "amx": "amx"}[path], "avx2", "avx2_rows"]
        if path in ("portable", "avx2"):
            kernels.set_int8_way("Q4_K", 8, ways[0])
            assert kernels.int8_way("Q4_K", 8) == ways[0]
            continue
        assert kernels.int8_ways("Q3_K") == ["avx2", "avx2_rows"]  # (the VNNI and AMX ways do not decode it)
        # (an earlier test's trial may have set other buckets: they keep whatever they had)
        before = [kernels.int8_way("Q4_K", 7), kernels.int8_way("Q4_K", 16), kernels.int8_way("Q6_K", 8)]
        try:
            kernels.set_int8_way("Q4_K", 8, "avx2")  # 8-15 rows
            assert [kernels.int8_way("Q4_K", r) for r in (7, 8, 15, 16)] == [before[0], "avx2", "avx2", before[1]]
            assert kernels.int8_way("Q6_K", 8) == before[2] and kernels.int8_way("Q3_K", 1) == "avx2"
            chosen = kernels.matmul(x, w, int8=True)
            kernels.set_isa("avx2")
            assert torch.equal(chosen, kernels.matmul(x, w, int8=True))
        finally:
            kernels.set_isa(path)
            kernels.set_int8_way("Q4_K", 8, ways[0])
    kernels.set_isa(None)


@pytest.mark.parametrize("qtype", TYPES)
def test_rows_alone_is_the_same_int8_product(qtype, isa):
    """The AVX2 way with every row of x alone ("avx2_rows": W decoded in registers, taken by each
    row) multiplies the same quantized activations: the float64 product of them, within float32
    accumulation, at every row count, for the bucket it is set on only."""
    if "avx2_rows" not in kernels.int8_ways(qtype):
        pytest.skip(f"{qtype} on the {isa} path has no avx2_rows int8 way to compare (the portable path and some "
                    "types have only one)")
    w = weight(qtype, seed=21)
    w64 = gguf_dense(w).astype(np.float64)
    x = torch.randn(100, w.in_features, generator=torch.Generator().manual_seed(22))
    q, d = kernels.quantize_activations(x, qtype)
    xq = (q.double().numpy().reshape(len(x), -1, 32) * d.double().numpy()[..., None]).reshape(len(x), -1)
    reference = Reference(xq, w64)
    own = kernels.int8_ways(qtype)[0]
    try:
        for rows in (2, 3, 5, 9, 64, 100):
            kernels.set_int8_way(qtype, rows, "avx2_rows")
            assert kernels.int8_way(qtype, rows) == "avx2_rows"
            reference.check(kernels.matmul(x[:rows], w, int8=True))
        kernels.set_int8_way(qtype, 2, own)
        assert kernels.int8_way(qtype, 2) == own and kernels.int8_way(qtype, 4) == "avx2_rows"
    finally:
        for rows in kernels.INT8_WAY_BUCKETS:
            kernels.set_int8_way(qtype, rows, own)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q6_K", "Q4_K", "Q4_0"])
@pytest.mark.parametrize("int8", [False, True])
def test_the_heads_greedy_tokens_are_the_product_then_greedy_rows_bitwise(qtype, int8):
    """matmul_sample without draws (an LM head's product with each row's greedy token and
    log-probability, every part reduced as the product wrote it): the product bitwise matmul's,
    the tokens and log-probabilities bitwise ops.greedy_rows' of it, at any thread count, for a
    vocabulary of whole parts, one with a short last part and one below a part, one row and
    batches that take the tiled and (where the CPU has it) AMX ways."""
    from pagedllm.kernels import ops

    previous = torch.get_num_threads()
    try:
        for out_features in (2 * 8192, 3 * 8192 + 1000, 3000):
            w = kernels.random_weight(qtype, out_features, 256, torch.Generator().manual_seed(out_features))
            for rows in (1, 3, 20):
                x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
                for threads in (1, 2, 3):
                    torch.set_num_threads(threads)
                    y, token_ids, logprobs = kernels.matmul_sample(x, w, int8=int8)
                    product = kernels.matmul(x, w, int8=int8)
                    assert torch.equal(y, product), (out_features, rows, threads)
                    assert (token_ids, logprobs) == ops.greedy_rows(product), (out_features, rows, threads)
                    assert token_ids == product.argmax(dim=-1).tolist()
    finally:
        torch.set_num_threads(previous)


def _draws(rows: int, vocab: int, seed: int) -> kernels.Draws:
    """Mixed rows: greedy ones (top_k 0) and top-k draws of every kind: k of 1, a few, more than a
    part holds and just below the vocabulary, with and without top-p and min-p, hot and cold."""
    g = torch.Generator().manual_seed(seed)
    ks = [0, 1, 5, 40, 9000, vocab - 1]
    top_k = torch.tensor([ks[r % len(ks)] if ks[r % len(ks)] < vocab else 7 for r in range(rows)], dtype=torch.int64)
    temperature = torch.tensor([(0.6, 1.0, 1.4)[r % 3] for r in range(rows)], dtype=torch.float32)
    top_p = torch.tensor([(1.0, 0.9, 0.5, 1.0)[r % 4] for r in range(rows)], dtype=torch.float32)
    min_p = torch.tensor([(0.0, 0.0, 0.05)[r % 3] for r in range(rows)], dtype=torch.float32)
    return kernels.Draws(temperature, top_k, top_p, min_p, torch.rand(rows, generator=g))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q6_K", "Q4_K"])
@pytest.mark.parametrize("int8", [False, True])
def test_the_heads_top_k_draws_are_the_product_then_the_filtered_sampler(qtype, int8):
    """matmul_sample with draws: each top-k row's token is the one ops.sample_filtered_rows draws
    from the product (its temperature, k, top-p, min-p and uniform number), its log-probability
    the product's logit minus ops.logsumexp_rows', bitwise; greedy rows beside them stay
    greedy_rows'. The parts keep candidates of their own: k above a part's width, a row of x = 0
    (every logit tied: top-k keeps the ties, so every token) and several thread counts are in."""
    from pagedllm.kernels import ops

    previous = torch.get_num_threads()
    try:
        for out_features in (3 * 8192 + 1000, 3000):
            w = kernels.random_weight(qtype, out_features, 256, torch.Generator().manual_seed(out_features))
            for rows in (1, 7, 13):
                x = 3 * torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
                if rows > 1:
                    x[rows // 2] = 0.0
                draws = _draws(rows, out_features, seed=rows)
                if rows == 1:
                    draws = draws._replace(top_k=torch.tensor([40]))
                for threads in (1, 2, 3):
                    torch.set_num_threads(threads)
                    y, token_ids, logprobs = kernels.matmul_sample(x, w, int8, draws)
                    product = kernels.matmul(x, w, int8=int8)
                    assert torch.equal(y, product)
                    greedy_ids, greedy_logprobs = ops.greedy_rows(product)
                    drawn = ops.sample_filtered_rows(product, draws.temperature, draws.top_k.tolist(), draws.top_p.tolist(),
                                                     draws.min_p.tolist(), draws.uniform).tolist()
                    log_norm = ops.logsumexp_rows(product).squeeze(1)
                    for r in range(rows):
                        if draws.top_k[r] == 0:
                            assert (token_ids[r], logprobs[r]) == (greedy_ids[r], greedy_logprobs[r])
                        else:
                            assert token_ids[r] == drawn[r], (out_features, rows, r, threads)
                            assert logprobs[r] == (product[r, drawn[r]] - log_norm[r]).item()
        # Draws the head cannot make are refused, naming what is wrong.
        with pytest.raises(ValueError, match="top_k in"):
            kernels.matmul_sample(x, w, int8, draws._replace(top_k=torch.full((rows,), out_features)))
    finally:
        torch.set_num_threads(previous)


def test_the_heads_top_k_draws_follow_the_uniform_number():
    """A top-k draw is the inverse of the kept tokens' distribution at u: over many u, the
    tokens drawn are the k most likely ones only, and every one of them is drawn (k = 4 of a
    random head's logits)."""
    w = kernels.random_weight("Q8_0", 3000, 256, torch.Generator().manual_seed(5))
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(6))
    product = kernels.matmul(x, w)
    top4 = set(product[0].topk(4).indices.tolist())
    seen = set()
    for u in torch.linspace(0.0, 0.999, 200).tolist():
        draws = kernels.Draws(*(torch.tensor([v], dtype=d) for v, d in
                                ((1.0, torch.float32), (4, torch.int64), (1.0, torch.float32), (0.0, torch.float32),
                                 (u, torch.float32))))
        seen.add(kernels.matmul_sample(x, w, False, draws)[1][0])
    assert seen == top4
