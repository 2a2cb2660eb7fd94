// AMX tile helpers shared by the native CPU kernels (built together by kernels_pallas/native_cpu.py).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>

namespace jaxserve_native {

// Linux hands out AMX tile state only to processes that ask for it (once, for every thread).
// JAXSERVE_AMX=0 keeps every kernel off the tiles.
inline bool amx_permitted() {
  static const bool ok = [] {
    const char* env = std::getenv("JAXSERVE_AMX");
    if (env != nullptr && env[0] == '0') return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// ldtilecfg from `cfg`. The barrier makes the compiler write the config first: it has dropped the
// stores to a local that only the `ldtilecfg` builtin reads (a zeroed config: #GP, SIGSEGV).
inline void load_tile_config(const TileConfig& cfg) {
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

}  // namespace jaxserve_native
#endif
