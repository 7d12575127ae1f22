// What every AMX kernel needs (gguf_amx.h, gguf_amx_int8.h, gguf_amx_exact.h): the process's
// permission to use the tile registers, and the tile configuration's layout.
#pragma once

#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace pagedllm_amx {

// Linux lets a process use the tile registers once it asks (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); false where the kernel or the CPU refuses.
inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-7 as 16 rows of 64 bytes.
inline TileConfig full_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  return config;
}

// The tiles configured for a kernel's loop, this thread's previous configuration (another
// library's, oneDNN's) kept and put back by ~TileScope.
class TileScope {
 public:
  explicit TileScope(const TileConfig& config = full_tiles()) {
    _tile_storeconfig(&saved_);
    _tile_loadconfig(&config);
  }
  ~TileScope() {
    if (saved_.palette != 0)
      _tile_loadconfig(&saved_);
    else
      _tile_release();
  }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;

 private:
  TileConfig saved_;
};

}  // namespace pagedllm_amx
#endif
