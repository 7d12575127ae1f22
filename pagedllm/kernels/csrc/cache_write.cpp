// Writing a step's new keys and values into the paged KV cache: each token goes to its slot
// (block * block_size + offset), for every KV head, converting to the pool's element type.
// Plain C++ called through ctypes, like paged_attention.cpp, whose pool layout it shares.

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "attention_tiles.h"

namespace {

using namespace paged_attention_tiles;

template <typename S, typename T>
inline void store_row(const S* src, T* dst, int n) {
  if constexpr (std::is_same_v<S, T>) {
    std::memcpy(dst, src, sizeof(T) * n);
  } else {
    for (int i = 0; i < n; ++i) from_float(to_float(src[i]), dst + i);
  }
}

// S: the type of the new keys and values; T: the type of the pools.
template <typename S, typename T>
void write_kv(const S* key, const S* value, T* key_cache, T* value_cache, int64_t block_stride, int64_t head_stride,
              const int64_t* slot_mapping, int num_tokens, int num_kv_heads, int head_dim, int block_size) {
  for (int t = 0; t < num_tokens; ++t) {
    const int64_t slot = slot_mapping[t];
    const int64_t base = (slot / block_size) * block_stride + (slot % block_size) * head_dim;
    for (int h = 0; h < num_kv_heads; ++h) {
      const int64_t src = (static_cast<int64_t>(t) * num_kv_heads + h) * head_dim;
      store_row(key + src, key_cache + base + h * head_stride, head_dim);
      store_row(value + src, value_cache + base + h * head_stride, head_dim);
    }
  }
}

}  // namespace

extern "C" {

// Entry points, named by (new key/value type)_(cache type), as the attention entry points.
#define WRITE_KV_ENTRY(NAME, S, T)                                                                  \
  void NAME(const void* key, const void* value, void* key_cache, void* value_cache,                \
            int64_t block_stride, int64_t head_stride, const int64_t* slot_mapping,                \
            int num_tokens, int num_kv_heads, int head_dim, int block_size) {                      \
    write_kv<S, T>(static_cast<const S*>(key), static_cast<const S*>(value),                       \
                   static_cast<T*>(key_cache), static_cast<T*>(value_cache), block_stride,         \
                   head_stride, slot_mapping, num_tokens, num_kv_heads, head_dim, block_size);     \
  }

WRITE_KV_ENTRY(write_kv_f32_f32, float, float)
WRITE_KV_ENTRY(write_kv_bf16_bf16, uint16_t, uint16_t)
WRITE_KV_ENTRY(write_kv_f32_bf16, float, uint16_t)

}  // extern "C"
