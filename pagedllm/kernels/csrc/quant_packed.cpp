// The Q4_1/Q8_0 kernels of quant_matmul.cpp and quant_int8.cpp behind one entry point of
// gguf_matmul's shape, over one flat buffer (`quant.LegacyPacked`): the values, then the float32
// scales, then (Q4_1) the float32 minimums. The fused decoder calls it for the parts whose
// method chose these kernels (kernels/quant.py says why).
#include <cstdint>

extern "C" {
void quant_matmul_f32(float* y, const float* x, const uint8_t* values, const float* scales, const float* mins,
                      int num_rows, int out_features, int in_features, int num_threads);
void quant_matmul_int8(float* y, const float* x, const uint8_t* values, const float* scales, const float* mins,
                       int num_rows, int out_features, int in_features, int num_threads);

void quant_matmul_packed(int qtype_id, float* y, const float* x, const uint8_t* packed, int64_t rows,
                         int64_t out_features, int64_t in_features, int num_threads, int use_int8) {
  const bool q4_1 = qtype_id == 3;  // else Q8_0 (8)
  const int64_t value_bytes = q4_1 ? out_features * in_features / 2 : out_features * in_features;
  const float* scales = reinterpret_cast<const float*>(packed + value_bytes);
  const float* mins = q4_1 ? scales + out_features * in_features / 32 : nullptr;
  auto kernel = use_int8 ? quant_matmul_int8 : quant_matmul_f32;
  kernel(y, x, packed, scales, mins, static_cast<int>(rows), static_cast<int>(out_features),
         static_cast<int>(in_features), num_threads);
}
}
