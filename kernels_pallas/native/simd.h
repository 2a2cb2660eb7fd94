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

// Rotate-half RoPE of one bfloat16 row x [D] (raw bits; D a multiple of 32) at one position (cos, sin
// [D] bfloat16 bits): for each 16 columns from d, emit(d, s) with s = bf16(x cos) + bf16(rotated(x) sin)
// in float32, rotated(x) = [-x2, x1] (each product of two bf16 values is exact in float32, then
// rounded to bf16): the roundings XLA's fusion of a bf16 model's `apply_rope` takes.
template <typename Emit>
inline void rope_row_bf16(const uint16_t* x, const uint16_t* cos, const uint16_t* sin, int64_t D, Emit emit) {
  auto bf16_of = [](__m512 f) {   // rounded, still in float32
    return _mm512_castsi512_ps(_mm512_slli_epi32(round_to_bf16x16(_mm512_castps_si512(f)), 16));
  };
  const int64_t half = D / 2;
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(0x80000000u)));
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 xv = load_bf16x16(x + d);
    const __m512 r = d < half ? _mm512_xor_ps(load_bf16x16(x + d + half), sign) : load_bf16x16(x + d - half);
    const __m512 a = bf16_of(_mm512_mul_ps(xv, load_bf16x16(cos + d)));
    const __m512 b = bf16_of(_mm512_mul_ps(r, load_bf16x16(sin + d)));
    emit(d, _mm512_add_ps(a, b));
  }
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

#if defined(__AVX512BW__) && defined(__AVX512VL__)
// 16 float32, or 16 bfloat16 widened exactly; the masked forms zero the lanes past the mask.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) { return load_bf16x16(p); }
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const uint16_t* p, __mmask16 m) { return bf16x16_to_f32(_mm256_maskz_loadu_epi16(m, p)); }

// *y[r] = sum_k w[r][k] x[k] for R rows of K float32 or bfloat16 at R addresses, side by side (R
// streams): per row two chains of 16-lane multiply-adds (k mod 32 below 16, the rest; a tail
// into the first), one horizontal sum. The same operations per row whatever R, so the same bits.
template <int R, typename T>
inline void dot_rows_at(const float* x, const T* const* w, int64_t K, float* const* y) {
  __m512 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m512 x0 = _mm512_loadu_ps(x + k), x1 = _mm512_loadu_ps(x + k + 16);
    for (int r = 0; r < R; ++r) {
      a0[r] = _mm512_fmadd_ps(load16(w[r] + k), x0, a0[r]);
      a1[r] = _mm512_fmadd_ps(load16(w[r] + k + 16), x1, a1[r]);
    }
  }
  for (; k < K; k += 16) {
    const __mmask16 m = tail_mask(K - k);
    const __m512 xv = _mm512_maskz_loadu_ps(m, x + k);
    for (int r = 0; r < R; ++r) a0[r] = _mm512_fmadd_ps(load16(w[r] + k, m), xv, a0[r]);
  }
  for (int r = 0; r < R; ++r) *y[r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
}

// The same for one row w [K]: sum_k w[k] x[k].
template <typename T>
inline float dot_row(const float* x, const T* w, int64_t K) {
  float y, *out = &y;
  dot_rows_at<1>(x, &w, K, &out);
  return y;
}
#endif

}  // namespace jaxserve_native

#endif
