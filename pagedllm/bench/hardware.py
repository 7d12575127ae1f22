"""What this machine can do, measured in the same run as a benchmark: matrix-product FLOP/s
(the compute ceiling of decoding) and memory-copy bandwidth (the ceiling of attention)."""

from __future__ import annotations

import torch

from pagedllm.utils import best_wall_time


def best_time(fn, repeats: int, device: torch.device | str = "cpu") -> float:
    """The fastest of `repeats` timed calls, after one warm-up call. On a GPU each call is timed
    by CUDA events around it (the launch is asynchronous)."""
    if torch.device(device).type == "cuda":
        return _best_cuda_time(fn, repeats)
    return best_wall_time(fn, repeats)


def _best_cuda_time(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def graph_time(fn, repeats: int, calls: int = 20) -> float | None:
    """Seconds of one call of `fn` on a GPU without the host's launch costs: `calls` calls
    captured in one CUDA graph, the fastest of `repeats` replays, over `calls` (what a decode
    step that replays graphs pays). None where `fn` cannot be captured (it waits for the host)."""
    fn()  # outside the capture: compiles kernels, builds what `fn` caches
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except RuntimeError:
        torch.cuda.synchronize()
        return None
    return best_time(graph.replay, repeats, "cuda") / calls


def matmul_flops(dtype: torch.dtype = torch.float32, size: int = 1024, repeats: int = 5,
                 device: torch.device | str = "cpu") -> float:
    """FLOP/s of a size x size x size matrix product: the faster of torch.mm and, in float32 on
    a CPU, the oneDNN product with a packed weight that the engine's projections use (on a GPU,
    at least 8192: a GPU needs that size to be busy)."""
    from pagedllm.kernels import onednn

    if torch.device(device).type == "cuda":
        size = max(size, 8192)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    best = best_time(lambda: torch.mm(a, b), repeats, device)
    if torch.device(device).type == "cuda":
        return 2 * size**3 / best
    packed = onednn.pack(b)
    if packed is not None:
        best = min(best, best_time(lambda: onednn.packed_linear(a, packed), repeats))
    return 2 * size**3 / best


def quantized_matmul_flops(
    rows: int = 64, out_features: int = 3072, in_features: int = 576, repeats: int = 5
) -> float | None:
    """FLOP/s of the engine's quantized kernel (kernels/gguf.py, float32 activations) on a random
    Q4_1 weight of a decode projection's shape, at `rows` rows; None where the C++ kernels are
    unavailable. On a CPU it can outrun torch's float product (the engine's float32 projections
    use it), so a bound taken from torch's rate alone could be beaten."""
    from pagedllm.kernels import build, gguf

    if not build.available():
        return None
    g = torch.Generator().manual_seed(0)
    weight = gguf.random_weight("Q4_1", out_features, in_features, g)
    x = torch.randn(rows, in_features, generator=g)
    return 2 * rows * out_features * in_features / best_time(lambda: gguf.matmul(x, weight), repeats)


def matrix_rate(dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> float:
    """The machine's measured matrix-product rate: matmul_flops, or in float32 on a CPU the
    quantized kernel's where it is faster."""
    flops = matmul_flops(dtype, device=device)
    if torch.device(device).type == "cpu" and dtype == torch.float32:
        flops = max(flops, quantized_matmul_flops() or 0.0)
    return flops


def copy_bandwidth(megabytes: int = 256, repeats: int = 5, device: torch.device | str = "cpu") -> float:
    """Bytes per second moved by a large copy on `device`, reads and writes both counted (on a
    GPU, 4 GiB: well past its caches)."""
    if torch.device(device).type == "cuda":
        megabytes = max(megabytes, 4096)
    src = torch.empty(megabytes << 20, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return 2 * src.numel() / best_time(lambda: dst.copy_(src), repeats, device)


def roofline_fraction(tokens_per_s: float, num_parameters: int, flops: float) -> float:
    """Share of the arithmetic ceiling reached: each token costs 2 FLOPs per parameter."""
    return tokens_per_s * 2 * num_parameters / flops
