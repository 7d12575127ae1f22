"""CPU kernels in C++ (PagedAttention, quantized matmul), built on first use and called with ctypes."""
