// Scalar helpers shared by the native CPU kernels (built together by kernels_pallas/native_cpu.py):
// 16-bit float bits -> float32 (the pools and bf16 weights arrive as raw 16-bit words) and back,
// and the exp of a softmax's shifted scores.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace jaxserve_native {

inline float bf16_to_f32(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// float32 bits -> bfloat16 bits, as XLA's convert: to nearest even, subnormals kept, a NaN stays a
// NaN (made quiet).
inline uint32_t round_to_bf16(uint32_t bits) {
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (bits >> 16) | 0x40u;
  return (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
}

inline uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

// A float32 rounded to bfloat16 bits, as XLA's convert rounds it (`round_to_bf16`).
inline uint32_t bf16_bits(float f) { return round_to_bf16(bits_of(f)); }

// A row's sum as the kernels take it, so that it depends only on the row: 16 lane sums over
// i = 0 .. n - 1 in order (lane i mod 16; `step(lane, i)` returns the lane with term i added),
// then sum16's tree (lanes l + 8, l + 4, l + 2, l + 1). Written so the compiler vectorises it.
template <typename Step>
inline float ordered_sum16(int64_t n, Step step) {
  float lanes[16] = {};
  int64_t c = 0;
  for (; c + 16 <= n; c += 16)
#pragma omp simd
    for (int64_t l = 0; l < 16; ++l) lanes[l] = step(lanes[l], c + l);
  for (int64_t l = 0; c + l < n; ++l) lanes[l] = step(lanes[l], c + l);
  for (int64_t half = 8; half >= 1; half /= 2)
    for (int64_t l = 0; l < half; ++l) lanes[l] += lanes[l + half];
  return lanes[0];
}

// exp(x) for x <= 0 (softmax weights), ~1 ulp, written so the compiler vectorises it:
// 2^n * e^f with n = round(x / ln 2) and a degree-6 polynomial for e^f, |f| <= ln2 / 2.
inline float fast_exp(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float f = x - n * 0.693359375f - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * f + 1.3981999507e-3f;
  p = p * f + 8.3334519073e-3f;
  p = p * f + 4.1665795894e-2f;
  p = p * f + 1.6666665459e-1f;
  p = p * f + 5.0000001201e-1f;
  p = p * f * f + f + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += static_cast<int32_t>(static_cast<uint32_t>(static_cast<int32_t>(n)) << 23);   // 2^n (no signed shift)
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

}  // namespace jaxserve_native
