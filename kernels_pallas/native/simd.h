// AVX-512 helpers shared by the native CPU kernels (built together by kernels_pallas/native_cpu.py).
#pragma once

#ifdef __AVX512F__
#include <immintrin.h>

#include <cstdint>

namespace jaxserve_native {

// 16 bfloat16 values (raw bits) -> float32, exactly: each 16-bit word becomes a float's high half.
inline __m512 bf16x16_to_f32(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// The first min(n, 16) lanes (n >= 0): a masked load or store of a row's last vector.
inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

inline __m512 load_bf16x16(const uint16_t* p) {
  return bf16x16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// float32 bits -> bfloat16 bits (in each lane's low half), as XLA's convert: to nearest even,
// subnormals kept, a NaN stays a NaN (made quiet). (`vcvtneps2bf16` flushes subnormals.)
inline __m512i round_to_bf16x16(__m512i bits) {
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)),
                                                _mm512_set1_epi32(0x7F800000));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd), 16);
  return _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
}

// out[t] = sum of the 16 lanes of v[t], for t < 16: a transpose-and-add tree (45 shuffles and
// adds instead of 16 horizontal reductions).
inline __m512 sum_lanes16(const __m512 v[16]) {
  __m512 a[8], b[4], c[2];
  #pragma GCC unroll 16
  for (int i = 0; i < 8; ++i)   // 128-bit lane j of a[i]: (v[2i], v[2i+1]) partial sums, interleaved
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  #pragma GCC unroll 16
  for (int i = 0; i < 4; ++i) {  // lane j of b[i]: v[4i..4i+3], one partial sum each
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  #pragma GCC unroll 16
  for (int i = 0; i < 2; ++i)    // fold the four 128-bit lanes pairwise
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

}  // namespace jaxserve_native

#endif
