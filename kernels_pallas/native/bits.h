// 16-bit float bits -> float32, shared by the native CPU kernels (built together by
// kernels_pallas/native_cpu.py). The pools and bf16 weights arrive as raw 16-bit words.
#pragma once

#include <cstdint>
#include <cstring>

namespace jaxserve_native {

inline float bf16_to_f32(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

}  // namespace jaxserve_native
