// Matmuls of a step's rows for CPUs with AVX-512: y = x W, float32 or bfloat16 operands.
//
// An XLA FFI custom call built with paged_context.cc (kernels_pallas/native_cpu.py). XLA:CPU
// runs the projections of a decode step (tens of rows) at 50-70% of what this CPU's FMA
// units give (benchmarks/RESULTS.md); a register-tiled kernel that reads the weight where
// it lies gets ~90% at any row count.
//
// Inputs: x [M, K] and one or more weights w_i [K, N_i] (q/k/v, or gate/up, in one call), or
// with `transposed` w_i [N_i, K] (the lm head on a [vocab, hidden] embedding), all float32 or all
// bfloat16 (raw 16-bit words). Outputs: y_i [M, N_i] float32 (the caller rounds them to its
// dtype, as XLA's dot with a float32 result does).
//
// Work: the columns are cut into panels of NR and the rows into tiles of MR; each tile keeps
// MR x NR sums in registers while it walks K. float32: the panel is read in place, a
// broadcast x[m, k] times NR weights per FMA. bfloat16: the panel is first interleaved
// k-pair-wise ([K/2][NR][2], thread-local, zero-padded at the edges) so one `vdpbf16ps`
// multiplies 16 weight pairs by a broadcast pair of x and adds both products into 16 sums.
// On Intel CPUs with AMX-BF16 (and K a multiple of 32) the bfloat16 panel feeds tile multiplies
// instead (panel_amx: ~2-3x the vector path's rate here). A transposed weight is packed for both dtypes: its panel's rows are read 16 at a time and
// transposed in registers as 32-bit words (a float32, or a bf16 k pair, which lie side by side
// in a [N, K] row). K is walked in blocks of KC so a panel stays in L2. Threads split the (panel, row part)
// items on XLA's intra-op threads (parallel.h); a weight panel is read from memory once per
// row part.
//
// JaxserveGemmPacked (AMX only): bfloat16 weights the engine laid out at load in the tiles'
// layout ([N/32, K/2, 32, 2], native_cpu.pack_weight), read where they lie with no packing,
// tiles configured for each block's 1-32 rows; results float32, or bfloat16 rounded in the kernel.
//
// With `f32_tiles` (AMX only), float32 operands with a [N, K] weight run on the tiles as three
// bfloat16 parts each (panel_f32_tiles).

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "amx.h"
#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#if defined(__AVX512F__) && defined(__AVX512BF16__)

#include <immintrin.h>

extern "C" int JaxserveGemmSupported() { return 1; }

namespace {

constexpr int64_t KC = 1024;  // K per block: a panel (KC x 64 bf16 or KC x 48 f32) stays in L2
constexpr int64_t kPrefetchRows = 12;  // how far ahead (in weight rows) a panel's first pass prefetches

using jaxserve_native::tail_mask;

// `count` words of `buffer` (grown as needed) from a 64-byte boundary.
inline uint16_t* aligned64(std::vector<uint16_t>& buffer, int64_t count) {
  buffer.resize(static_cast<size_t>(count + 32));
  const uintptr_t at = reinterpret_cast<uintptr_t>(buffer.data());
  return reinterpret_cast<uint16_t*>((at + 63) & ~uintptr_t{63});
}

// ---- float32: MR rows x NV vectors of 16 columns, the last vector masked to `last` -----------

template <int MR, int NV>
void tile_f32(int64_t kc, const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc,
              __mmask16 last, bool accumulate, bool prefetch, const float* next, int64_t next_ld) {
  __m512 acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    const float* row = b + k * ldb;
    if (prefetch) {   // the panel's first tile pulls it from memory: strided rows the prefetcher misses
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchRows * ldb + 16 * j), _MM_HINT_T0);
    }
    if (next != nullptr) {   // and the panel this thread takes next, into L2
      for (int j = 0; j < 3; ++j) _mm_prefetch(reinterpret_cast<const char*>(next + k * next_ld + 16 * j), _MM_HINT_T1);
    }
    __m512 bv[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j)
      bv[j] = j == NV - 1 ? _mm512_maskz_loadu_ps(last, row + 16 * j) : _mm512_loadu_ps(row + 16 * j);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 av = _mm512_set1_ps(a[i * lda + k]);
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_fmadd_ps(av, bv[j], acc[i][j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      float* out = c + i * ldc + 16 * j;
      const __mmask16 m = j == NV - 1 ? last : __mmask16(0xFFFF);
      __m512 v = acc[i][j];
      if (accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, out), v);
      _mm512_mask_storeu_ps(out, m, v);
    }
}

constexpr int MR_F32 = 8, NR_F32 = 48;

template <int MR>
void rows_f32(int64_t kc, const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc,
              int64_t width, bool accumulate, bool prefetch, const float* next, int64_t next_ld) {
  const int nv = static_cast<int>((width + 15) / 16);
  const __mmask16 last = tail_mask(width - 16 * (nv - 1));
  switch (nv) {
    case 1: tile_f32<MR, 1>(kc, a, lda, b, ldb, c, ldc, last, accumulate, prefetch, next, next_ld); break;
    case 2: tile_f32<MR, 2>(kc, a, lda, b, ldb, c, ldc, last, accumulate, prefetch, next, next_ld); break;
    default: tile_f32<MR, 3>(kc, a, lda, b, ldb, c, ldc, last, accumulate, prefetch, next, next_ld); break;
  }
}

// ---- transposed weights: [N, K] rows into [k][NR] (float32) or [k pair][NR][2] (bfloat16) --

// The 16 x 16 transpose of 32-bit words r[0..15] in place (unpack within lanes, then move lanes).
inline void transpose16(__m512i r[16]) {
  __m512i a[16], b[16];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // b[4j + q], lane l = rows 4j..4j+3 of column 4l + q
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    b[4 * j] = _mm512_unpacklo_epi64(a[4 * j], a[4 * j + 2]);
    b[4 * j + 1] = _mm512_unpackhi_epi64(a[4 * j], a[4 * j + 2]);
    b[4 * j + 2] = _mm512_unpacklo_epi64(a[4 * j + 1], a[4 * j + 3]);
    b[4 * j + 3] = _mm512_unpackhi_epi64(a[4 * j + 1], a[4 * j + 3]);
  }
#pragma GCC unroll 4
  for (int q = 0; q < 4; ++q) {
    const __m512i u0 = _mm512_shuffle_i32x4(b[q], b[4 + q], 0x44), u1 = _mm512_shuffle_i32x4(b[q], b[4 + q], 0xEE);
    const __m512i u2 = _mm512_shuffle_i32x4(b[8 + q], b[12 + q], 0x44);
    const __m512i u3 = _mm512_shuffle_i32x4(b[8 + q], b[12 + q], 0xEE);
    r[q] = _mm512_shuffle_i32x4(u0, u2, 0x88);
    r[4 + q] = _mm512_shuffle_i32x4(u0, u2, 0xDD);
    r[8 + q] = _mm512_shuffle_i32x4(u1, u3, 0x88);
    r[12 + q] = _mm512_shuffle_i32x4(u1, u3, 0xDD);
  }
}

// Rows [n0, n0 + width) of w [N, K], K block [k0, k0 + kc), as 32-bit words into out[c][NR]: word
// c of a row is the float w[n, k0 + c], or (bf16) the pair w[n, k0 + 2c], w[n, k0 + 2c + 1] (the
// second zero past kc); zeros past width. Full 16 x 16 blocks go through transpose16.
template <int NR>
void pack_transposed(const void* w, bool bf16, int64_t K, int64_t k0, int64_t kc, int64_t n0, int64_t width,
                     uint32_t* out) {
  const int64_t words = bf16 ? (kc + 1) / 2 : kc, full_words = bf16 ? kc / 2 : kc;
  const int64_t elem = bf16 ? 2 : 4;
  const char* base = static_cast<const char*>(w);
  auto row = [&](int64_t n) { return base + ((n0 + n) * K + k0) * elem; };
  auto word = [&](int64_t n, int64_t c) -> uint32_t {
    if (!bf16) return reinterpret_cast<const uint32_t*>(row(n))[c];
    const uint16_t* r = reinterpret_cast<const uint16_t*>(row(n));
    const uint32_t hi = 2 * c + 1 < kc ? r[2 * c + 1] : 0;
    return r[2 * c] | hi << 16;
  };
  for (int64_t nb = 0; nb < NR; nb += 16) {
    const int64_t rows = std::clamp<int64_t>(width - nb, 0, 16);
    for (int64_t cb = 0; cb < words; cb += 16) {
      if (rows == 16 && cb + 16 <= full_words) {
        __m512i r[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(row(nb + i) + cb * 4);
        transpose16(r);
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) _mm512_storeu_si512(out + (cb + j) * NR + nb, r[j]);
        continue;
      }
      for (int64_t c = cb; c < std::min(cb + 16, words); ++c)
        for (int64_t i = 0; i < 16; ++i) out[c * NR + nb + i] = i < rows ? word(nb + i, c) : 0;
    }
  }
}

// Rows [m0, m1) of the panel at column n0 (width <= NR_F32), every K block; `next` (row 0 of
// the full panel this thread likely takes next, leading dimension next_ld; or null) is
// prefetched during the first tile. With `packed` (a [KC][NR_F32] buffer), w is [N, K] and each
// K block of the panel is packed there first.
void panel_f32(const float* x, const float* w, float* y, int64_t m0, int64_t m1, int64_t K, int64_t N,
               int64_t n0, int64_t width, const float* next_panel, int64_t next_ld, float* packed = nullptr) {
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t kc = std::min(KC, K - k0);
    const bool acc = k0 > 0;
    const float* b = w + k0 * N + n0;
    int64_t ldb = N;
    if (packed != nullptr) {
      pack_transposed<NR_F32>(w, false, K, k0, kc, n0, width, reinterpret_cast<uint32_t*>(packed));
      b = packed, ldb = NR_F32;
    }
    const bool fetch = packed == nullptr;   // a packed panel is in L1/L2 already
    const float* next = next_panel != nullptr ? next_panel + k0 * next_ld : nullptr;
    int64_t m = m0;
    for (; m + MR_F32 <= m1; m += MR_F32, next = nullptr)
      rows_f32<MR_F32>(kc, x + m * K + k0, K, b, ldb, y + m * N + n0, N, width, acc, fetch && m == m0, next,
                       next_ld);
    const float* a = x + m * K + k0;
    float* c = y + m * N + n0;
    const bool first = fetch && m == m0;
    switch (m1 - m) {
      case 1: rows_f32<1>(kc, a, K, b, ldb, c, N, width, acc, first, next, next_ld); break;
      case 2: rows_f32<2>(kc, a, K, b, ldb, c, N, width, acc, first, next, next_ld); break;
      case 3: rows_f32<3>(kc, a, K, b, ldb, c, N, width, acc, first, next, next_ld); break;
      case 4: rows_f32<4>(kc, a, K, b, ldb, c, N, width, acc, first, next, next_ld); break;
      case 5: rows_f32<5>(kc, a, K, b, ldb, c, N, width, acc, first, next, next_ld); break;
      case 6: rows_f32<6>(kc, a, K, b, ldb, c, N, width, acc, first, next, next_ld); break;
      case 7: rows_f32<7>(kc, a, K, b, ldb, c, N, width, acc, first, next, next_ld); break;
      default: break;
    }
  }
}

// ---- bfloat16: MR rows x 4 vectors (64 columns) over a k-pair-interleaved panel -------------

constexpr int MR_BF16 = 6, NR_BF16 = 64;

// Panel rows [k0, k0 + kc) and columns [n0, n0 + width) of w [K, N] into
// packed[p][n][2] = (w[k0 + 2p, n0 + n], w[k0 + 2p + 1, n0 + n]), zeros past the edges; NR columns
// a pair (NR_BF16 for the vector path, NR_AMX for the tiles).
template <int NR>
void pack_bf16(const uint16_t* w, int64_t K, int64_t N, int64_t k0, int64_t kc, int64_t n0, int64_t width,
               uint16_t* packed) {
  const __m512i lo_idx = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), hi_idx = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
  const int64_t pairs = (kc + 1) / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t k = k0 + 2 * p;
    const uint16_t* r0 = w + k * N + n0;
    const uint16_t* r1 = k + 1 < k0 + kc ? r0 + N : nullptr;
    uint16_t* out = packed + p * 2 * NR;
    if (k + kPrefetchRows + 1 < K) {   // strided weight rows: the hardware prefetcher misses them
      const uint16_t* ahead = r0 + kPrefetchRows * N;
      for (int64_t n = 0; n < width; n += 32) {
        _mm_prefetch(reinterpret_cast<const char*>(ahead + n), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(ahead + N + n), _MM_HINT_T0);
      }
    }
    int64_t n = 0;
    if (r1 != nullptr) {
      for (; n + 32 <= width; n += 32) {   // 32 columns at a time
        const __m512i x0 = _mm512_loadu_si512(r0 + n), x1 = _mm512_loadu_si512(r1 + n);
        // unpack interleaves within 128-bit lanes; the permutes put the column pairs back in order
        const __m512i lo = _mm512_unpacklo_epi16(x0, x1), hi = _mm512_unpackhi_epi16(x0, x1);
        _mm512_storeu_si512(out + 2 * n, _mm512_permutex2var_epi64(lo, lo_idx, hi));
        _mm512_storeu_si512(out + 2 * n + 32, _mm512_permutex2var_epi64(lo, hi_idx, hi));
      }
    }
    for (; n < NR; ++n) {
      out[2 * n] = n < width ? r0[n] : 0;
      out[2 * n + 1] = n < width && r1 != nullptr ? r1[n] : 0;
    }
  }
}

template <int MR>
void tile_bf16(int64_t kc, const uint16_t* a, int64_t lda, const uint16_t* packed, float* c, int64_t ldc,
               int64_t width, bool accumulate, const uint16_t* next = nullptr, int64_t ldw = 0) {
  __m512 acc[MR][4];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t full = kc / 2;
  for (int64_t p = 0; p < full; ++p) {
    if (next != nullptr) {   // the weight rows of the panel this thread packs next, while this one computes
      const uint16_t* r = next + 2 * p * ldw;
      _mm_prefetch(reinterpret_cast<const char*>(r), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(r + 32), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(r + ldw), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(r + ldw + 32), _MM_HINT_T1);
    }
    const uint16_t* bp = packed + p * 2 * NR_BF16;
    __m512bh bv[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) bv[j] = (__m512bh)_mm512_loadu_si512(bp + 32 * j);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      int32_t pair;
      std::memcpy(&pair, a + i * lda + 2 * p, sizeof pair);
      const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], av, bv[j]);
    }
  }
  if (kc % 2) {   // odd K: the last pair is (x[k], 0) against (w[k, n], 0)
    const uint16_t* bp = packed + full * 2 * NR_BF16;
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(a[i * lda + 2 * full]));
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j)
        acc[i][j] = _mm512_dpbf16_ps(acc[i][j], av, (__m512bh)_mm512_loadu_si512(bp + 32 * j));
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const int64_t cols = std::min<int64_t>(16, width - 16 * j);
      if (cols <= 0) continue;
      float* out = c + i * ldc + 16 * j;
      const __mmask16 m = tail_mask(cols);
      __m512 v = acc[i][j];
      if (accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, out), v);
      _mm512_mask_storeu_ps(out, m, v);
    }
}

// `next_panel`, `next_ld`: as in panel_f32. `transposed`: w is [N, K].
void panel_bf16(const uint16_t* x, const uint16_t* w, float* y, int64_t m0, int64_t m1, int64_t K, int64_t N,
                int64_t n0, int64_t width, uint16_t* packed, const uint16_t* next_panel, int64_t next_ld,
                bool transposed) {
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t kc = std::min(KC, K - k0);
    const bool acc = k0 > 0;
    if (transposed)
      pack_transposed<NR_BF16>(w, true, K, k0, kc, n0, width, reinterpret_cast<uint32_t*>(packed));
    else
      pack_bf16<NR_BF16>(w, K, N, k0, kc, n0, width, packed);
    const uint16_t* next = next_panel != nullptr ? next_panel + k0 * next_ld : nullptr;
    int64_t m = m0;
    for (; m + MR_BF16 <= m1; m += MR_BF16, next = nullptr)
      tile_bf16<MR_BF16>(kc, x + m * K + k0, K, packed, y + m * N + n0, N, width, acc, next, next_ld);
    const uint16_t* a = x + m * K + k0;
    float* c = y + m * N + n0;
    switch (m1 - m) {
      case 1: tile_bf16<1>(kc, a, K, packed, c, N, width, acc); break;
      case 2: tile_bf16<2>(kc, a, K, packed, c, N, width, acc); break;
      case 3: tile_bf16<3>(kc, a, K, packed, c, N, width, acc); break;
      case 4: tile_bf16<4>(kc, a, K, packed, c, N, width, acc); break;
      case 5: tile_bf16<5>(kc, a, K, packed, c, N, width, acc); break;
      default: break;
    }
  }
}

// ---- bfloat16 on AMX tiles (Intel CPUs with AMX-BF16) ------------------------------------
//
// `tdpbf16ps` multiplies a 16 x 32 bf16 tile of x by a 32 x 16 tile of the weight (k pairs
// interleaved: the packed panel's layout, 16 of its rows) into 16 x 16 float32 sums, 16x the
// work of one `vdpbf16ps`. A block is 32 rows x 32 columns: four sum tiles, two x tiles, two
// weight tiles (the eight tile registers). Each output is the float32 sum of its exact pair
// products in k order, as on the vector path, but the two products of a pair are added in the
// other order (the hardware's), so the last bits may differ from that path; every row count
// takes this path, so a row's result does not depend on the rows beside it. Needs K a multiple
// of 32 (whole x tiles); else the vector path runs.

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)

using jaxserve_native::amx_permitted;
using jaxserve_native::TileConfig;

constexpr int64_t MR_AMX = 32;
// Columns per AMX panel: a weight's rows are read in 512-byte pieces. With few rows the packing
// is most of the cost, and it reads the weight at ~12-16 GB/s (the one-row matvec, which streams
// whole rows, reads it at ~33): 256 columns against 64 took a decode step of 64 rows from 64-69 to
// 60-63 ms. The engine's own bf16 projections come pre-packed (panel_amx_packed): no packing.
constexpr int64_t NR_AMX = 256;

void configure_tiles() {   // every tile 16 rows of 64 bytes (how each kernel uses them: at its loop)
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  jaxserve_native::load_tile_config(cfg);
}

// c[0:32, 0:32] (+)= a[0:32, 0:kc] times the panel's k pairs [0, kc/2) at columns b (row
// stride 2 NR_AMX words); lda, ldc in elements.
void amx_block(const uint16_t* a, int64_t lda, const uint16_t* b, float* c, int64_t ldc, int64_t kc,
               bool accumulate) {
  const int64_t ldb = 2 * NR_AMX;   // words from one k pair of the panel to the next
  const int64_t sc = ldc * 4, sa = lda * 2, sb = ldb * 2;
  if (accumulate) {
    _tile_loadd(0, c, sc);
    _tile_loadd(1, c + 16, sc);
    _tile_loadd(2, c + 16 * ldc, sc);
    _tile_loadd(3, c + 16 * ldc + 16, sc);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k = 0; k < kc; k += 32) {
    _tile_loadd(4, a + k, sa);
    _tile_loadd(5, a + 16 * lda + k, sa);
    _tile_loadd(6, b + k / 2 * ldb, sb);        // pairs k / 2 .. k / 2 + 15
    _tile_loadd(7, b + k / 2 * ldb + 32, sb);   // 16 columns on
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, sc);
  _tile_stored(1, c + 16, sc);
  _tile_stored(2, c + 16 * ldc, sc);
  _tile_stored(3, c + 16 * ldc + 16, sc);
}

// As panel_bf16 for a [K, N] weight, on tiles, for a panel of up to NR_AMX columns (a [N, K]
// weight takes panel_amx_t). `x` holds whole blocks of 32
// rows (the caller pads it); row blocks past m1 and column blocks short of 32 go through a
// zero-padded copy of their sums (the packed panel is zero past `width`).
void panel_amx(const uint16_t* x, const uint16_t* w, float* y, int64_t m0, int64_t m1, int64_t K, int64_t N,
               int64_t n0, int64_t width, uint16_t* packed) {
  alignas(64) float c_pad[MR_AMX * 32];
  configure_tiles();
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t kc = std::min(KC, K - k0);
    const bool acc = k0 > 0;
    pack_bf16<NR_AMX>(w, K, N, k0, kc, n0, width, packed);
    for (int64_t m = m0; m < m1; m += MR_AMX) {
      const int64_t rows = std::min(MR_AMX, m1 - m);
      const uint16_t* a = x + m * K + k0;
      for (int64_t col = 0; col < width; col += 32) {
        const int64_t cols = std::min<int64_t>(32, width - col);
        float* c = y + m * N + n0 + col;
        if (rows == MR_AMX && cols == 32) {
          amx_block(a, K, packed + 2 * col, c, N, kc, acc);
          continue;
        }
        for (int64_t i = 0; i < MR_AMX; ++i)
          for (int64_t j = 0; j < 32; ++j) c_pad[i * 32 + j] = acc && i < rows && j < cols ? c[i * N + j] : 0.0f;
        amx_block(a, K, packed + 2 * col, c_pad, 32, kc, true);
        for (int64_t i = 0; i < rows; ++i) std::memcpy(c + i * N, c_pad + i * 32, sizeof(float) * cols);
      }
    }
  }
  _tile_release();
}

// ---- pre-packed weights on tiles ----------------------------------------------------------
//
// A weight the engine packed once at load (`native_cpu.pack_weight`): [N / 32, K / 2, 32, 2],
// element [b, p, c, e] = w[2p + e, 32b + c], i.e. each 32-column block of the weight already in
// the k-pair layout the tiles' second operand takes, one contiguous run of K x 32 words. The
// tiles read it where it lies: no per-call packing, which with few rows was most of the cost
// (a panel's rows are 512-byte pieces of strided weight rows). Same tile operations in the same
// order as panel_amx, so the same bits.

// Tiles for blocks of `rows` rows (1-32): sums 0-1 and x tile 4 take the first 16 rows, sums
// 2-3 and x tile 5 the rest; the weight tiles 6-7 are 16 k pairs x 16 columns. A tile with fewer
// rows costs the tiles less (a decode step of 1-16 rows is not padded to 32), and each row's
// sums are the same as in a full tile.
void configure_tiles_rows(int64_t rows) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64;
  const uint8_t top = static_cast<uint8_t>(std::min<int64_t>(16, rows)), rest = static_cast<uint8_t>(rows - top);
  cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = top;
  cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = rest;
  cfg.colsb[2] = cfg.colsb[3] = cfg.colsb[5] = rest ? 64 : 0;
  cfg.rows[6] = cfg.rows[7] = 16;
  jaxserve_native::load_tile_config(cfg);
}

// Sums of a finished 32 x 32 block (in L1), to be rounded into bfloat16 results.
struct PendingBlock {
  const float* sums = nullptr;   // [rows][32]
  uint16_t* out = nullptr;       // row 0's first column; rows ld apart
  int64_t ld = 0, rows = 0, done = 0;
  // Rows [done, upto): `vcvtne2ps2bf16` rounds 32 sums to nearest even and quiets NaNs as XLA's
  // convert does, but flushes subnormal inputs to zero; a row with one takes the exact integer
  // rounding (XLA keeps them). (The tiles flush subnormal sums themselves, so this is a guard.)
  void convert(int64_t upto) {
    using jaxserve_native::round_to_bf16x16;
    const __m512i exponent = _mm512_set1_epi32(0x7F800000), mantissa = _mm512_set1_epi32(0x007FFFFF);
    for (upto = std::min(upto, rows); done < upto; ++done) {
      const __m512 lo = _mm512_load_ps(sums + 32 * done), hi = _mm512_load_ps(sums + 32 * done + 16);
      const __m512i lo_bits = _mm512_castps_si512(lo), hi_bits = _mm512_castps_si512(hi);
      const __mmask16 sub_lo = _mm512_testn_epi32_mask(lo_bits, exponent) & _mm512_test_epi32_mask(lo_bits, mantissa);
      const __mmask16 sub_hi = _mm512_testn_epi32_mask(hi_bits, exponent) & _mm512_test_epi32_mask(hi_bits, mantissa);
      uint16_t* row = out + done * ld;
      if (!(sub_lo | sub_hi)) {
        _mm512_storeu_si512(row, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        continue;
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row), _mm512_cvtepi32_epi16(round_to_bf16x16(lo_bits)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + 16), _mm512_cvtepi32_epi16(round_to_bf16x16(hi_bits)));
    }
  }
};

// c[0:rows, 0:32] = a[0:rows, 0:K] times a pre-packed 32-column block b (K / 2 pairs of 32 x 2
// words), tiles configured for `rows` by configure_tiles_rows. `pending` (bfloat16 results, or
// null): the block before's sums, rounded a few rows each k step while the tiles work (the
// vector units are idle then), the rest after; c is then an L1 buffer that becomes the next
// pending block's sums.
void amx_block_packed(const uint16_t* a, int64_t K, const uint16_t* b, float* c, int64_t ldc, int64_t rows,
                      PendingBlock* pending = nullptr) {
  const int64_t sc = ldc * 4, sa = K * 2, sb = 64 * 2;
  const bool two = rows > 16;
  const int64_t per_step = pending != nullptr ? (pending->rows + K / 32 - 1) / (K / 32) : 0;
  _tile_zero(0);
  _tile_zero(1);
  if (two) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k = 0; k < K; k += 32) {
    _tile_loadd(4, a + k, sa);
    _tile_loadd(6, b + k * 32, sb);        // pairs k / 2 .. k / 2 + 15, columns 0-15
    _tile_loadd(7, b + k * 32 + 32, sb);   // columns 16-31
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_loadd(5, a + 16 * K + k, sa);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    if (per_step) pending->convert(pending->done + per_step);
  }
  if (pending != nullptr) pending->convert(pending->rows);
  _tile_stored(0, c, sc);
  _tile_stored(1, c + 16, sc);
  if (two) {
    _tile_stored(2, c + 16 * ldc, sc);
    _tile_stored(3, c + 16 * ldc + 16, sc);
  }
}

// Columns [n0, n0 + width) (multiples of 32) of the packed weight wp times x rows [m0, m1), in
// blocks of up to 32 rows; no row is padded. `y16`: bfloat16 results there instead of float32
// ones in y (half the bytes written: y's rows are strided, so each result row of a block is a
// write to another line).
void panel_amx_packed(const uint16_t* x, const uint16_t* wp, float* y, int64_t m0, int64_t m1, int64_t K,
                      int64_t N, int64_t n0, int64_t width, uint16_t* y16 = nullptr) {
  alignas(64) float sums[2][MR_AMX * 32];   // bfloat16 results: a block's sums while the next computes
  PendingBlock pending;
  int64_t blocks = 0;
  auto block = [&](int64_t m, int64_t col, int64_t rows) {   // weight block col / 32 lies at col * K words
    if (y16 == nullptr) return amx_block_packed(x + m * K, K, wp + col * K, y + m * N + col, N, rows);
    float* c = sums[blocks++ % 2];
    amx_block_packed(x + m * K, K, wp + col * K, c, 32, rows, pending.sums ? &pending : nullptr);
    pending = PendingBlock{c, y16 + m * N + col, N, rows, 0};
  };
  const int64_t full_end = m0 + (m1 - m0) / MR_AMX * MR_AMX;
  if (full_end > m0) {   // whole 32-row blocks: each weight block read once for all of them
    configure_tiles_rows(MR_AMX);
    for (int64_t col = n0; col < n0 + width; col += 32)
      for (int64_t m = m0; m < full_end; m += MR_AMX) block(m, col, MR_AMX);
  }
  if (full_end < m1) {   // the last rows
    configure_tiles_rows(m1 - full_end);
    for (int64_t col = n0; col < n0 + width; col += 32) block(full_end, col, m1 - full_end);
  }
  if (pending.sums) pending.convert(pending.rows);
  _tile_release();
}

// ---- a [N, K] weight (the lm head) on tiles ----------------------------------------------
//
// The second operand of tdpbf16ps is k-pair interleaved, which a [N, K] weight becomes only
// through a transpose (pack_transposed: ~10 GB/s here); its rows, K contiguous, are what the
// first operand takes as they lie. So the tiles compute y^T = W x^T: weight rows as the first
// operand, x (k-pair interleaved once per call, a few KB) as the second, and each 16 x 16 sum
// tile is a block of y transposed. The products and their order per output are the same as on
// the packed path.

// xb[p][m][2] = (x[m, 2p], x[m, 2p + 1]) for m < M, zeros up to m_pad.
void pack_x_pairs(const uint16_t* x, int64_t M, int64_t m_pad, int64_t K, uint16_t* xb) {
  for (int64_t p = 0; p < K / 2; ++p)
    for (int64_t m = 0; m < m_pad; ++m) {
      xb[(p * m_pad + m) * 2] = m < M ? x[m * K + 2 * p] : 0;
      xb[(p * m_pad + m) * 2 + 1] = m < M ? x[m * K + 2 * p + 1] : 0;
    }
}

// JAXSERVE_LM_HEAD_STREAM=0: a [N, K] weight's blocks on tiles without their prefetches and
// streaming stores (an A/B switch).
bool lm_head_stream() {
  static const bool on = [] {
    const char* env = std::getenv("JAXSERVE_LM_HEAD_STREAM");
    return env == nullptr || env[0] != '0';
  }();
  return on;
}

// Results of at least this many bytes ([M, N] float32: the default model's logits from 22 rows on)
// are written by non-temporal stores on the tiles' [N, K] paths: at least both cores' L2 here, so
// their consumer reads them from memory either way.
constexpr int64_t kStreamBytes = 4 << 20;

// Whether the tiles' [N, K] paths stream an [M, N] float32 result (the caller fences after its stores).
bool stream_results(int64_t M, int64_t N) { return lm_head_stream() && M * N * 4 >= kStreamBytes; }

// 16 results of a row: a non-temporal store with `stream` where all 16 are there and the row is
// 64-byte aligned, else a masked store.
inline void put_results16(float* out, __mmask16 mask, __m512 v, bool stream) {
  if (stream && mask == 0xFFFF && reinterpret_cast<uintptr_t>(out) % 64 == 0) _mm512_stream_ps(out, v);
  else _mm512_mask_storeu_ps(out, mask, v);
}

// y[m0 + i, n0 + j] = sum_k w[j, k] x[m0 + i, k] for i < rows, j < cols (<= 32 each); w points at
// weight row n0 (32 readable rows), xb at x row m0 of the interleaved x. `ahead` (or null): the next
// block's weight rows, `ahead_bytes` of them, fetched into L2 a few lines each k step (the weight
// comes from memory once; the prefetcher does not follow its 16 strided rows a tile). With `fetch`,
// each k step also fetches the next one's x lines into L1 (x is read from L2 at every block
// otherwise). With `stream`, whole 16-column rows of y go out by non-temporal stores (the caller
// fences): logits larger than the caches, each row of a block a line of its own far from the last,
// which a plain store first reads from memory. The same tile operations in the same order either
// way: the same sums.
void amx_block_t(const uint16_t* w, int64_t K, const uint16_t* xb, int64_t m_pad, float* y, int64_t N,
                 int64_t rows, int64_t cols, const char* ahead, int64_t ahead_bytes, bool fetch, bool stream) {
  const int64_t sw = K * 2, sx = m_pad * 4;
  const int64_t steps = K / 32, ahead_lines = ahead_bytes / 64, per_step = (ahead_lines + steps - 1) / steps;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0, line = 0; k < K; k += 32) {
    if (fetch && k + 32 < K) {
      const char* next_x = reinterpret_cast<const char*>(xb + (k + 32) * m_pad);
      for (int64_t r = 0; r < 16; ++r) {
        _mm_prefetch(next_x + r * sx, _MM_HINT_T0);
        if (rows > 16) _mm_prefetch(next_x + r * sx + 64, _MM_HINT_T0);
      }
    }
    if (ahead != nullptr)
      for (const int64_t end = std::min(ahead_lines, line + per_step); line < end; ++line)
        _mm_prefetch(ahead + 64 * line, _MM_HINT_T1);
    _tile_loadd(4, w + k, sw);                 // weight rows 0-15
    _tile_loadd(5, w + 16 * K + k, sw);        // weight rows 16-31
    _tile_loadd(6, xb + k * m_pad, sx);        // pairs k / 2 .., x rows 0-15
    _tile_loadd(7, xb + k * m_pad + 32, sx);   // x rows 16-31
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float t[4][16][16];   // t[2 wi + xi][weight row][x row]
  _tile_stored(0, t[0], 64);
  _tile_stored(1, t[1], 64);
  _tile_stored(2, t[2], 64);
  _tile_stored(3, t[3], 64);
  for (int wi = 0; wi < 2; ++wi)
    for (int xi = 0; xi < 2; ++xi) {
      const int64_t r0 = 16 * xi, c0 = 16 * wi;
      if (r0 >= rows || c0 >= cols) continue;
      __m512i v[16];
      for (int i = 0; i < 16; ++i) v[i] = _mm512_load_si512(t[2 * wi + xi][i]);
      transpose16(v);   // v[i]: x row r0 + i over weight rows c0 .. c0 + 15
      const __mmask16 mask = tail_mask(cols - c0);
      for (int64_t i = 0; i < std::min<int64_t>(16, rows - r0); ++i)
        put_results16(y + (r0 + i) * N + c0, mask, _mm512_castsi512_ps(v[i]), stream);
    }
}

// Weight rows [n0, n0 + width) times x rows [m0, m1) (xb holds them interleaved, m_pad rows; `M`:
// the rows of y computed, which size the result for streaming). Each 32-row weight block comes from
// memory in the first x pass, which fetches the next block into L2.
void panel_amx_t(const uint16_t* w, const uint16_t* xb, int64_t m_pad, float* y, int64_t M, int64_t m0,
                 int64_t m1, int64_t K, int64_t N, int64_t n0, int64_t width) {
  thread_local std::vector<uint16_t> w_pad;   // the last rows of the weight, zero-padded to 32
  const bool fetch = lm_head_stream(), stream = stream_results(M, N);
  configure_tiles();
  for (int64_t n = 0; n < width; n += 32) {
    const int64_t cols = std::min<int64_t>(32, width - n);
    const uint16_t* wn = w + (n0 + n) * K;
    if (n0 + n + 32 > N) {
      w_pad.assign(static_cast<size_t>(32 * K), 0);
      std::memcpy(w_pad.data(), wn, sizeof(uint16_t) * (N - n0 - n) * K);
      wn = w_pad.data();
    }
    // the next block of this panel (the next panel is another thread's, likely)
    const char* ahead = fetch && n + 64 <= width && n0 + n + 64 <= N ? reinterpret_cast<const char*>(wn + 32 * K) : nullptr;
    for (int64_t m = m0; m < m1; m += MR_AMX)
      amx_block_t(wn, K, xb + 2 * m, m_pad, y + m * N + n0 + n, N, std::min(MR_AMX, m1 - m), cols,
                  m == m0 ? ahead : nullptr, 32 * K * 2, fetch, stream);
  }
  if (stream) _mm_sfence();   // the streamed rows before the item counts as done
  _tile_release();
}

// ---- float32 on AMX tiles: each operand as three bfloat16 parts -----------------------------
//
// A float32 v splits into v = h + m + l, each a bfloat16: h is v rounded to 8 significant bits
// (to nearest even), m the rest rounded so, and l what is left (at most 8 bits); exactly, for
// |v| from ~2^-110 (below, a part under float32's normal range is dropped: the conversion and
// the tiles take subnormals as 0) up to ~3.39e38 (above, h rounds to inf). A product of two
// splits, (h + m + l)(h' + m' + l'), is nine exact bf16 products; the three of order 2^-24 and
// below (m l', l m', l l') are left out, so the product is v v' within ~2^-23 |v v'|, about one
// float32 rounding (XLA's BF16_BF16_F32_X6 dot algorithm). `tdpbf16ps` computes each bf16
// product exactly and adds in float32, the six of an element into one sum tile. Against float64,
// at the model's K (576, 1,536) the worst error is 1.2-2.6 float32 roundings of sum |x w|
// against the float32 FMAs' 1.7-6.5; at a K of a few dozen it is up to ~4.5 against their ~1-3
// (benchmarks/RESULTS.md). An output that comes out inf or NaN (an inf or NaN operand, a value
// past the split's range, a sum that overflows) is computed again by float32 FMAs, so it is
// what they give. Tiles multiply ~4x as many numbers a cycle as the float32 FMAs, so six
// products still come out ahead.
//
// As for a bf16 [N, K] weight (amx_block_t), the weight rows are the first operand (each 16
// split once per work item, kept for its later 64-row passes: in L2 up to K ~2,000), x the
// second (split and k-pair interleaved once per call), and each sum tile is a block of y
// transposed. Tiles 0-3: the sums of up to four 16-row blocks of x; 4-6: the weight's parts; 7:
// x's parts, one at a time.

// The parts h, m, l of 32 floats (lo: the first 16, hi: the next), each as 32 bf16 words:
// `vcvtne2ps2bf16` rounds to nearest even (subnormals flush to zero, as the tiles take them).
inline void split3x32(__m512 lo, __m512 hi, __m512i parts[3]) {
  auto widen = [](__m512i words, __m512& first, __m512& second) {   // 32 bf16 -> 2 x 16 float32
    first = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(words)), 16));
    second = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(words, 1)), 16));
  };
  __m512 a, b;
  parts[0] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  widen(parts[0], a, b);
  lo = _mm512_sub_ps(lo, a);
  hi = _mm512_sub_ps(hi, b);
  parts[1] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  widen(parts[1], a, b);
  parts[2] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(hi, b), _mm512_sub_ps(lo, a));   // exact
}

inline void load32(const float* row, int64_t K, int64_t k, __m512& lo, __m512& hi) {
  lo = _mm512_maskz_loadu_ps(tail_mask(K - k), row + k);
  hi = _mm512_maskz_loadu_ps(tail_mask(K - k - 16 < 0 ? 0 : K - k - 16), row + k + 16);
}

// The parts of weight rows [n0, n0 + 16) of w [N, K] (rows past N zero), k [k, k + 32), into
// ws[3][16][K32] (K32 = K rounded up to 32; zeros past K).
inline void split_weight_step(const float* w, int64_t N, int64_t K, int64_t K32, int64_t n0, int64_t k, uint16_t* ws) {
  for (int64_t r = 0; r < 16; ++r) {
    __m512i parts[3] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    if (n0 + r < N) {
      __m512 lo, hi;
      load32(w + (n0 + r) * K, K, k, lo, hi);
      split3x32(lo, hi, parts);
    }
    for (int j = 0; j < 3; ++j) _mm512_store_si512(ws + (j * 16 + r) * K32 + k, parts[j]);
    if (n0 + 16 + r < N) {   // the same k of the next 16 rows (16 slow streams: prefetch them)
      _mm_prefetch(reinterpret_cast<const char*>(w + (n0 + 16 + r) * K + k), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(w + (n0 + 16 + r) * K + k + 16), _MM_HINT_T1);
    }
  }
}

// Split x lies in chunks of `cr` rows (x_chunk_rows), chunk c at xs + 3 K32 cr c, as
// [3][K32 / 32][cr / 16][16][16][2]: [j][s][b][p][i] holds part j of x[m, 2q] and x[m, 2q + 1] for
// k pair q = 16 s + p and x row m = c cr + 16 b + i (in the split's k order, the same for x and
// the weight). Each tile the kernel loads (16 k pairs of 16 rows) is then 1 KB in one piece:
// with its rows 4 cr bytes apart (a [K32 / 2][cr][2] chunk) a k step took ~13% longer (one thread,
// operands in L2).

// The parts of x rows [m0, m0 + 16) (rows past M zero; m0 a multiple of 16), k pairs [p0, p0 + 16).
void split_x_block(const float* x, int64_t M, int64_t K, int64_t m0, int64_t p0, int64_t cr, uint16_t* xs) {
  const int64_t K32 = (K + 31) / 32 * 32, k = 2 * p0;
  __m512i rows[3][16];
  for (int64_t i = 0; i < 16; ++i) {
    if (m0 + i >= M) {
      rows[0][i] = rows[1][i] = rows[2][i] = _mm512_setzero_si512();
      continue;
    }
    __m512 lo, hi;
    load32(x + (m0 + i) * K, K, k, lo, hi);
    __m512i parts[3];
    split3x32(lo, hi, parts);
    for (int j = 0; j < 3; ++j) rows[j][i] = parts[j];   // 16 words: pairs p0 .. p0 + 15 of row i
  }
  for (int j = 0; j < 3; ++j) {
    transpose16(rows[j]);   // rows[j][p]: pair p0 + p over x rows m0 .. m0 + 15
    for (int64_t p = 0; p < 16; ++p)
      _mm512_store_si512(xs + 3 * K32 * cr * (m0 / cr) + j * K32 * cr + (p0 / 16 * cr + m0 % cr) * 32 + 32 * p,
                         rows[j][p]);
  }
}

// Lanes `lanes` of `out` (lane c: weight row w + c K) replaced by float32 FMA dot products with x
// (the one-row matvec's `dot_row`).
inline __m512 fma_dots(const float* x, const float* w, int64_t K, __m512 out, __mmask16 lanes) {
  alignas(64) float o[16];
  _mm512_store_ps(o, out);
  for (int c = 0; c < 16; ++c)
    if ((lanes >> c) & 1) o[c] = jaxserve_native::dot_row(x, w + c * K, K);
  return _mm512_load_ps(o);
}

// y[xm + i, n0 + c] = sum_k w[n0 + c, k] x[xm + i, k] for i < rows (<= 16 MB), c < cols (<= 16),
// from the split weight rows ws [3][16][K32] and x's split chunk of rows xm .. (xc, laid out as above).
// With `split`, the weight rows are split into ws a k step ahead of the tiles (the first pass
// over them). x and w as they are: for outputs that come out inf or NaN.
template <int MB>
void f32_tiles_block(const float* x, const float* w, bool split, int64_t N, int64_t K, uint16_t* ws, int64_t K32,
                     const uint16_t* xc, int64_t cr, int64_t xm, float* y, int64_t n0, int64_t rows, int64_t cols,
                     bool stream) {
  const int64_t part_w = 16 * K32, part_x = K32 * cr;   // words from one part to the next
  const int64_t sw = K32 * 2, sx = 64;   // bytes from one tile row to the next
  _tile_zero(0);
  if (MB > 1) _tile_zero(1);
  if (MB > 2) _tile_zero(2);
  if (MB > 3) _tile_zero(3);
  if (split) split_weight_step(w, N, K, K32, n0, 0, ws);
  for (int64_t k = 0; k < K32; k += 32) {
    _tile_loadd(4, ws + k, sw);
    _tile_loadd(5, ws + part_w + k, sw);
    _tile_loadd(6, ws + 2 * part_w + k, sw);
    if (split && k + 32 < K32) split_weight_step(w, N, K, K32, n0, k + 32, ws);
    const uint16_t* xb = xc + k * cr;   // k step k / 32 of each part: cr / 16 tiles of 512 words
#define JAXSERVE_F32_TILES_BLOCK(b)                                              \
    _tile_loadd(7, xb + 512 * b, sx);                                            \
    _tile_dpbf16ps(b, 4, 7);                                                     \
    _tile_dpbf16ps(b, 5, 7);                                                     \
    _tile_dpbf16ps(b, 6, 7);                                                     \
    _tile_loadd(7, xb + part_x + 512 * b, sx);                                   \
    _tile_dpbf16ps(b, 4, 7);                                                     \
    _tile_dpbf16ps(b, 5, 7);                                                     \
    _tile_loadd(7, xb + 2 * part_x + 512 * b, sx);                               \
    _tile_dpbf16ps(b, 4, 7);
    JAXSERVE_F32_TILES_BLOCK(0)
    if (MB > 1) { JAXSERVE_F32_TILES_BLOCK(1) }
    if (MB > 2) { JAXSERVE_F32_TILES_BLOCK(2) }
    if (MB > 3) { JAXSERVE_F32_TILES_BLOCK(3) }
#undef JAXSERVE_F32_TILES_BLOCK
  }
  alignas(64) float t[4][16][16];   // t[b][weight row][x row]
  _tile_stored(0, t[0], 64);
  if (MB > 1) _tile_stored(1, t[1], 64);
  if (MB > 2) _tile_stored(2, t[2], 64);
  if (MB > 3) _tile_stored(3, t[3], 64);
  const __mmask16 mask = tail_mask(cols);
  for (int b = 0; b < MB && 16 * b < rows; ++b) {
    __m512i v[16];
    for (int i = 0; i < 16; ++i) v[i] = _mm512_load_si512(t[b][i]);
    transpose16(v);   // v[i]: x row xm + 16 b + i over weight rows n0 .. n0 + 15
    for (int64_t i = 0; i < std::min<int64_t>(16, rows - 16 * b); ++i) {
      const int64_t m = xm + 16 * b + i;
      __m512 out = _mm512_castsi512_ps(v[i]);
      const __mmask16 odd = _mm512_fpclass_ps_mask(out, 0x99) & mask;   // NaN or inf: the FMAs' value
      if (odd) out = fma_dots(x + m * K, w + n0 * K, K, out, odd);
      put_results16(y + m * N + n0, mask, out, stream);
    }
  }
}

// Weight rows [n0, n0 + width) of w [N, K] times x rows [m0, m1) (xs: x split in chunks of cr rows). The
// weight rows are split once, in the first 64 x rows' pass, into a panel that stays in L2 with
// 64 rows of split x (up to ~1.2 MB at K = 1536) for the later passes.
void panel_f32_tiles(const float* x, const float* w, const uint16_t* xs, int64_t cr, float* y, int64_t M, int64_t m0,
                     int64_t m1, int64_t K, int64_t N, int64_t n0, int64_t width) {
  const bool stream = stream_results(M, N);   // the logits: see amx_block_t
  const int64_t K32 = (K + 31) / 32 * 32, block_words = 3 * 16 * K32;
  thread_local std::vector<uint16_t> buffer;
  uint16_t* panel = aligned64(buffer, (width + 15) / 16 * block_words);
  configure_tiles();
  for (int64_t m = m0; m < m1; m += cr) {   // (m0 is a multiple of cr)
    const bool split = m == m0;   // the first pass splits the weight rows
    const int64_t rows = std::min<int64_t>(cr, m1 - m);
    const uint16_t* xc = xs + 3 * K32 * m;   // the chunk of rows m ..
    for (int64_t n = n0; n < n0 + width; n += 16) {
      uint16_t* ws = panel + (n - n0) / 16 * block_words;
      const int64_t cols = std::min<int64_t>(16, n0 + width - n);
      switch ((rows + 15) / 16) {
        case 1: f32_tiles_block<1>(x, w, split, N, K, ws, K32, xc, cr, m, y, n, rows, cols, stream); break;
        case 2: f32_tiles_block<2>(x, w, split, N, K, ws, K32, xc, cr, m, y, n, rows, cols, stream); break;
        case 3: f32_tiles_block<3>(x, w, split, N, K, ws, K32, xc, cr, m, y, n, rows, cols, stream); break;
        default: f32_tiles_block<4>(x, w, split, N, K, ws, K32, xc, cr, m, y, n, rows, cols, stream); break;
      }
    }
  }
  if (stream) _mm_sfence();   // the streamed rows before the item counts as done
  _tile_release();
}

#else

constexpr int64_t MR_AMX = 32, NR_AMX = 256;
void panel_amx_t(const uint16_t*, const uint16_t*, int64_t, float*, int64_t, int64_t, int64_t, int64_t, int64_t,
                 int64_t, int64_t) {}
void pack_x_pairs(const uint16_t*, int64_t, int64_t, int64_t, uint16_t*) {}
bool amx_permitted() { return false; }
void panel_amx_packed(const uint16_t*, const uint16_t*, float*, int64_t, int64_t, int64_t, int64_t, int64_t,
                      int64_t, uint16_t* = nullptr) {}
void panel_amx(const uint16_t*, const uint16_t*, float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
               uint16_t*) {}
void split_x_block(const float*, int64_t, int64_t, int64_t, int64_t, int64_t, uint16_t*) {}
void panel_f32_tiles(const float*, const float*, const uint16_t*, int64_t, float*, int64_t, int64_t, int64_t,
                     int64_t, int64_t, int64_t, int64_t) {}

#endif

// Weight rows per work item of a float32 weight on tiles (each 16 split once for all the item's x rows).
constexpr int64_t NR_F32_TILES = 64;

// Rows of a chunk of split x (float32 on tiles): 64, or fewer x rows rounded up to 16.
inline int64_t x_chunk_rows(int64_t M) { return std::min<int64_t>(64, (M + 15) / 16 * 16); }

// ---- work split ---------------------------------------------------------------------------

struct Operand {  // one weight of the call and its output
  const void* w;
  float* y;
  int64_t N;
};

// Items are (operand, panel, row part) over every operand's panels; rows are split (in whole
// tiles) only as far as needed to give every thread the same number of items. Each item also
// names the full panel the same thread likely runs next (items are handed out in order, so
// about `threads` items later) for prefetching, or none: in a [K, N] weight its first row
// (leading dimension N), in a [N, K] weight (`K_transposed` = K) its nr rows, one contiguous
// block (given as leading dimension nr, so the tiles' prefetches walk it in step with k).
template <typename T, typename F>
void for_items(ffi::ThreadPool& pool, int64_t M, const std::vector<Operand>& ops, int64_t nr, int64_t mr,
               int64_t K_transposed, F&& run, bool even_items = true) {
  std::vector<int64_t> first_panel(ops.size() + 1, 0);   // prefix sums of the operands' panel counts
  for (size_t i = 0; i < ops.size(); ++i) first_panel[i + 1] = first_panel[i] + (ops[i].N + nr - 1) / nr;
  const int64_t panels = first_panel.back(), tiles = (M + mr - 1) / mr;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t parts = 1;
  if (even_items)   // the same number of items for every thread
    while (parts < tiles && (panels * parts) % threads != 0) ++parts;
  else              // a part re-reads its panel: only where there are fewer than two panels a thread
    while (parts < tiles && panels * parts < 2 * threads) ++parts;
  const int64_t items = panels * parts;
  auto locate = [&](int64_t panel) {   // (operand, first column) of a global panel index
    size_t op = 0;
    while (first_panel[op + 1] <= panel) ++op;
    return std::make_pair(op, (panel - first_panel[op]) * nr);
  };
  jaxserve_native::parallel_for(pool, items, threads, [&](int64_t item) {
    const int64_t panel = item / parts, part = item % parts;
    const int64_t m0 = std::min(M, tiles * part / parts * mr), m1 = std::min(M, tiles * (part + 1) / parts * mr);
    if (m0 >= m1) return;
    const auto [op, n0] = locate(panel);
    const T* next = nullptr;
    int64_t next_ld = 0;
    if (item + threads < items && (item + threads) / parts != panel) {
      const auto [next_op, next_n0] = locate((item + threads) / parts);
      if (next_n0 + nr <= ops[next_op].N) {
        next = static_cast<const T*>(ops[next_op].w) + (K_transposed ? next_n0 * K_transposed : next_n0);
        next_ld = K_transposed ? nr : ops[next_op].N;
      }
    }
    run(ops[op], n0, std::min(nr, ops[op].N - n0), m0, m1, next, next_ld);
  });
}

// x [M, K] times each weight w_i [K, N_i] (the remaining arguments) into y_i [M, N_i] (the
// results): one call, one work split, for the projections that read the same x.
// The first `rows` rows of x (clamped to [0, M]) times each weight; the results' other rows are 0.
ffi::Error GemmRows(ffi::ThreadPool& pool, ffi::AnyBuffer x, ffi::RemainingArgs ws, ffi::RemainingRets ys,
                    int64_t transposed, int64_t rows, int64_t f32_tiles) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("gemm takes x [M, K]");
  const int64_t M_all = xd[0], K = xd[1];
  const int64_t M = std::clamp<int64_t>(rows, 0, M_all);
  if (ws.size() == 0 || ws.size() != ys.size()) return ffi::Error::InvalidArgument("gemm takes one result per weight");
  std::vector<Operand> ops;
  for (size_t i = 0; i < ws.size(); ++i) {
    auto w = ws.get<ffi::AnyBuffer>(i);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !y.has_value()) return ffi::Error::InvalidArgument("gemm: a weight or result of a wrong type");
    const auto wd = w->dimensions();
    if (wd.size() != 2 || wd[transposed ? 1 : 0] != K)
      return ffi::Error::InvalidArgument(transposed ? "gemm takes weights [N, K]" : "gemm takes weights [K, N]");
    const int64_t n = wd[transposed ? 0 : 1];
    if (w->element_type() != x.element_type()) return ffi::Error::InvalidArgument("x and w must have one dtype");
    if ((*y)->element_count() != static_cast<size_t>(M_all * n)) return ffi::Error::InvalidArgument("y must be [M, N]");
    float* yp = (*y)->typed_data();
    std::fill(yp + (K == 0 ? 0 : M) * n, yp + M_all * n, 0.0f);   // rows past `rows` (every row when K = 0)
    if (K > 0 && M > 0 && n > 0) ops.push_back({w->untyped_data(), yp, n});
  }
  if (ops.empty()) return ffi::Error::Success();
  if (x.element_type() == ffi::DataType::F32 && transposed && f32_tiles && amx_permitted()) {
    const int64_t K32 = (K + 31) / 32 * 32, cr = x_chunk_rows(M), m_pad = (M + cr - 1) / cr * cr;
    // The split x: kept by the calling thread up to 16 MB (a fresh buffer each call faults its pages
    // in again), larger ones (long prefills of wide models) freed on return.
    constexpr int64_t kKeptWords = int64_t{8} << 20;
    thread_local std::vector<uint16_t> kept;
    std::vector<uint16_t> once;
    const int64_t words = 3 * K32 * m_pad;
    uint16_t* xs = aligned64(words <= kKeptWords ? kept : once, words);
    const float* xp = static_cast<const float*>(x.untyped_data());
    // Every thread splits blocks of x from one counter before its first item (one fan-out for both).
    const int64_t row_blocks = m_pad / 16, k_blocks = K32 / 32, blocks = row_blocks * k_blocks;
    std::atomic<int64_t> next_block{0}, blocks_done{0};
    auto split_x = [&] {
      for (int64_t b; (b = next_block.fetch_add(1, std::memory_order_relaxed)) < blocks;) {
        split_x_block(xp, M, K, b / k_blocks * 16, b % k_blocks * 16, cr, xs);
        blocks_done.fetch_add(1, std::memory_order_release);
      }
      jaxserve_native::wait_until(blocks_done, blocks);   // the blocks other threads took
    };
    for_items<float>(pool, M, ops, NR_F32_TILES, cr, K, [&](const Operand& op, int64_t n0, int64_t width,
                                                              int64_t m0, int64_t m1, const float*, int64_t) {
      split_x();
      panel_f32_tiles(xp, static_cast<const float*>(op.w), xs, cr, op.y, M, m0, m1, K, op.N, n0, width);
    }, /*even_items=*/false);
  } else if (x.element_type() == ffi::DataType::F32) {
    const float* xp = static_cast<const float*>(x.untyped_data());
    for_items<float>(pool, M, ops, NR_F32, MR_F32, transposed ? K : 0, [&](const Operand& op, int64_t n0, int64_t width, int64_t m0,
                                                       int64_t m1, const float* next, int64_t next_ld) {
      if (transposed) {
        thread_local std::unique_ptr<float[]> packed(new float[KC * NR_F32]);
        panel_f32(xp, static_cast<const float*>(op.w), op.y, m0, m1, K, op.N, n0, width, next, next_ld, packed.get());
      } else {
        panel_f32(xp, static_cast<const float*>(op.w), op.y, m0, m1, K, op.N, n0, width, next, next_ld);
      }
    });
  } else if (x.element_type() == ffi::DataType::BF16) {
    const uint16_t* xp = static_cast<const uint16_t*>(x.untyped_data());
    if (K % 32 == 0 && amx_permitted() && transposed) {
      const int64_t m_pad = (M + MR_AMX - 1) / MR_AMX * MR_AMX;
      std::vector<uint16_t> xb(static_cast<size_t>(m_pad * K));
      pack_x_pairs(xp, M, m_pad, K, xb.data());
      for_items<uint16_t>(pool, M, ops, NR_AMX, MR_AMX, K, [&](const Operand& op, int64_t n0, int64_t width,
                                                                int64_t m0, int64_t m1, const uint16_t*, int64_t) {
        panel_amx_t(static_cast<const uint16_t*>(op.w), xb.data(), m_pad, op.y, M, m0, m1, K, op.N, n0, width);
      }, /*even_items=*/false);
    } else if (K % 32 == 0 && amx_permitted()) {   // a [K, N] weight
      std::vector<uint16_t> x_pad;   // whole blocks of 32 rows, zeros past M
      if (M % MR_AMX != 0) {
        x_pad.assign(static_cast<size_t>((M + MR_AMX - 1) / MR_AMX * MR_AMX * K), 0);
        std::memcpy(x_pad.data(), xp, sizeof(uint16_t) * M * K);
        xp = x_pad.data();
      }
      for_items<uint16_t>(pool, M, ops, NR_AMX, MR_AMX, 0, [&](const Operand& op, int64_t n0, int64_t width,
                                                                int64_t m0, int64_t m1, const uint16_t*, int64_t) {
        thread_local std::unique_ptr<uint16_t[]> packed(new uint16_t[(KC / 2 + 1) * 2 * NR_AMX]);
        panel_amx(xp, static_cast<const uint16_t*>(op.w), op.y, m0, m1, K, op.N, n0, width, packed.get());
      }, /*even_items=*/false);
    } else {
      for_items<uint16_t>(pool, M, ops, NR_BF16, MR_BF16, transposed ? K : 0, [&](const Operand& op, int64_t n0, int64_t width, int64_t m0,
                                                               int64_t m1, const uint16_t* next, int64_t next_ld) {
        thread_local std::unique_ptr<uint16_t[]> packed(new uint16_t[(KC / 2 + 1) * 2 * NR_BF16]);
        panel_bf16(xp, static_cast<const uint16_t*>(op.w), op.y, m0, m1, K, op.N, n0, width, packed.get(),
                   next, next_ld, transposed);
      });
    }
  } else {
    return ffi::Error::InvalidArgument("gemm takes float32 or bfloat16 operands");
  }
  return ffi::Error::Success();
}

// Columns per work item of a pre-packed weight: no panel is packed, so items can be small (two
// threads share q/k/v's 960 columns evenly at a decode step's few rows).
constexpr int64_t NR_PACKED = 64;

// x [M, K] bfloat16 times each pre-packed weight [N_i / 32, K / 2, 32, 2] into y_i [M, N_i], all
// float32 or all bfloat16 (the sums rounded as XLA's convert rounds them).
ffi::Error GemmPackedImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::RemainingArgs ws, ffi::RemainingRets ys) {
  const auto xd = x.dimensions();
  if (xd.size() != 2 || x.element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("gemm_packed takes x [M, K] bfloat16");
  const int64_t M = xd[0], K = xd[1];
  if (!amx_permitted()) return ffi::Error::Internal("gemm_packed runs on AMX tiles, which this process may not use");
  if (K % 32 != 0) return ffi::Error::InvalidArgument("gemm_packed takes K a multiple of 32");
  if (ws.size() == 0 || ws.size() != ys.size())
    return ffi::Error::InvalidArgument("gemm_packed takes one result per weight");
  std::vector<Operand> ops;   // y: float* of either result type (bf16 ones are cast back below)
  const bool out_bf16 = ys.size() > 0 && ys.get<ffi::AnyBuffer>(0).has_value() &&
                        (*ys.get<ffi::AnyBuffer>(0))->element_type() == ffi::DataType::BF16;
  for (size_t i = 0; i < ws.size(); ++i) {
    auto w = ws.get<ffi::AnyBuffer>(i);
    auto y = ys.get<ffi::AnyBuffer>(i);
    if (!w.has_value() || !y.has_value()) return ffi::Error::InvalidArgument("gemm_packed: a weight or result of a wrong type");
    const auto wd = w->dimensions();
    if (w->element_type() != ffi::DataType::BF16 || wd.size() != 4 || wd[1] * 2 != K || wd[2] != 32 || wd[3] != 2)
      return ffi::Error::InvalidArgument("gemm_packed takes bfloat16 weights [N / 32, K / 2, 32, 2]");
    if ((*y)->element_type() != (out_bf16 ? ffi::DataType::BF16 : ffi::DataType::F32))
      return ffi::Error::InvalidArgument("gemm_packed's results are all float32 or all bfloat16");
    const int64_t n = wd[0] * 32;
    if ((*y)->element_count() != static_cast<size_t>(M * n)) return ffi::Error::InvalidArgument("y must be [M, N]");
    if (K == 0) std::memset((*y)->untyped_data(), 0, (*y)->size_bytes());
    if (M > 0 && n > 0) ops.push_back({w->untyped_data(), static_cast<float*>((*y)->untyped_data()), n});
  }
  if (ops.empty() || K == 0) return ffi::Error::Success();
  const uint16_t* xp = static_cast<const uint16_t*>(x.untyped_data());
  for_items<uint16_t>(pool, M, ops, NR_PACKED, MR_AMX, 0, [&](const Operand& op, int64_t n0, int64_t width,
                                                             int64_t m0, int64_t m1, const uint16_t*, int64_t) {
    uint16_t* y16 = out_bf16 ? reinterpret_cast<uint16_t*>(op.y) : nullptr;
    panel_amx_packed(xp, static_cast<const uint16_t*>(op.w), op.y, m0, m1, K, op.N, n0, width, y16);
  }, /*even_items=*/false);
  return ffi::Error::Success();
}

ffi::Error GemmImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::RemainingArgs ws, ffi::RemainingRets ys,
                    int64_t transposed, int64_t f32_tiles) {
  return GemmRows(pool, x, ws, ys, transposed, std::numeric_limits<int64_t>::max(), f32_tiles);
}

ffi::Error GemmValidRowsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> rows, ffi::AnyBuffer x, ffi::RemainingArgs ws,
                             ffi::RemainingRets ys, int64_t transposed, int64_t f32_tiles) {
  if (rows.element_count() != 1) return ffi::Error::InvalidArgument("gemm's row count is one int32");
  return GemmRows(pool, x, ws, ys, transposed, rows.typed_data()[0], f32_tiles);
}

}  // namespace

extern "C" int JaxserveGemmAmx() { return amx_permitted() ? 1 : 0; }

#else  // no AVX-512 BF16 on the build machine: the handler exists, and says it cannot run

extern "C" int JaxserveGemmSupported() { return 0; }
extern "C" int JaxserveGemmAmx() { return 0; }

namespace {
ffi::Error GemmImpl(ffi::ThreadPool, ffi::AnyBuffer, ffi::RemainingArgs, ffi::RemainingRets, int64_t, int64_t) {
  return ffi::Error::Internal("jaxserve_gemm was built without AVX-512 BF16");
}
ffi::Error GemmValidRowsImpl(ffi::ThreadPool, ffi::Buffer<ffi::S32>, ffi::AnyBuffer, ffi::RemainingArgs,
                             ffi::RemainingRets, int64_t, int64_t) {
  return ffi::Error::Internal("jaxserve_gemm was built without AVX-512 BF16");
}
ffi::Error GemmPackedImpl(ffi::ThreadPool, ffi::AnyBuffer, ffi::RemainingArgs, ffi::RemainingRets) {
  return ffi::Error::Internal("jaxserve_gemm was built without AVX-512 BF16");
}
}  // namespace

#endif

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveGemm, GemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()         // XLA's intra-op threads
                                  .Arg<ffi::AnyBuffer>()          // x [M, K]
                                  .RemainingArgs()                // weights w_i [K, N_i]
                                  .RemainingRets()                // results y_i [M, N_i] float32
                                  .Attr<int64_t>("transposed")    // 1: the weights are [N_i, K]
                                  .Attr<int64_t>("f32_tiles"));   // 1: float32 [N_i, K] weights on AMX tiles

// As JaxserveGemm, for the first `rows` rows of x only (a step's sampling rows before its padding):
// the other rows of the results are 0.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveGemmValidRows, GemmValidRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()   // rows [] int32: how many rows of x to compute
                                  .Arg<ffi::AnyBuffer>()          // x [M, K]
                                  .RemainingArgs()                // weights
                                  .RemainingRets()                // results [M, N_i] float32
                                  .Attr<int64_t>("transposed")
                                  .Attr<int64_t>("f32_tiles"));

// x [M, K] bfloat16 times weights pre-packed for the tiles ([N_i / 32, K / 2, 32, 2]; AMX only), into
// float32 or bfloat16 results.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveGemmPacked, GemmPackedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // x [M, K] bfloat16
                                  .RemainingArgs()                // packed weights
                                  .RemainingRets());              // results [M, N_i] float32 or bfloat16
