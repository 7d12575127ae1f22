// The C ABI of the native GGUF kernels (gguf_matmul.cpp), for the other kernels that call them
// (the fused decoder) and for kernels/build.py's ctypes signatures.
#pragma once

#include <cstdint>

extern "C" {
// y [rows, out_features] float32 = x [rows, in_features] float32 times W^T, W the GGUF blocks of
// type qtype_id (ggml's GGMLQuantizationType id: Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q4_K 12,
// Q5_K 13, Q6_K 14) in `packed` (kernels/gguf.py's PackedWeight.data: out_features rows of
// in_features / weights-per-block blocks). use_int8: x quantized per block of 32 (VNNI).
void gguf_matmul(int qtype_id, float* y, const float* x, const uint8_t* packed, int64_t rows, int64_t out_features,
                 int64_t in_features, int num_threads, int use_int8);
int gguf_dequantize_rows(int qtype_id, float* out, const uint8_t* packed, const int64_t* indices, int64_t num_indices,
                         int64_t num_rows, int64_t in_features, int num_threads);
void gguf_quantize_activations(int qtype_id, int8_t* qx, float* dx, const float* x, int64_t rows, int64_t in_features);
int gguf_isa();
int gguf_best_isa();
int gguf_set_isa(int isa);
}
